"""``xmod bench``: speed figures of the model family, measured side by side in one run.

Everything is a ratio or a rate measured *in the same process, interleaved*: each
round times one full optimiser step of every model, plus a matmul-peak probe,
with the order reversed every other round (A B C, C B A, ...) so that a
neighbour's load on a shared machine hits all of them alike and the models
compared sit next to each other. Each figure is the median over rounds, with
min and max; ratios are the median of the per-round ratios (a paired
comparison), not a ratio of medians. Every model takes a warm-up step first.

A step is what the trainer does per optimiser step: forward and backward under
the trainer's ``auto`` dtype (bf16 autocast where the device multiplies bf16
natively, else fp32; :func:`xmodlm.hardware.resolve_dtype`; the total loss,
auxiliary losses included), gradient clipping at
1.0, AdamW (fused where the platform has it), ``zero_grad(set_to_none=True)``.
On CUDA every timed region starts and ends with a device synchronise.

Eager or compiled: the run first times ``torch.compile`` per block against
eager (dense blocks on the dense model, routed blocks on the X-MoD model) and
then compiles, in every model, exactly the block kinds for which compiled was
faster (median of the paired ratios); the ``compile`` section and every
``train_step`` entry say which. On a CPU the process keeps
freed memory for reuse (:func:`xmodlm.hardware.retain_freed_memory`), as CUDA's caching
allocator does.

MFU is model training FLOPs (``flops.count``: 3 x forward, matmuls only, as
DESIGN 4 counts them) per second over the matmul throughput in the steps'
dtype measured in the same round (``matmul_peak_gflops``), not a datasheet peak.

``run_bench`` returns one JSON-able dict; ``xmod bench --json`` prints it. The
method, the machine and the figures measured on it are in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from xmodlm import flops, record
from xmodlm.bench.decode import decode
from xmodlm.config import ModelConfig, load_config
from xmodlm.errors import UserError
from xmodlm.hardware import (
    autocast_dtype,
    environment_record,
    measure_matmul_gflops,
    resolve_device,
    resolve_dtype,
    retain_freed_memory,
)
from xmodlm.model import Transformer
from xmodlm.reference_gpt import ReferenceGPT, reference_optimizer
from xmodlm.train.optim import build_optimizer

CAPACITY = 0.125
LR = 1e-4  # small: timings must not depend on the random-data run diverging
GRAD_CLIP = 1.0

# Targets on a 2-core AVX-512 bf16 CPU (the benchmark issue); "min" means the
# figure must be at least the bound, "max" at most.
TARGETS = {
    "xmod_vs_dense_same_params.efficiency": ("min", 0.85),
    "xmod_vs_dense_flop_matched.time_ratio": ("max", 1.10),
    "train_step.dense.mfu": ("min", 0.40),
    "reference_gpt.dense_vs_reference": ("min", 1.0),
}

# Op names that make up routing in an X-MoD step (forward and backward), for the
# profiler-based overhead figure. ``_RouteFn`` is the router + top-k + gather node.
ROUTING_OPS = {
    "_RouteFn": "router_topk_gather",
    "_RouteFnBackward": "router_topk_gather",
    "aten::scatter_add": "scatter",
    "ScatterAddBackward0": "scatter",
    "aten::scatter": "selection_mask",
    "aten::gather": "gate_gather",
    "GatherBackward0": "gate_gather",
}


# --- small helpers -------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


# --- the models ----------------------------------------------------------------------


def bench_configs(quick: bool = False) -> dict[str, ModelConfig]:
    """The benchmark's model configs, keyed by the names used in the output.

    ``dense`` is the ``bench-dense`` preset; ``xmod_s4_c0125`` is ``bench-xmod``
    (12 blocks); ``mod`` and ``xmod_s8_c0125`` get the depth that FLOP-matches the
    dense model (``flops.flop_match``); ``moe`` is the dense model with 8 experts,
    top-2, each half the dense MLP width; ``dense_same_params`` is the dense model
    with X-MoD's 12 blocks. ``quick`` shrinks width, context and vocabulary for
    a smoke run.
    """
    shrink = ["model.d_model=128", "model.n_heads=4", "model.context=256", "model.vocab_size=1024"]
    over = shrink if quick else []
    dense = load_config("bench-dense", over).model
    xmod = load_config("bench-xmod", over).model
    mod, _ = flops.flop_match(dense, **record.MOD_RECIPE)
    xmod8, _ = flops.flop_match(
        dense, stride=8, capacity=CAPACITY, gating=xmod.gating, balance_coef=xmod.balance_coef
    )
    moe = dataclasses.replace(
        dense, mlp="moe", **record.MOE_DEFAULTS,
        moe_d_ff=record.moe_expert_dim(dense.ffn_dim, record.MOE_DEFAULTS["moe_top_k"]),
    )
    moe.validate()
    same = dataclasses.replace(dense, n_layers=xmod.n_layers)
    return {
        "dense": dense,
        "mod": mod,
        "xmod_s4_c0125": xmod,
        "xmod_s8_c0125": xmod8,
        "moe": moe,
        "dense_same_params": same,
    }


@dataclasses.dataclass
class Case:
    """One model being timed: its step function and what it costs analytically."""

    name: str
    cfg: ModelConfig
    model: nn.Module
    step: Callable[[], None]
    flops_per_token: float
    tokens_per_step: int
    mode: str = "eager"  # or which blocks are compiled (torch.compile per block)
    times: list[float] = dataclasses.field(default_factory=list)


def _make_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    device: torch.device,
    reference: bool,
) -> Callable[[], None]:
    dtype = resolve_dtype("auto", device)
    autocast = (
        contextlib.nullcontext()
        if dtype == "fp32"
        else torch.autocast(device_type=device.type, dtype=autocast_dtype(dtype))
    )

    def step() -> None:
        with autocast:
            if reference:
                _, loss = model(x, y)
            else:
                loss = model(x, y).total_loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


BLOCK_KINDS = ("dense", "routed")


def _block_kind(block: nn.Module) -> str | None:
    """``dense`` (anchor), ``routed`` (sparse) or None (MoE: data-dependent shapes)."""
    from xmodlm.model.blocks import RoutedBlock
    from xmodlm.model.moe import MoEMLP

    if isinstance(block, RoutedBlock):
        return "routed"
    if isinstance(getattr(getattr(block, "block", None), "mlp", None), MoEMLP):
        return None
    return "dense"


def compile_blocks(model: Transformer, kinds: frozenset[str] | set[str]) -> None:
    """``torch.compile`` in place the blocks whose kind (:data:`BLOCK_KINDS`) is in ``kinds``.

    Per block rather than the whole model: blocks of one type and shape share a
    compiled graph, so every model of the benchmark compiles in seconds after the
    first; each block type can take the mode that is faster for it; the head,
    loss and optimiser stay eager. MoE blocks always stay eager.
    """
    for block in model.blocks:
        if _block_kind(block) in kinds:
            block.compile()


def _case(
    name: str,
    cfg: ModelConfig,
    batch: int,
    device: torch.device,
    reference: bool = False,
    compiled: frozenset[str] | set[str] = frozenset(),
) -> Case:
    torch.manual_seed(0)
    model: nn.Module
    if reference:
        model = ReferenceGPT(cfg).to(device)
        opt = reference_optimizer(model, lr=LR)
    else:
        model = Transformer(cfg).to(device)
        opt = build_optimizer(model, dataclasses.replace(load_config("bench-dense").train, lr=LR))
        if compiled:
            compile_blocks(model, compiled)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.context + 1), generator=gen)
    x, y = tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)
    return Case(
        name=name,
        cfg=cfg,
        model=model,
        step=_make_step(model, opt, x, y, device, reference),
        flops_per_token=flops.count(cfg).flops_train,
        tokens_per_step=batch * cfg.context,
        mode=_mode_name(model, compiled),
    )


def _mode_name(model: nn.Module, compiled: frozenset[str] | set[str]) -> str:
    kinds = {_block_kind(b) for b in getattr(model, "blocks", [])} - {None}
    done = sorted(kinds & set(compiled))
    if not done:
        return "eager"
    if done == sorted(kinds):
        return "compiled"
    return "compiled " + "+".join(done) + " blocks, others eager"


def _timed(case: Case, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    case.step()
    _sync(device)
    return time.perf_counter() - t0


def _interleave(
    cases: list[Case],
    reps: int,
    device: torch.device,
    warmup: int,
    peak_n: int,
    deadline: float | None = None,
    min_reps: int = 3,
) -> tuple[list[float], list[float]]:
    """Warm up, then up to ``reps`` rounds over all cases plus matmul-peak probes.

    Rounds alternate the case order forwards and backwards (A B C, C B A, ...),
    so cases listed next to each other are timed next to each other and a slow
    drift in the machine's load cancels out of their ratio. Stops after
    ``min_reps`` rounds once ``deadline`` (a ``perf_counter`` time) has passed.
    Returns the per-round bf16 and fp32 matmul throughputs (GFLOP/s); bf16 is
    measured only where the steps run in bf16 (emulated bf16 takes seconds a
    matmul and is empty then).
    """
    with_bf16 = resolve_dtype("auto", device) == "bf16"
    for case in cases:
        for _ in range(warmup):
            case.step()
    _sync(device)
    peak_bf16: list[float] = []
    peak_fp32: list[float] = []
    for r in range(reps):
        order = cases if r % 2 == 0 else cases[::-1]
        if with_bf16:
            peak_bf16.append(measure_matmul_gflops(torch.bfloat16, device, peak_n, tries=3))
        for case in order:
            case.times.append(_timed(case, device))
        peak_fp32.append(measure_matmul_gflops(torch.float32, device, peak_n, tries=3))
        if deadline is not None and r + 1 >= min_reps and time.perf_counter() > deadline:
            break
    return peak_bf16, peak_fp32


def _step_figures(case: Case, peak: list[float]) -> dict[str, Any]:
    """Time, throughput and MFU against ``peak``: the per-round matmul peak (GFLOP/s)
    in the dtype the steps run in."""
    tok_s = [case.tokens_per_step / t for t in case.times]
    mfu = [
        case.flops_per_token * case.tokens_per_step / t / (p * 1e9)
        for t, p in zip(case.times, peak, strict=True)
    ]
    counts = flops.count(case.cfg)
    return {
        "ms": _summary([1000 * t for t in case.times]),
        "tokens_per_s": statistics.median(tok_s),
        "mfu": _summary(mfu),
        "flops_per_token_train": case.flops_per_token,
        "params_total": counts.params_total,
        "params_active": counts.params_active,
        "n_layers": case.cfg.n_layers,
        "layout": case.cfg.block_layout,
        "tokens_per_step": case.tokens_per_step,
        "reps": len(case.times),
    }


def _ratios(num: Case, den: Case) -> dict[str, float]:
    """Per-round ratio num_time / den_time, summarised."""
    return _summary([a / b for a, b in zip(num.times, den.times, strict=True)])


# --- sections ------------------------------------------------------------------------


def routing_overhead(case: Case, device: torch.device, steps: int = 2) -> dict[str, Any]:
    """Share of an X-MoD step spent routing, from torch.profiler op-level CPU times.

    Method: profile ``steps`` eager steps; every event whose name is in
    :data:`ROUTING_OPS` (the router + top-k + gather autograd node forward and
    backward, the out-of-place scatter-add and its backward, the selection mask,
    the gather of the gate logits and its backward) counts with its *total* CPU
    time, unless it runs inside another such event; the share is that sum over
    the profiled steps' wall time. Profiling adds a little per-op overhead, so the
    share of these many small ops is if anything overstated. On CUDA the figure is
    host-side time, which is not device time: it is reported but means less.
    """
    from torch.profiler import ProfilerActivity, profile

    case.step()
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            case.step()
        _sync(device)
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
        " scatter-add, selection mask, gate gather; forward and backward), outermost events"
        f" only, over {steps} eager steps / their wall time",
    }


def compile_probe(
    configs: dict[str, ModelConfig],
    eager: dict[str, Case],
    batch: int,
    device: torch.device,
    reps: int,
    peak_n: int,
    deadline: float | None = None,
) -> tuple[dict[str, Any], frozenset[str]]:
    """Which block kinds to compile: eager vs ``torch.compile`` per block, interleaved.

    Times, in paired rounds, the dense model eager and with its blocks compiled,
    and the X-MoD model eager, with its dense anchors compiled and with every
    block compiled. Dense blocks are compiled if the compiled dense model was
    faster (median of the paired ratios below 1); routed blocks are if compiling
    them too (all vs anchors-only X-MoD) was faster. Returns the figures and the
    set of block kinds to compile.
    """
    out: dict[str, Any] = {"how": "torch.compile per block (blocks of one shape share a graph)"}
    variants = {
        "dense:eager": ("dense", frozenset()),
        "dense:compiled": ("dense", frozenset({"dense"})),
        "xmod:eager": ("xmod_s4_c0125", frozenset()),
        "xmod:compiled_anchors": ("xmod_s4_c0125", frozenset({"dense"})),
        "xmod:compiled": ("xmod_s4_c0125", frozenset(BLOCK_KINDS)),
    }
    cases: dict[str, Case] = {}
    try:
        for label, (name, kinds) in variants.items():
            if not kinds:
                src = eager[name]  # the eager model, with a fresh list of times
                cases[label] = dataclasses.replace(src, name=label, times=[])
                continue
            case = _case(label, configs[name], batch, device, compiled=kinds)
            t0 = time.perf_counter()
            case.step()  # compiles forward and backward (or reuses a shared graph)
            _sync(device)
            out[f"{label}:first_step_s"] = time.perf_counter() - t0
            cases[label] = case
    except Exception as err:  # noqa: BLE001 - e.g. a platform without a working C++ compiler
        return {"unavailable": f"torch.compile failed: {type(err).__name__}: {err}"[:300]}, (
            frozenset()
        )
    _interleave(list(cases.values()), reps, device, warmup=1, peak_n=peak_n,
                deadline=deadline, min_reps=2)
    for label, case in cases.items():
        out[label] = {"ms": _summary([1000 * t for t in case.times])}
    comparisons = {
        "dense_blocks": ("dense:compiled", "dense:eager"),
        "routed_blocks": ("xmod:compiled", "xmod:compiled_anchors"),
        "xmod_all_vs_eager": ("xmod:compiled", "xmod:eager"),
        "xmod_anchors_vs_eager": ("xmod:compiled_anchors", "xmod:eager"),
    }
    kinds: set[str] = set()
    for key, (a, b) in comparisons.items():
        ratio = _ratios(cases[a], cases[b])
        out[f"{key}_compiled_over_eager"] = ratio
        if key.endswith("_blocks") and ratio["median"] < 1.0:
            kinds.add(key.split("_")[0])
    out["reps"] = len(cases["dense:eager"].times)
    return out, frozenset(kinds)


def law_fit(quick: bool) -> dict[str, Any]:
    """Seconds for the law-fit benchmark, if the law package provides it."""
    fn = None
    for module in ("xmodlm.law.dense", "xmodlm.law.bench"):
        try:
            mod = __import__(module, fromlist=["bench_fit"])
        except ImportError:
            continue
        fn = getattr(mod, "bench_fit", None)
        if fn is not None:
            break
    if fn is None:
        return {"unavailable": "xmodlm.law has no bench_fit (law fitting not installed)"}
    n_runs, n_boot = (200, 100) if quick else (200, 1000)
    seconds = float(fn(n_runs=n_runs, n_boot=n_boot))
    return {"seconds": seconds, "n_runs": n_runs, "n_boot": n_boot, "source": fn.__module__}


def _get(result: dict[str, Any], path: str) -> float | None:
    node: Any = result
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    if isinstance(node, dict):
        node = node.get("median")
    return node if isinstance(node, (int, float)) else None


def _targets(result: dict[str, Any]) -> dict[str, Any]:
    """Each target with its measured median and pass/miss (None: not applicable)."""
    out: dict[str, Any] = {}
    for path, (kind, bound) in TARGETS.items():
        value = _get(result, path)
        ok = None if value is None else (value >= bound if kind == "min" else value <= bound)
        if result.get("quick"):
            ok = None  # the targets are set for the bench size, not the smoke size
        out[path] = {"value": value, kind: bound, "pass": ok}
    if result.get("quick"):
        out["note"] = "quick mode: tiny models, where fixed overheads dominate; no pass/miss"
    return out


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# --- the entry point -----------------------------------------------------------------


def run_bench(
    device: str = "cpu",
    quick: bool = False,
    reps: int | None = None,
    include_law: bool = True,
    include_decode: bool = True,
    include_compile: bool | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Run the benchmark and return one JSON-able dict of figures (see module docs).

    ``device``: ``cpu`` or ``cuda`` (the ``auto`` dtype on both). ``quick``: a smaller
    model size and fewer rounds, under a minute on a 2-core CPU. ``reps``: timed
    rounds of the training-step comparison (default 5, quick 3; on CPU the full
    run stops after 3 once its time budget is spent, so that the whole bench
    stays under five minutes). ``include_compile``: first time ``torch.compile``
    against eager for the dense and X-MoD models, and time every model in the
    mode that won (default on, off in quick mode where compiling would
    dominate; off means everything eager). ``progress``: say what runs on stderr.
    """
    if reps is not None and (isinstance(reps, bool) or not isinstance(reps, int) or reps < 1):
        raise UserError(f"reps={reps!r}: must be an integer >= 1 (timed rounds)")
    t_start = time.perf_counter()
    say = _log if progress else (lambda msg: None)
    dev = resolve_device(device)
    if include_compile is None:
        include_compile = not quick
    reps = reps or (3 if quick else 5)
    batch = 2 if quick else load_config("bench-dense").train.batch_size
    peak_n = 8192 if dev.type == "cuda" else (512 if quick else 1024)
    # time budget on a CPU (seconds from the start) after which the compile probe
    # and the training-step rounds stop, each after its minimum number of rounds
    budget = None if dev.type == "cuda" or quick else {"probe": 65.0, "steps": 165.0}
    allocator = retain_freed_memory() if dev.type == "cpu" else "CUDA caching allocator"
    configs = bench_configs(quick)
    dense_cfg = configs["dense"]
    result: dict[str, Any] = {
        "device": dev.type,
        "quick": quick,
        "dtype": f"{resolve_dtype('auto', dev)} compute, fp32 weights",
        "batch": batch,
        "context": dense_cfg.context,
        "d_model": dense_cfg.d_model,
        "vocab_size": dense_cfg.vocab_size,
        "allocator": allocator,
        "load_avg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }

    say(f"building models ({'quick' if quick else 'bench'} size)")
    eager = {name: _case(name, cfg, batch, dev) for name, cfg in configs.items()}
    reference = _case("reference_gpt", dense_cfg, batch, dev, reference=True)

    # --- eager or compiled: measured first, then used ----------------------------
    kinds: frozenset[str] = frozenset()
    if include_compile:
        say("eager vs torch.compile per block kind (dense, X-MoD)")
        deadline = None if budget is None else t_start + budget["probe"]
        probe, kinds = compile_probe(configs, eager, batch, dev, 3, peak_n, deadline)
        result["compile"] = {**probe, "compiled_block_kinds": sorted(kinds)}
    else:
        result["compile"] = {"skipped": "quick mode" if quick else "include_compile=False",
                             "compiled_block_kinds": []}
    result["compile"]["note"] = (
        "the train_step figures compile exactly the block kinds listed in"
        " compiled_block_kinds (the kinds for which compiled was faster, median of the"
        " paired rounds) and"
        " run everything else eager; MoE blocks are always eager. The trainer's"
        " train.compile=auto compiles the whole model on CUDA only"
    )

    timed: dict[str, Case] = {}
    for name, cfg in configs.items():
        case = eager[name]
        if kinds and _mode_name(case.model, kinds) != "eager":
            case = _case(name, cfg, batch, dev, compiled=kinds)
        timed[name] = case
    # listed so that the pairs compared are neighbours in every round
    order = [reference, timed["dense"], timed["xmod_s4_c0125"], timed["dense_same_params"],
             timed["mod"], timed["xmod_s8_c0125"], timed["moe"]]
    mode = timed["dense"].mode
    if mode != "eager":
        order.insert(0, eager["dense"])  # for the eager-vs-eager reference figure
        eager["dense"].times.clear()

    # --- training steps, all models interleaved ----------------------------------
    deadline = None if budget is None else t_start + budget["steps"]
    say(f"timing up to {reps} interleaved rounds of {len(order)} training steps")
    peak_bf16, peak_fp32 = _interleave(order, reps, dev, warmup=1, peak_n=peak_n,
                                       deadline=deadline)
    result["matmul_peak_gflops"] = {
        **({"bf16": _summary(peak_bf16)} if peak_bf16 else {}),
        "fp32": _summary(peak_fp32),
        "n": peak_n,
    }
    peak = peak_bf16 or peak_fp32  # the dtype the steps ran in
    result["train_step"] = {
        name: {**_step_figures(timed[name], peak), "mode": timed[name].mode}
        for name in ("dense", "mod", "xmod_s4_c0125", "xmod_s8_c0125", "moe", "dense_same_params")
    }
    dense_flops = flops.count(dense_cfg).flops_train
    for name in ("mod", "xmod_s8_c0125", "moe"):
        result["train_step"][name]["flops_vs_dense"] = timed[name].flops_per_token / dense_flops

    dense, xmod, same = timed["dense"], timed["xmod_s4_c0125"], timed["dense_same_params"]
    measured = _ratios(same, xmod)
    ideal = same.flops_per_token / xmod.flops_per_token
    result["xmod_vs_dense_same_params"] = {
        "speedup_measured": measured,
        "speedup_ideal": ideal,
        "efficiency": {k: v / ideal for k, v in measured.items()},
        "dense_layout": same.cfg.block_layout,
        "xmod_layout": xmod.cfg.block_layout,
        "params_total": {
            "dense": flops.count(same.cfg).params_total,
            "xmod": flops.count(xmod.cfg).params_total,
        },
        "modes": {"dense": same.mode, "xmod": xmod.mode},
    }
    result["xmod_vs_dense_flop_matched"] = {
        "time_ratio": _ratios(xmod, dense),
        "flop_ratio": xmod.flops_per_token / dense.flops_per_token,
        "params_ratio": flops.count(xmod.cfg).params_total / flops.count(dense.cfg).params_total,
        "modes": {"dense": dense.mode, "xmod": xmod.mode},
    }
    result["reference_gpt"] = {
        **_step_figures(reference, peak),
        "dense_vs_reference": _ratios(reference, dense),
        "dense_mode": mode,
        "what": "xmodlm.reference_gpt.ReferenceGPT, eager: the dense shape written plainly"
        " (separate q/k/v/gate/up, autograd norm and rotary, plain AdamW)",
    }
    if mode != "eager":
        result["reference_gpt"]["dense_vs_reference_eager"] = _ratios(reference, eager["dense"])
    say("profiling the routing overhead of an (eager) X-MoD step")
    result["routing_overhead"] = routing_overhead(eager["xmod_s4_c0125"], dev)

    # --- decode and law ------------------------------------------------------------
    if include_decode:
        say("decode: dense vs X-MoD at the same total parameters")
        dense_m, xmod_m = eager["dense_same_params"].model, eager["xmod_s4_c0125"].model
        assert isinstance(dense_m, Transformer) and isinstance(xmod_m, Transformer)
        result["decode"] = decode(dense_m, xmod_m, quick)
    else:
        result["decode"] = {"skipped": "include_decode=False"}
    del eager, timed, order, reference, dense, xmod, same
    if include_law:
        say("law fit")
        result["law_fit_s"] = law_fit(quick)
    else:
        result["law_fit_s"] = {"skipped": "include_law=False"}

    result["targets"] = _targets(result)
    env = environment_record()
    keep = ("cpu", "cpu_count", "torch_threads", "torch", "python", "platform", "cuda",
            "git_commit", "xmodlm")
    result["machine"] = {k: env.get(k) for k in keep}
    result["load_avg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    result["wall_s"] = time.perf_counter() - t_start
    return result
