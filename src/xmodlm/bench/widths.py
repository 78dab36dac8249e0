"""X-MoD's training step over FLOP-matched dense's, across widths, at one thread.

At the widths the CPU studies train (128), an X-MoD step costs 1.2-1.35x the
FLOP-matched dense step on an AMX Xeon, although its FLOPs are the same: it has
3x the blocks, each paying fixed per-kernel costs (dispatch, a thread barrier),
and 2-2.5x the parameters for the optimiser to sweep. Both fade against the
matmuls as the width grows. This scan shows where: dense (width w, 4 blocks,
context 512) against X-MoD at S = 4 and S = 8, c = 1/8, FLOP-matched, at widths
:data:`WIDTHS`, one thread (how a sweep worker trains), in the dtype the machine
multiplies natively (``train.dtype=auto``), each model eager and whole-model
compiled (the faster counts), timed in interleaved rounds.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from xmodlm.bench import compile as bench_compile
from xmodlm.bench.sizes import family_configs
from xmodlm.bench.step import Case, interleave, make_case, versus
from xmodlm.config import load_config

WIDTHS = (128, 256, 512, 1024)
QUICK_WIDTHS = (128,)
CONTEXT = 512
# the same tokens a step at every width (4 sequences): a sparse block's matmuls then
# have 4 k = 256 rows at every width, as the studies' steps give them
TOKENS_PER_STEP = 2048
MODELS = ("dense", "xmod_s4_c0125", "xmod_s8_c0125")
REPS, MIN_REPS, BUDGET_S = 6, 3, 60.0


def width_config(width: int, quick: bool = False):  # noqa: ANN201 - ModelConfig
    """The dense reference at ``width``: the ``micro`` preset's 4 blocks, head dim 32
    up to width 256 and 64 above, context 512 (128 in quick mode)."""
    heads = max(4, width // (32 if width <= 256 else 64))
    context = 128 if quick else CONTEXT
    return load_config(
        "micro", [f"model.d_model={width}", f"model.n_heads={heads}", f"model.context={context}"]
    ).model


def width_scan(
    device: torch.device, modes: tuple[str, ...], quick: bool,
    peak_n: int, say: Callable[[str], None],
) -> dict[str, Any]:
    """Step time of X-MoD over FLOP-matched dense at each width, one thread."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    out: dict[str, Any] = {"threads": 1, "context": CONTEXT if not quick else 128,
                           "modes": ["eager", *modes], "widths": {}}
    try:
        for width in QUICK_WIDTHS if quick else WIDTHS:
            bench_compile.reset()
            configs = family_configs(width_config(width, quick))
            batch = max(1, TOKENS_PER_STEP // configs["dense"].context)
            say(f"width scan: width {width}, batch {batch}, {', '.join(out['modes'])}")
            cases: dict[str, dict[str, Case]] = {}
            for name in MODELS:
                eager = make_case(name, configs[name], batch, device)
                cases[name] = {"eager": eager, **{
                    m: make_case(name, configs[name], batch, device, mode=m, base=eager)
                    for m in modes}}
            order = [c for per in cases.values() for c in per.values()]
            interleave(order, device, reps=2 if quick else REPS, min_reps=2 if quick else MIN_REPS,
                       warmup=2, peak_n=peak_n, budget_s=None if quick else BUDGET_S)
            best = {}
            for name, per in cases.items():
                ms = {m: statistics.median(c.times) for m, c in per.items()}
                best[name] = per[bench_compile.faster_mode(ms)]
            row: dict[str, Any] = {"batch": batch, "modes": {n: c.mode for n, c in best.items()}}
            for name in MODELS[1:]:
                row[name] = {"best": versus(best[name], best["dense"]),
                             **{m: versus(cases[name][m], cases["dense"][m])
                                for m in cases[name]}}
            out["widths"][f"w{width}"] = row
            del cases, order, best
    finally:
        torch.set_num_threads(threads_before)
    return out
