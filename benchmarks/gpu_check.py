"""Everything a GPU machine should measure, in one command with a time budget.

    python benchmarks/gpu_check.py --out gpu-out                # on the GPU machine
    python benchmarks/gpu_check.py --out /tmp/toy --toy          # end to end on a CPU

Carry the prepared corpus with it (``data/corpus``, about 32 MiB): the GPU machine
may reach no registry or hub. Stages, each written to OUT as it finishes, each
started only while the budget (``--budget-s``) has room:

1. ``smoke`` (about 30 s): every family at the study size (dense, MoD, X-MoD
   S = 4 and 8 at c = 1/8, MoE top-1), compiled, in the trainer's dtype, timed
   for a few steps; prints tokens/s and MFU against the H200's bf16 dense peak
   (989 TFLOP/s; on a CPU, against the matmul throughput measured here).
2. ``train``: 200 optimiser steps of each family through the trainer (20 in
   ``--toy``), checking the loss falls; loss, tokens/s and MFU per family.
3. ``bench``: ``xmod bench --sizes bench`` on this device (training-step ratios
   side by side, eager and compiled, decode speed and KV bytes): ``bench.json``.
4. ``study``: the ``gpu-study`` sweep spec, run by run in order of compute then
   family, each only if the throughput measured in stage 1 says it fits the
   remaining budget; then ``results.csv`` and ``xmod report``. Runs that did
   not fit are listed, not silently dropped; rerunning resumes.

``--stages`` picks a subset (the device budget may not hold all four at once:
``smoke,train,bench`` is the speed check, ``smoke,study`` the study).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import torch

from xmodlm import flops
from xmodlm.config import Config
from xmodlm.fileio import atomic_write_json
from xmodlm.hardware import environment_record, matmul_peak_gflops, resolve_device, resolve_dtype
from xmodlm.model import Transformer
from xmodlm.sweep.spec import expand, load_spec
from xmodlm.train.optim import build_optimizer

H200_BF16_DENSE_PEAK = 989.4e12  # FLOP/s, NVIDIA's dense (no sparsity) bf16 figure
STAGES = ("smoke", "train", "bench", "study")
FAMILY_ORDER = ("dense", "xmod", "mod", "moe")


@dataclasses.dataclass(frozen=True)
class Size:
    """The study size, or a toy one that runs anywhere in a minute."""

    width: int
    n_layers: int
    n_heads: int
    context: int
    batch_tokens: int
    smoke_steps: int
    train_steps: int
    study_compute: tuple[float, ...]
    study_contexts: tuple[int, ...]


GPU = Size(512, 8, 8, 2048, 16384, 8, 200, (1.0e16, 3.0e16), (512, 2048))
TOY = Size(64, 2, 2, 64, 512, 3, 20, (2.0e10, 6.0e10), (32, 128))


def family_configs(size: Size, data_dir: str) -> dict[str, Config]:
    """The families at ``size``, each FLOP-matched to the dense reference."""
    runs = expand(_spec(size, (size.context,), (1e15,)), data_dir=data_dir)
    out = {}
    for r in runs:
        m = r.cfg.model
        name = m.family if m.family != "xmod" else f"xmod_s{m.stride}"
        out[name] = r.cfg
    return out


def _spec(size: Size, contexts: tuple[int, ...], compute: tuple[float, ...]) -> dict[str, Any]:
    spec = load_spec("gpu-study")
    spec["dense"] = [{"width": size.width, "n_layers": size.n_layers, "n_heads": size.n_heads}]
    spec["context"] = list(contexts)
    spec["compute"] = list(compute)
    spec["batch_tokens"] = size.batch_tokens
    return spec


def _peak(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return H200_BF16_DENSE_PEAK, "H200 bf16 dense peak (datasheet)"
    dtype = resolve_dtype("auto", device)
    return matmul_peak_gflops(dtype, "cpu") * 1e9, f"measured {dtype} matmul peak of this CPU"


def smoke(size: Size, device: torch.device, data_dir: str, say) -> dict[str, Any]:
    """Compiled steps of every family; tokens/s and MFU."""
    peak, peak_what = _peak(device)
    dtype = resolve_dtype("auto", device)
    out: dict[str, Any] = {"peak_flops": peak, "peak": peak_what, "dtype": dtype, "families": {}}
    for name, cfg in family_configs(size, data_dir).items():
        try:
            fig = _timed_steps(cfg, device, dtype, size.smoke_steps, compiled=True)
        except Exception as err:  # noqa: BLE001 - a compiler failure is a finding, not a stop
            why = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            say(f"smoke {name:9s} torch.compile failed ({why}); timing eager instead")
            torch._dynamo.reset()
            fig = {**_timed_steps(cfg, device, dtype, size.smoke_steps, compiled=False),
                   "compile_error": why}
        fig["mfu"] = fig["flops_per_s"] / peak
        out["families"][name] = fig
        say(f"smoke {name:9s} {fig['layout'][:24]:24s} {fig['tokens_per_s']:12,.0f} tok/s"
            f"  MFU {fig['mfu']:.3f}  ({fig['mode']})")
    return out


def _timed_steps(cfg: Config, device: torch.device, dtype: str, steps: int,
                 compiled: bool) -> dict[str, Any]:
    """Median time of ``steps`` full optimiser steps after two warm-up (compile) steps."""
    torch.manual_seed(0)
    model = Transformer(cfg.model).to(device)
    opt = build_optimizer(model, cfg.train)
    step_fn = torch.compile(model) if compiled else model
    B, T = cfg.train.batch_size, cfg.model.context
    idx = torch.randint(cfg.model.vocab_size, (B, T + 1), device=device)
    x, y = idx[:, :-1], idx[:, 1:]
    times, t_compile = [], time.perf_counter()
    for i in range(steps + 2):
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = step_fn(x, y).total_loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i == 1:
            t_compile = time.perf_counter() - t_compile
        if i >= 2:
            times.append(time.perf_counter() - t0)
    step_s = sorted(times)[len(times) // 2]
    tok_s = B * T / step_s
    return {"layout": cfg.model.block_layout, "mode": "compiled" if compiled else "eager",
            "tokens_per_s": tok_s, "flops_per_s": flops.count(cfg.model).flops_train * tok_s,
            "step_ms": 1000 * step_s, "compile_and_warmup_s": t_compile, "loss": float(loss)}


def train_smoke(size: Size, data_dir: str, root: Path, say) -> dict[str, Any]:
    """``size.train_steps`` optimiser steps of every family through the trainer."""
    from xmodlm.train.loggers import read_metrics
    from xmodlm.train.trainer import train

    out = {}
    for name, cfg in family_configs(size, data_dir).items():
        cfg = cfg.merge([f"train.max_steps={size.train_steps}", "train.warmup_steps=10",
                         f"train.eval_every={size.train_steps}", "train.compile=auto"])
        summary = train(cfg, root / name, progress=False)
        losses = [r["loss"] for r in read_metrics(root / name) if "loss" in r]
        mfu = [r["mfu"] for r in read_metrics(root / name) if "mfu" in r]
        out[name] = {"status": summary["status"], "first_loss": losses[0], "last_loss": losses[-1],
                     "val_loss": summary["final_val_loss"], "mfu_median": sorted(mfu)[len(mfu) // 2],
                     "wall_s": summary["wall_s"], "loss_fell": losses[-1] < losses[0]}
        say(f"train {name:9s} loss {losses[0]:.3f} -> {losses[-1]:.3f}  val"
            f" {summary['final_val_loss']:.3f}  MFU {out[name]['mfu_median']:.3f}")
    return out


def study(size: Size, data_dir: str, root: Path, smoke_figs: dict[str, Any], deadline: float,
          say) -> dict[str, Any]:
    """The study runs that fit before ``deadline``, by the smoke test's throughput."""
    from xmodlm.report.sweep_report import sweep_report
    from xmodlm.sweep.results import write_results
    from xmodlm.sweep.runner import run_state, run_sweep

    runs = expand(_spec(size, size.study_contexts, size.study_compute), data_dir=data_dir)
    runs.sort(key=lambda r: (r.compute, r.cfg.model.context,
                             FAMILY_ORDER.index(r.cfg.model.family), r.cfg.model.stride))
    tok_s = {n: f["tokens_per_s"] for n, f in smoke_figs["families"].items()}
    compile_s = max(f["compile_and_warmup_s"] for f in smoke_figs["families"].values())
    planned, skipped, spent = [], [], 0.0
    for r in runs:
        m = r.cfg.model
        name = m.family if m.family != "xmod" else f"xmod_s{m.stride}"
        # throughput was measured at the smoke context; attention makes longer ones slower
        ratio = flops.count(m).flops_train / flops.count(m, size.context).flops_train
        est = r.compute / flops.count(m).flops_train / (tok_s[name] / ratio) + compile_s
        if run_state(root / "runs" / r.run_id)[0] == "done":
            planned.append(r)
        elif time.perf_counter() + spent + est < deadline:
            planned.append(r)
            spent += est
        else:
            skipped.append({"run_id": r.run_id, "family": m.family, "stride": m.stride,
                            "context": m.context, "compute": r.compute, "est_s": est})
    say(f"study: {len(planned)} of {len(runs)} runs fit the budget (estimated {spent:.0f} s)")
    result = run_sweep(planned, root, workers=1, progress=False)
    path, n, left_out = write_results(root)
    report = sweep_report(path, root / "report") if n else None
    return {"ran": result["ran"], "failed": result["failed"], "rows": n,
            "not_run_for_time": skipped, "left_out": left_out,
            "vs_dense": report["vs_dense"] if report else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for every result")
    parser.add_argument("--data", default="data/corpus", help="prepared corpus (carry it along)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"subset of {','.join(STAGES)}")
    parser.add_argument("--toy", action="store_true", help="toy sizes: the whole path in minutes")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)
    stages = [s for s in args.stages.split(",") if s]
    if bad := [s for s in stages if s not in STAGES]:
        print(f"gpu_check: unknown stage(s) {bad}; allowed: {', '.join(STAGES)}", file=sys.stderr)
        return 2
    if not (Path(args.data) / "manifest.json").is_file():
        print(f"gpu_check: no prepared corpus at {args.data!r}: run `xmod data prepare`"
              " and carry data/corpus with the command", file=sys.stderr)
        return 2
    start = time.perf_counter()
    deadline = start + args.budget_s
    device = resolve_device(args.device)
    size = TOY if args.toy else GPU
    args.out.mkdir(parents=True, exist_ok=True)

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {msg}", flush=True)

    summary: dict[str, Any] = {"device": str(device), "size": dataclasses.asdict(size),
                               "environment": environment_record(), "stages": {}}
    smoke_figs = None
    for stage in stages:
        left = deadline - time.perf_counter()
        if left < 10:
            summary["stages"][stage] = {"skipped": f"budget spent ({left:.0f} s left)"}
            say(f"{stage}: skipped, budget spent")
            continue
        say(f"{stage}: start ({left:.0f} s left)")
        if stage == "smoke":
            result = smoke_figs = smoke(size, device, args.data, say)
        elif stage == "train":
            result = train_smoke(size, args.data, args.out / "train", say)
        elif stage == "bench":
            from xmodlm.bench import run_bench

            # the width scan is a CPU figure (one thread): not worth the GPU's minutes
            result = run_bench(device=device.type, quick=args.toy, include_law=False,
                               include_widths=False, sizes="bench")
            atomic_write_json(args.out / "bench.json", result)
            (section,) = result["sizes"]["bench"]["threads"].values()
            result = {"file": "bench.json",
                      "xmod_vs_dense_flop_matched": section["vs_dense"]["xmod_s4_c0125"]["best"],
                      "dense_vs_gpt2": section["dense_vs_gpt2"]["best"]}
        else:
            if smoke_figs is None:
                smoke_figs = smoke(size, device, args.data, say)
            result = study(size, args.data, args.out / "study", smoke_figs, deadline, say)
        summary["stages"][stage] = result
        atomic_write_json(args.out / "gpu_check.json", summary)
    summary["wall_s"] = time.perf_counter() - start
    atomic_write_json(args.out / "gpu_check.json", summary)
    say(f"done; {args.out / 'gpu_check.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
