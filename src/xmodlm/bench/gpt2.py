"""A GPT-2-architecture reference model: the other yardstick of ``xmod bench``.

:class:`~xmodlm.bench.reference_gpt.ReferenceGPT` asks "is our dense model a fast
implementation of its own architecture?". This model asks the other question a
reader has: "is our architecture (RMSNorm, rotary, SwiGLU, untied head) as fast
to train as the well-known one?". It is GPT-2 as published, written plainly:
learned absolute position embeddings, LayerNorm with biases, a fused q/k/v
projection with bias, causal SDPA, a GELU MLP four times the width, and an LM
head tied to the token embedding.

It takes width, depth, heads, vocabulary and context from a dense
:class:`~xmodlm.config.ModelConfig`, so the two models differ only in the
architecture choices above. Their FLOPs per token differ only in the MLP: 4 d
hidden units here (8 d^2 weights) against SwiGLU's three matrices of the
config's ``ffn_dim`` (about 8/3 d rounded up), within a few percent of each
other; :func:`gpt2_counts` gives the analytic figures under the conventions of
:mod:`xmodlm.flops`.

Nothing outside the benchmark uses it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from xmodlm.config import ModelConfig

MLP_RATIO = 4  # GPT-2's MLP hidden width is 4 d_model
LN_EPS = 1e-5  # GPT-2's LayerNorm epsilon


class GPT2Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        H = self.n_heads
        q, k, v = self.qkv(x_BTD).split(D, dim=-1)
        q_BHTK, k_BHTK, v_BHTK = (t.view(B, T, H, D // H).transpose(1, 2) for t in (q, k, v))
        y_BHTK = F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTK, is_causal=True)
        return self.proj(y_BHTK.transpose(1, 2).reshape(B, T, D))


class GPT2Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model, eps=LN_EPS)
        self.attn = GPT2Attention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model, eps=LN_EPS)
        self.fc = nn.Linear(d_model, MLP_RATIO * d_model)
        self.proj = nn.Linear(MLP_RATIO * d_model, d_model)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(self.ln1(x_BTD))
        return x_BTD + self.proj(F.gelu(self.fc(self.ln2(x_BTD)), approximate="tanh"))


class GPT2Reference(nn.Module):
    """GPT-2 with ``cfg``'s width, depth, heads, vocabulary and context.

    ``forward(idx, targets)`` returns ``(logits, loss)`` like
    :class:`~xmodlm.bench.reference_gpt.ReferenceGPT`. Weights are initialised as
    GPT-2 does: normal with the config's ``init_std``, the projections into the
    residual stream scaled down by sqrt(2 n_layers), biases zero.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.tok_embed = nn.Embedding(cfg.vocab_size, d)
        self.pos_embed = nn.Embedding(cfg.context, d)
        self.blocks = nn.ModuleList(GPT2Block(d, cfg.n_heads) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(d, eps=LN_EPS)
        self.head = nn.Linear(d, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_embed.weight  # tied: one matrix embeds and predicts
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                nn.init.normal_(p, 0.0, out_std if name.endswith("proj.weight") else cfg.init_std)

    def forward(
        self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        T = idx_BT.shape[1]
        pos_T = torch.arange(T, device=idx_BT.device)
        x_BTD = self.tok_embed(idx_BT) + self.pos_embed(pos_T)
        for block in self.blocks:
            x_BTD = block(x_BTD)
        logits_BTV = self.head(self.ln_f(x_BTD))
        loss = None
        if targets_BT is not None:
            loss = F.cross_entropy(logits_BTV.float().flatten(0, 1), targets_BT.flatten())
        return logits_BTV, loss


@dataclass(frozen=True)
class GPT2Counts:
    """Analytic size of :class:`GPT2Reference` (FLOPs under the :mod:`xmodlm.flops` rules)."""

    params_total: int
    flops_forward: float  # per token, at the config's context
    flops_train: float


def gpt2_counts(cfg: ModelConfig) -> GPT2Counts:
    """Parameters and FLOPs per token of :class:`GPT2Reference` built from ``cfg``.

    Same conventions as :func:`xmodlm.flops.count`: matmuls only (2 m n k),
    attention over all T keys (4 d T per query), embeddings free, training = 3 x
    forward. Parameters count the tied embedding once.
    """
    d, V, T, L = cfg.d_model, cfg.vocab_size, cfg.context, cfg.n_layers
    f = MLP_RATIO * d
    per_block_params = (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
    params = V * d + T * d + L * per_block_params + 2 * d
    per_block_flops = 2 * (3 * d * d + d * d) + 4 * d * T + 2 * (2 * d * f)
    forward = L * per_block_flops + 2 * d * V
    return GPT2Counts(params_total=params, flops_forward=forward, flops_train=3.0 * forward)
