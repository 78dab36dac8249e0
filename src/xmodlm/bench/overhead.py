"""Where a training step's time goes, from op-level profiler times.

:func:`routing_overhead`: the share of an X-MoD step spent routing (the router,
top-k, gather and scatter, the selection mask and the gate gather, forward and
backward). :func:`architecture_parts`: what our dense model's positions, norms,
MLP activation and loss cost per step beside the GPT-2 reference's. Only the
outermost matching event of each nest counts (a fused autograd node contains
its own ops), so nothing is counted twice.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from xmodlm.bench.step import Case, sync

# Op names that make up routing in an X-MoD step (forward and backward).
# ``_RouteFn`` is the fused router + top-k + gather autograd node, ``_GatedScatterFn``
# the fused gate + scale + scatter-add node; the plain op names catch routing ops
# outside those nodes.
ROUTING_OPS = {
    "_RouteFn": "router_topk_gather",
    "_RouteFnBackward": "router_topk_gather",
    "_GatedScatterFn": "gate_scatter",
    "_GatedScatterFnBackward": "gate_scatter",
    "aten::scatter_add": "scatter",
    "ScatterAddBackward0": "scatter",
    "aten::scatter": "selection_mask",
    "aten::gather": "gate_gather",
    "GatherBackward0": "gate_gather",
}


def _profiled_parts(
    case: Case, device: torch.device, names: dict[str, str], steps: int
) -> tuple[dict[str, float], float]:
    """CPU seconds per part over ``steps`` profiled steps (outermost events named in
    ``names`` only), and the steps' wall time."""
    from torch.profiler import ProfilerActivity, profile

    case.step()
    sync(device)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            case.step()
        sync(device)
        wall = time.perf_counter() - t0
    by_part: dict[str, float] = {}
    for ev in prof.events():
        part = names.get(ev.name)
        if part is None:
            continue
        parent, nested = ev.cpu_parent, False
        while parent is not None and not nested:
            nested = parent.name in names  # counted with its outermost matching event
            parent = parent.cpu_parent
        if not nested:
            by_part[part] = by_part.get(part, 0.0) + ev.cpu_time_total / 1e6  # us -> s
    return by_part, wall


# What distinguishes our dense block from GPT-2's, by profiler event name: each
# architecture's positions, norms, MLP activation and loss (forward and backward).
ARCHITECTURE_OPS = {
    "ours": {
        "_RotaryQKVFn": "positions", "_RotaryQKVFnBackward": "positions",
        "_RMSNormFn": "norms", "_RMSNormFnBackward": "norms",
        "_SiluMulFn": "mlp_activation", "_SiluMulFnBackward": "mlp_activation",
        "_CrossEntropyFn": "loss", "_CrossEntropyFnBackward": "loss",
    },
    "gpt2": {
        "aten::layer_norm": "norms", "NativeLayerNormBackward0": "norms",
        "aten::gelu": "mlp_activation", "GeluBackward0": "mlp_activation",
        "aten::cross_entropy_loss": "loss", "LogSoftmaxBackward0": "loss",
        "NllLossBackward0": "loss",
    },
}


def architecture_parts(
    ours: Case, gpt2: Case, device: torch.device, steps: int = 2
) -> dict[str, Any]:
    """What our dense model's distinctive parts cost per step beside the GPT-2 reference's.

    Parts: ``positions`` (rotary on q and k; GPT-2's learned positions are one
    (B, T, D) add and an embedding lookup a step, not separated: zero here),
    ``norms`` (RMSNorm in fp32 against LayerNorm), ``mlp_activation`` (SiLU-gate
    product against GELU), ``loss`` (cross-entropy, forward and backward). The
    matmuls differ only by the MLP's FLOPs (``flops_vs_dense`` in the size's
    models). Times are the profiler's op-level CPU times, outermost events only,
    over ``steps`` eager steps each; ``step_ms`` is each model's profiled step.
    """
    out: dict[str, Any] = {}
    for kind, case in (("ours", ours), ("gpt2", gpt2)):
        by_part, wall = _profiled_parts(case, device, ARCHITECTURE_OPS[kind], steps)
        out[kind] = {
            "step_ms": 1000 * wall / steps,
            "parts_ms": {k: 1000 * v / steps for k, v in sorted(by_part.items())},
        }
    parts = sorted(set(out["ours"]["parts_ms"]) | set(out["gpt2"]["parts_ms"]))
    out["ours_minus_gpt2_ms"] = {
        p: out["ours"]["parts_ms"].get(p, 0.0) - out["gpt2"]["parts_ms"].get(p, 0.0) for p in parts
    }
    out["method"] = (f"torch.profiler op-level CPU time, outermost events only, over {steps}"
                     " eager steps of each model")
    return out


def routing_overhead(case: Case, device: torch.device, steps: int = 2) -> dict[str, Any]:
    """Share of an X-MoD step spent routing, from torch.profiler op-level CPU times.

    Method: profile ``steps`` eager steps; every event whose name is in
    :data:`ROUTING_OPS` (the router + top-k + gather node and the gate + scale +
    scatter-add node, forward and backward, the selection mask, and any scatter or
    gather outside those nodes) counts with its *total* CPU
    time, unless it runs inside another such event; the share is that sum over
    the profiled steps' wall time. Profiling adds a little per-op overhead, so the
    share of these many small ops is if anything overstated. On CUDA the figure is
    host-side time, which is not device time: it is reported but means less.
    """
    by_part, wall = _profiled_parts(case, device, ROUTING_OPS, steps)
    total = sum(by_part.values())
    return {
        "share": total / wall,
        "ms_per_step": 1000 * total / steps,
        "step_ms_profiled": 1000 * wall / steps,
        "by_part_ms_per_step": {k: 1000 * v / steps for k, v in sorted(by_part.items())},
        "method": "torch.profiler op-level CPU time of routing ops (router+top-k+gather node,"
        " gate+scale+scatter node, selection mask, any scatter or gather outside them;"
        " forward and backward), outermost events"
        f" only, over {steps} eager steps / their wall time",
    }
