"""``run_bench``: every size, every thread count, eager and compiled, in one process.

For each size (:mod:`xmodlm.bench.sizes`) the bench builds the model family
FLOP-matched to the size's dense model, the GPT-2 reference
(:mod:`xmodlm.bench.gpt2`) and the plain :class:`~xmodlm.bench.reference_gpt.ReferenceGPT`;
each model is built eager and again in each compiled mode that changes it
(per block, whole model: :mod:`xmodlm.bench.compile`). Then, at each thread count, all of them are
timed in the same interleaved rounds (:mod:`xmodlm.bench.step`), so every ratio
in the output is a paired comparison from one run. Decode is timed at
:data:`DECODE_SIZES`; routing overhead once, on the first size; the law fit once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from xmodlm import flops
from xmodlm.bench import compile as bench_compile
from xmodlm.bench.decode import decode
from xmodlm.bench.overhead import architecture_parts, routing_overhead
from xmodlm.bench.paper_pair import paper_pair
from xmodlm.bench.sizes import (
    DEVICE_PEAK_N,
    QUICK_PEAK_N,
    BenchSize,
    Timing,
    family_configs,
    parse_sizes,
    parse_threads,
    size_named,
)
from xmodlm.bench.step import Case, interleave, make_case, ratio, step_figures, summary, versus
from xmodlm.bench.targets import evaluate, main_threads, sweep_worker_throughput
from xmodlm.bench.widths import width_scan
from xmodlm.errors import UserError
from xmodlm.hardware import environment_record, resolve_device, resolve_dtype, retain_freed_memory
from xmodlm.model import Transformer

# The sizes decode is timed at (at the main thread count): the studies' shapes and
# the bench size.
DECODE_SIZES = ("w128-t128", "w128-t512", "bench")
# Timing order within a round: models compared with each other sit close together.
ORDER = ("reference_gpt", "gpt2", "dense", "xmod_s4_c0125", "dense_same_params",
         "xmod_s8_c0125", "mod", "moe")
LAW_FIT = {"n_runs": 200, "n_boot": 1000}
QUICK_LAW_FIT = {"n_runs": 200, "n_boot": 100}
MACHINE_KEYS = ("cpu", "cpu_count", "torch_threads", "torch", "python", "platform", "cuda",
                "git_commit", "xmodlm")

Cases = dict[str, dict[str, Case]]  # model name -> mode -> case


def peak_rss_gb() -> float | None:
    """This process's peak resident memory so far, in GB (None where the OS does not
    say): the bench reports it so a run that would not fit a small machine shows it."""
    try:
        import resource
    except ImportError:  # not on every OS
        return None
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux, bytes on macOS
    return kb / (1 << 30 if sys.platform == "darwin" else 1 << 20)


_STARTED = time.perf_counter()


def _log(msg: str) -> None:
    """A progress line on stderr (stdout carries the JSON): elapsed time and peak memory."""
    rss = peak_rss_gb()
    mem = f", peak {rss:.2f} GB" if rss is not None else ""
    print(f"[bench {time.perf_counter() - _STARTED:6.0f} s{mem}] {msg}", file=sys.stderr, flush=True)


def _load() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


# --- one size --------------------------------------------------------------------------


def build_cases(
    size: BenchSize, device: torch.device, modes: tuple[str, ...]
) -> tuple[Cases, dict]:
    """Every model of ``size``, eager and in each compiled mode of ``modes``
    (:data:`xmodlm.bench.compile.COMPILED`) where compiling it changes anything.

    Compiled models take their first step here, which compiles them; if that
    fails (a platform without a working compiler) the mode is dropped for every
    model and the returned compile record says why.
    """
    configs = family_configs(size.dense())
    specs = {name: (cfg, "ours") for name, cfg in configs.items()}
    specs["gpt2"] = (configs["dense"], "gpt2")
    specs["reference_gpt"] = (configs["dense"], "reference")
    cases: Cases = {}
    for name in ORDER:
        cfg, kind = specs[name]
        cases[name] = {"eager": make_case(name, cfg, size.batch, device, kind)}
    if not modes:
        return cases, {"skipped": "compile off (quick mode or --no-compile)"}
    bench_compile.reset()
    record: dict[str, Any] = {}
    for mode in modes:
        record[mode] = {"how": bench_compile.HOW[mode], "first_step_s": {}}
        try:
            for name in ORDER:
                cfg, kind = specs[name]
                if kind == "reference" or not bench_compile.compilable(
                        cases[name]["eager"].model, mode):
                    continue  # the plain reference stays as written
                case = make_case(name, cfg, size.batch, device, kind, mode=mode,
                                 base=cases[name]["eager"])
                t0 = time.perf_counter()
                case.step()
                case.first_step_s = record[mode]["first_step_s"][name] = time.perf_counter() - t0
                cases[name][mode] = case
        except Exception as err:  # noqa: BLE001 - e.g. no working C++ compiler for inductor
            for per_mode in cases.values():
                per_mode.pop(mode, None)
            why = f"torch.compile failed: {type(err).__name__}: {err}"[:300]
            record[mode] = {"how": bench_compile.HOW[mode], "unavailable": why}
    return cases, record


def compare(cases: Cases, peak: list[float]) -> dict[str, Any]:
    """The figures of one set of timed rounds: steps, and every paired comparison.

    Each model's ``best`` is its fastest mode; comparisons are given per mode
    (eager with eager, compiled with compiled, ...) and at the best modes.
    """
    steps: dict[str, Any] = {}
    best: dict[str, Case] = {}
    for name, modes in cases.items():
        figs = {mode: step_figures(case, peak) for mode, case in modes.items()}
        faster = bench_compile.faster_mode({m: f["ms"]["median"] for m, f in figs.items()})
        steps[name] = {**figs, "faster": faster, "best": figs[faster]}
        best[name] = modes[faster]

    def per_mode(num: str, den: str) -> dict[str, Any]:
        out = {m: versus(cases[num][m], cases[den][m]) for m in cases[num] if m in cases[den]}
        return {**out, "best": versus(best[num], best[den])}

    dense_ref = cases["dense"]["eager"]
    same, xmod = best["dense_same_params"], best["xmod_s4_c0125"]
    ideal = same.flops_per_token / xmod.flops_per_token
    measured = ratio(same, xmod)
    return {
        "train_step": steps,
        "vs_dense": {
            name: per_mode(name, "dense")
            for name in ("mod", "xmod_s4_c0125", "xmod_s8_c0125", "moe", "dense_same_params")
        },
        "dense_vs_gpt2": per_mode("dense", "gpt2"),
        "dense_vs_reference": {
            "eager": versus(dense_ref, cases["reference_gpt"]["eager"]),
            "best": versus(best["dense"], cases["reference_gpt"]["eager"]),
        },
        "xmod_vs_dense_same_params": {
            "speedup_measured": measured,
            "speedup_ideal": ideal,
            "efficiency": {k: v / ideal for k, v in measured.items()},
            "modes": {"dense_same_params": same.mode, "xmod_s4_c0125": xmod.mode},
        },
        **{
            f"{mode}_over_eager": {
                name: ratio(modes[mode], modes["eager"])
                for name, modes in cases.items() if mode in modes
            }
            for mode in bench_compile.COMPILED
        },
    }


def describe(cases: Cases) -> dict[str, Any]:
    """What each model of a size is: layout, parameters, FLOPs (analytic), vs dense."""
    dense = cases["dense"]["eager"]
    out: dict[str, Any] = {}
    for name, modes in cases.items():
        case = modes["eager"]
        row: dict[str, Any] = {
            "params_total": case.params_total,
            "flops_per_token_train": case.flops_per_token,
            "flops_vs_dense": case.flops_per_token / dense.flops_per_token,
        }
        if isinstance(case.model, Transformer):
            row.update(layout=case.cfg.block_layout, n_layers=case.cfg.n_layers,
                       params_active=flops.count(case.cfg).params_active)
        out[name] = row
    out["gpt2"]["what"] = (
        "GPT-2 architecture at the dense shape (xmodlm.bench.gpt2): learned positions,"
        " LayerNorm, GELU MLP of 4 d, tied embedding and head, causal SDPA; the dense"
        " model's optimiser"
    )
    out["reference_gpt"]["what"] = (
        "xmodlm.bench.reference_gpt.ReferenceGPT, always eager: the dense architecture written"
        " plainly (separate q/k/v/gate/up, autograd norm and rotary, plain AdamW)"
    )
    return out


def time_size(
    size: BenchSize,
    threads: list[int],
    device: torch.device,
    *,
    modes: tuple[str, ...],
    timing: Timing,
    peak_n: int,
    say: Callable[[str], None],
) -> tuple[dict[str, Any], Cases]:
    """Build and time every model of ``size`` at each thread count; returns the
    size's section of the result and its cases (for the single-size sections)."""
    say(f"{size.name}: building {len(ORDER)} models, " + ", ".join(("eager", *modes)))
    cases, compile_record = build_cases(size, device, modes)
    dense = cases["dense"]["eager"].cfg
    section: dict[str, Any] = {
        "what": size.what,
        "shape": {"d_model": dense.d_model, "n_heads": dense.n_heads, "context": dense.context,
                  "vocab_size": dense.vocab_size, "batch": size.batch,
                  "tokens_per_step": size.batch * dense.context},
        "models": describe(cases),
        "compile": compile_record,
        "threads": {},
    }
    order = []  # eager in ORDER, then each compiled mode in alternating directions
    for i, mode in enumerate(("eager", *modes)):
        names = ORDER if i % 2 == 0 else ORDER[::-1]
        order += [cases[name][mode] for name in names if mode in cases[name]]
    for n in threads:
        torch.set_num_threads(n)
        say(f"{size.name}: up to {timing.reps} rounds of {len(order)} steps at {n} thread(s)")
        bf16, fp32 = interleave(order, device, reps=timing.reps, min_reps=timing.min_reps,
                                warmup=timing.warmup, peak_n=peak_n, budget_s=timing.budget_s)
        section["threads"][str(n)] = {
            "reps": len(order[0].times),
            "matmul_peak_gflops": {**({"bf16": summary(bf16)} if bf16 else {}),
                                   "fp32": summary(fp32), "n": peak_n},
            **compare(cases, bf16 or fp32),  # MFU against the peak of the steps' dtype
        }
    return section, cases


# --- the entry point -------------------------------------------------------------------


def law_fit(quick: bool) -> dict[str, Any]:
    """Seconds for one full law fit on synthetic runs (:func:`xmodlm.bench.law_fit.bench_fit`),
    timed in a fresh Python process.

    A fresh process is what ``xmod law fit`` runs in, and timed after the training
    steps in this one the same fit took 101 s against 21 s on its own (2-core Xeon,
    after a 30-minute bench of compiled models); a fit's speed should not depend
    on what the bench ran before it.
    """
    args = QUICK_LAW_FIT if quick else LAW_FIT
    code = ("import json, sys; from xmodlm.bench.law_fit import bench_fit; "
            f"sys.stdout.write('\\n' + json.dumps(bench_fit(**{args!r})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seconds = float(done.stdout.strip().splitlines()[-1])
    return {"seconds": seconds, **args, "source": "xmodlm.bench.law_fit",
            "process": "fresh"}


def _timing(size: BenchSize, reps: int | None, device: torch.device) -> Timing:
    t = size.timing
    budget = t.budget_s if device.type == "cpu" else None  # GPU steps are fast: no budget
    if reps is None:
        return Timing(t.reps, t.min_reps, budget, t.warmup)
    return Timing(reps, min(reps, t.min_reps), budget, t.warmup)


def run_bench(
    device: str = "cpu",
    quick: bool = False,
    reps: int | None = None,
    include_law: bool = True,
    include_decode: bool = True,
    include_widths: bool = True,
    include_compile: bool | None = None,
    compile_modes: str | Iterable[str] | None = None,
    progress: bool = False,
    sizes: str | Iterable[str] | None = None,
    threads: str | Iterable[int] | None = None,
) -> dict[str, Any]:
    """Run the benchmark and return one JSON-able dict of figures.

    ``sizes``: names from :data:`xmodlm.bench.sizes.SIZES` (a list or
    ``"bench,w128-t128"``; ``all``); default every size, or only ``bench``
    shrunk to smoke size when ``quick``. ``threads``: thread counts to time each
    size at (``"1,2"``); default the process's current one. ``reps``: timed
    rounds per size and thread count (default per size; on a CPU each size stops
    after its minimum once its time budget is spent). ``include_compile``: also
    time every model compiled (default on, off in quick mode), in each of
    ``compile_modes`` (``"compiled,compiled_model"``; default both).
    ``include_widths``: the width scan at one thread (:mod:`xmodlm.bench.widths`).
    ``progress``: say what runs on stderr. Bad values raise :class:`UserError`.

    Long on purpose: it is the benchmark's schedule in order (sizes and threads,
    each model's rounds, compile modes, decode, the width scan, the law fit, the
    targets), each section a block that writes its part of one result.
    """
    if reps is not None and (isinstance(reps, bool) or not isinstance(reps, int) or reps < 1):
        raise UserError(f"reps={reps!r}: must be an integer >= 1 (timed rounds)")
    names = parse_sizes(sizes, quick)
    default_threads = torch.get_num_threads()
    thread_counts = parse_threads(threads, default_threads)
    main = main_threads(thread_counts, default_threads)
    t_start = time.perf_counter()
    say = _log if progress else (lambda msg: None)
    dev = resolve_device(device)
    compiled = (not quick) if include_compile is None else include_compile
    modes = bench_compile.parse_modes(compile_modes)  # checked even when compile is off
    modes = modes if compiled else ()
    peak_n = QUICK_PEAK_N if quick and dev.type == "cpu" else DEVICE_PEAK_N[dev.type]
    result: dict[str, Any] = {
        "device": dev.type,
        "quick": quick,
        "dtype": f"{resolve_dtype('auto', dev)} compute, fp32 weights",
        "allocator": retain_freed_memory() if dev.type == "cpu" else "CUDA caching allocator",
        "threads": thread_counts,
        "threads_default": default_threads,
        "load_avg_start": _load(),
        "sizes": {},
    }
    try:
        for i, name in enumerate(names):
            size = size_named(name, quick)
            section, cases = time_size(size, thread_counts, dev, modes=modes,
                                       timing=_timing(size, reps, dev), peak_n=peak_n, say=say)
            result["sizes"][name] = section
            torch.set_num_threads(main)
            say(f"{name}: dense and GPT-2 parts, profiled")
            section["dense_vs_gpt2_parts"] = {
                "threads": main,
                **architecture_parts(cases["dense"]["eager"], cases["gpt2"]["eager"], dev),
            }
            if i == 0:  # single-size sections: on the first size, at the main thread count
                say(f"{name}: routing overhead of an eager X-MoD step")
                overhead = routing_overhead(cases["xmod_s4_c0125"]["eager"], dev)
                result["routing_overhead"] = {"size": name, "threads": main, **overhead}
            del cases
            if include_decode and (quick or name in DECODE_SIZES):
                say(f"{name}: decode and prefill, X-MoD against two dense models")
                section["threads"][str(main)]["decode"] = decode(
                    family_configs(size.dense()), quick)
    finally:
        torch.set_num_threads(default_threads)
    torch.set_num_threads(main)
    result["paper_pair"] = paper_pair(dev, quick, peak_n, say)
    torch.set_num_threads(default_threads)
    if include_widths:
        widths_modes = tuple(m for m in modes if m == "compiled_model")
        result["width_scan"] = width_scan(dev, widths_modes, quick, peak_n, say)
    else:
        result["width_scan"] = {"skipped": "include_widths=False"}
    if include_law:
        say("law fit")
    result["law_fit_s"] = law_fit(quick) if include_law else {"skipped": "include_law=False"}
    result["sweep_worker_throughput"] = sweep_worker_throughput(result)
    result["targets"] = evaluate(result, main)
    env = environment_record()
    result["machine"] = {k: env.get(k) for k in MACHINE_KEYS}
    result["load_avg_end"] = _load()
    result["peak_rss_gb"] = peak_rss_gb()
    result["wall_s"] = time.perf_counter() - t_start
    return result
