"""Diagnostics of the residual stream: per-block RMS, for comparing gates.

The variance-scaled gate exists to keep the residual stream's growth with depth
close to that of the compute-matched dense model. ``residual_rms`` measures it
(mean over tokens of the per-token RMS after every block) so the claim is
checked, not asserted: at initialisation here, after training from each run's
``metrics.jsonl`` (every evaluation logs ``residual_rms``).
"""

from __future__ import annotations

import dataclasses

import torch

from xmodlm.config import ModelConfig
from xmodlm.model import Transformer


@torch.no_grad()
def residual_rms(model: Transformer, tokens_BT: torch.Tensor) -> list[float]:
    """Per-block residual RMS of ``model`` on ``tokens_BT`` (top-k routing)."""
    return list(model(tokens_BT, return_stats=True).stats["residual_rms"])


@torch.no_grad()
def added_variance(model: Transformer, tokens_BT: torch.Tensor) -> float:
    """Residual variance the blocks add: mean over tokens and channels of (x_L - x_0)^2.

    x_0 is the embedding, x_L the stream after the last block (top-k routing,
    fp32). This is the quantity the variance-scaled gate's rule targets.
    """
    pos_T = torch.arange(tokens_BT.shape[1], device=tokens_BT.device)
    x0_BTD = model.embed(tokens_BT).float()
    x_BTD, _ = model.run_blocks(x0_BTD, pos_T, "topk", model.rope(pos_T))
    return float((x_BTD - x0_BTD).pow(2).mean())


def compare_gates_at_init(
    cfg: ModelConfig, gatings: tuple[str, ...] = ("sigmoid", "variance_scaled"),
    batch: int = 4, seed: int = 0,
) -> dict[str, list[float]]:
    """Residual RMS per block at initialisation for each gating, same weights otherwise."""
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.context),
                           generator=torch.Generator().manual_seed(seed))
    out = {}
    for gating in gatings:
        torch.manual_seed(seed)
        model = Transformer(dataclasses.replace(cfg, gating=gating)).eval()
        out[gating] = residual_rms(model, tokens)
    return out
