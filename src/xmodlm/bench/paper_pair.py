"""The paper's shapes on this machine: an X-MoD A1K8 and the paper's fine-grained
MoE against dense of the same active depth, timed side by side.

All three are the ``cpu-d64`` backbone (width 64, 8 active-equivalent layers,
dense prefix 2) at L = 2048, where attention is most of a dense layer's FLOPs and
an A1K8 spends under half of dense's FLOPs per token; the X-MoD has the
token-choice bias on (the default). The MoE is the paper's 8:64 shape: in every
layer 6 of 64 routed experts plus 2 shared, each of width d_ff / 8, so a token
runs dense's FLOPs plus its router's. The X-MoD figure is the paired step-time
ratio over the FLOP ratio: how much more time a FLOP of the sparse model costs
(target: at most :data:`TARGET`); the MoE's is its step-time ratio to dense, and
the X-MoD's to it. Quick mode shrinks the context.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from xmodlm.bench.sizes import Timing
from xmodlm.bench.step import interleave, make_case, step_figures, versus
from xmodlm.config import load_config

PRESET = "cpu-d64"
CONTEXT, QUICK_CONTEXT = 2048, 256
BATCH = 2
SPARSE = ("model.sparsity=8", "model.anchor_stride=1")
MOE = ("model.mlp=moe", "model.moe_router=fine", "model.n_experts=64", "model.moe_top_k=6",
       "model.moe_shared=2", "model.moe_granularity=8")
TIMING = Timing(reps=8, min_reps=4, budget_s=60.0, warmup=2)
QUICK_TIMING = Timing(reps=3, min_reps=2, budget_s=None)
TARGET = 1.25  # step time over FLOPs, X-MoD / dense


def paper_pair(
    device: torch.device, quick: bool, peak_n: int, say: Callable[[str], None]
) -> dict[str, Any]:
    """Time the pair eagerly, interleaved; returns shapes, step figures and the ratio."""
    context = QUICK_CONTEXT if quick else CONTEXT
    base = (f"model.context={context}", "model.vocab_size=4096")
    configs = {name: load_config(PRESET, [*base, *extra]).model
               for name, extra in (("dense", ()), ("xmod_a1k8", SPARSE), ("moe_8x64", MOE))}
    cases = {name: make_case(name, cfg, BATCH, device) for name, cfg in configs.items()}
    timing = QUICK_TIMING if quick else TIMING
    say(f"paper shapes: A1K8 and MoE 8:64 against dense at L = {context},"
        f" up to {timing.reps} rounds")
    bf16, fp32 = interleave(list(cases.values()), device, reps=timing.reps,
                            min_reps=timing.min_reps, warmup=timing.warmup, peak_n=peak_n,
                            budget_s=timing.budget_s)
    vs = versus(cases["xmod_a1k8"], cases["dense"])
    return {
        "what": f"{PRESET} at L = {context}, batch {BATCH}, eager: X-MoD A1K8 (token-choice"
                " bias) and MoE 8:64 (6 of 64 routed + 2 shared) against dense of the same"
                " active depth",
        "layouts": {name: dataclasses.asdict(c.cfg.depth)["layout"] for name, c in cases.items()},
        "train_step": {name: step_figures(c, bf16 or fp32) for name, c in cases.items()},
        "xmod_vs_dense": vs,
        "moe_vs_dense": versus(cases["moe_8x64"], cases["dense"]),
        "xmod_vs_moe": versus(cases["xmod_a1k8"], cases["moe_8x64"]),
        "time_per_flop_ratio": vs["time_per_flop_ratio"]["median"],
        "target": TARGET,
        "met": vs["time_per_flop_ratio"]["median"] <= TARGET,
    }
