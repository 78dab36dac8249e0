"""Share of an X-MoD training step spent routing, from op-level profiler times.

Routing is the router, top-k, gather and scatter, the selection mask and the
gate gather, forward and backward. Only the outermost routing event of each
nest counts (the fused router + top-k + gather node contains its own ops), so
nothing is counted twice.
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
        part = ROUTING_OPS.get(ev.name)
        if part is None:
            continue
        parent, nested = ev.cpu_parent, False
        while parent is not None and not nested:
            nested = parent.name in ROUTING_OPS  # counted with its outermost routing event
            parent = parent.cpu_parent
        if not nested:
            by_part[part] = by_part.get(part, 0.0) + ev.cpu_time_total / 1e6  # us -> s
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
