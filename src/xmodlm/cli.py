"""The ``xmod`` command: thin wrappers over library functions.

Each subcommand parses its arguments, calls one library function and prints the
result. A :class:`~xmodlm.errors.UserError` becomes one line on stderr and exit
status 2; so does an argument the parser rejects.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xmodlm.errors import UserError

Handler = Callable[[argparse.Namespace], int]


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line and exit status 2 (no usage dump)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False, default=_json_default))


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "__fspath__"):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="preset name (e.g. xmod-tiny) or path to a YAML file")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set model.stride=8 (repeatable)",
    )


# --- commands ------------------------------------------------------------------------


def cmd_info(args: argparse.Namespace) -> int:
    from xmodlm.info import model_info

    info = model_info(args.config, args.overrides)
    if args.json:
        _print_json(info)
    else:
        from xmodlm.info import format_info

        print(format_info(info))
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    from xmodlm.config import preset_names

    print("\n".join(preset_names()))
    return 0


def cmd_data_prepare(args: argparse.Namespace) -> int:
    import logging

    from xmodlm.data.prepare import prepare

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    manifest = prepare(
        args.out,
        vocab_size=args.vocab_size,
        texts=args.text,
        jsonl=args.jsonl,
        parquet=args.parquet,
        hf_dataset=args.hf_dataset,
        seed=args.seed,
    )
    splits = manifest["splits"]
    print(
        f"{args.out}: vocab {manifest['vocab_size']}, tokens "
        + ", ".join(f"{k} {v['tokens']:,}" for k, v in splits.items())
    )
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from xmodlm.config import load_config
    from xmodlm.train.trainer import train

    cfg = load_config(args.config, args.overrides)
    summary = train(cfg, args.out, progress=not args.quiet)
    if args.json:
        _print_json(summary)
    else:
        print(
            f"{args.out}: {summary['status']} after {summary['steps']} steps,"
            f" val loss {summary['final_val_loss']} (top-k),"
            f" {summary['final_val_loss_causal']} (causal), {summary['val_bpb']} bpb"
        )
    return {"ok": 0, "interrupted": 130}.get(summary["status"], 1)


def cmd_demo(args: argparse.Namespace) -> int:
    from xmodlm.demo import format_rows, run_demo

    rows = run_demo(args.data, args.out, args.compute)
    print()
    print(f"Compute-matched at C = {args.compute:.3g} training FLOPs per model:")
    print(format_rows(rows))
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from xmodlm.sweep import expand, load_spec, run_sweep, write_results
    from xmodlm.sweep.spec import estimate_seconds

    runs = expand(load_spec(args.spec), data_dir=args.data)
    if args.dry_run:
        import pandas as pd

        table = pd.DataFrame([r.row() for r in runs])
        table["est_s"] = estimate_seconds(runs, workers=args.workers)
        fmt = {"capacity": "{:.4g}".format, "params_active": "{:.4g}".format,
               "flops_per_token": "{:.4g}".format, "tokens": "{:.4g}".format,
               "compute": "{:.3g}".format, "est_s": "{:.0f}".format}
        print(table.to_string(index=False, formatters=fmt))
        print(f"{len(table)} runs, estimated {table['est_s'].sum() / 60 / args.workers:.0f} min"
              f" with {args.workers} worker(s) (from the measured matmul peak; rough)")
        return 0
    result = run_sweep(
        runs, args.out, executor=args.executor, workers=args.workers,
        max_retries=args.max_retries, progress=not args.quiet, ray_address=args.ray_address,
        slurm_local=args.slurm_local,
    )
    path, n_rows, left_out = write_results(args.out)
    print(f"{result['ran']} ran, {result['skipped']} already done, {result['failed']} failed;"
          f" {n_rows} rows in {path}" + (f" ({len(left_out)} left out)" if left_out else ""))
    return 1 if result["failed"] else 0


def cmd_results(args: argparse.Namespace) -> int:
    from xmodlm.sweep import write_results

    path, n_rows, left_out = write_results(args.sweep_dir, args.out)
    for run_id, why in sorted(left_out.items()):
        print(f"left out {run_id}: {why}", file=sys.stderr)
    print(f"{n_rows} rows written to {path}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from xmodlm.model.generate import generate_from_run

    texts = generate_from_run(
        args.run_dir, args.prompt, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        device=args.device,
    )
    for prompt, text in zip(args.prompt, texts, strict=True):
        if args.json:
            print(json.dumps({"prompt": prompt, "completion": text}))
        else:
            print(prompt + text)
            if len(args.prompt) > 1:
                print("-" * 40)
    return 0


def cmd_law_fit(args: argparse.Namespace) -> int:
    from xmodlm.law.fit import fit_law
    from xmodlm.law.table import read_table

    fit = fit_law(read_table(args.results), form=args.form, holdout=args.holdout,
                  n_boot=args.n_boot, seed=args.seed)
    payload = fit.to_json()
    if args.out:
        from xmodlm.train.checkpoint import atomic_write_json

        atomic_write_json(Path(args.out), payload)
    if args.plots:
        from xmodlm.report.law_plots import plot_law

        for path in plot_law(fit, read_table(args.results), args.plots):
            print(f"wrote {path}", file=sys.stderr)
    if args.json:
        _print_json(payload)
    else:
        d = payload["delta"]
        print(f"selected delta form: {d['selected']} ({d['selection'].get('why', '')})")
        print(json.dumps(payload["metrics"], indent=2))
    return 0


def cmd_law_predict(args: argparse.Namespace) -> int:
    from xmodlm.law.fit import load_fit, predict
    from xmodlm.law.table import read_table

    out = predict(load_fit(args.fit), read_table(args.input))
    if args.json:
        _print_json({"predictions": out.to_dict(orient="records")})
    else:
        print(out.to_string(index=False))
    return 0


def cmd_recommend(args: argparse.Namespace) -> int:
    from xmodlm.law.fit import load_fit
    from xmodlm.law.recommend import recommend

    result = recommend(
        args.compute, args.context, args.active_params,
        law=load_fit(args.law) if args.law else None,
        max_total_params=args.max_total_params,
    )
    if args.json:
        _print_json(result)
    else:
        print(result["answer"])
        print(result.get("reason", ""))
        for w in result.get("warnings", []):
            print(f"warning: {w}", file=sys.stderr)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from xmodlm.report.sweep_report import sweep_report

    results = Path(args.results)
    if results.is_dir():
        results = results / "results.csv"
    report = sweep_report(results, args.out, law=args.law)
    if args.json:
        _print_json(report)
    else:
        print((Path(args.out) / "report.md").read_text(), end="")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from xmodlm.eval import evaluate_run

    tasks = tuple(t for t in args.tasks.split(",") if t) if args.tasks else ()
    result = evaluate_run(args.run_dir, data_dir=args.data, split=args.split, tasks=tasks,
                          max_items=args.max_items, device=args.device)
    if args.json:
        _print_json(result)
    else:
        print(f"loss top-k {result['val_loss_topk']:.4f}  causal {result['val_loss_causal']:.4f}"
              f"  bpb {result['val_bpb']:.4f}  agreement {result['routing_agreement']}")
        for name, task in result["tasks"].items():
            lo, hi = task["ci95"]
            print(f"{name}: {task['accuracy']:.3f} [95% {lo:.3f}-{hi:.3f}] on {task['items']}"
                  f" items (chance {task['chance']})")
    return 0


def cmd_lm_eval(args: argparse.Namespace) -> int:
    try:
        from xmodlm.eval.harness import run_harness
    except ImportError as err:
        raise UserError(f"{err}") from None
    from xmodlm.fileio import atomic_open

    if args.limit is not None and args.limit <= 0:
        raise UserError(f"--limit must be positive (a count, or a fraction below 1), got {args.limit}")
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    out = run_harness(
        args.run_dir,
        [t.strip() for t in args.tasks.split(",")],
        num_fewshot=args.num_fewshot,
        limit=limit,
        batch_size=args.batch_size,
        device=args.device,
        include_path=args.include_path,
        step=args.step,
        dtype=args.dtype,
        seed=args.seed,
    )
    record = {
        "run_dir": args.run_dir,
        "results": out["results"],
        "n_shot": out.get("n-shot", {}),
        "n_samples": out.get("n-samples", {}),
        "versions": out.get("versions", {}),
    }
    if args.out:
        with atomic_open(args.out, "w") as f:
            json.dump(record, f, indent=2, default=_json_default)
            f.write("\n")
    if args.json:
        _print_json(record)
    else:
        for task, metrics in out["results"].items():
            shown = "  ".join(
                f"{k.split(',')[0]} {v:.4f}" for k, v in metrics.items()
                if isinstance(v, float) and "_stderr" not in k
            )
            print(f"{task}: {shown}")
    return 0


def cmd_show_routing(args: argparse.Namespace) -> int:
    from xmodlm.report.routing_plots import plot_training, show_routing

    out = Path(args.out)
    png, html = (out.with_suffix(".png"), out) if out.suffix == ".html" else (out, None)
    show_routing(args.run_dir, args.text, png, html or out.with_suffix(".html"),
                 device=args.device)
    print(f"wrote {png} and {html or out.with_suffix('.html')}")
    if args.training_plots:
        for path in plot_training(args.run_dir, args.training_plots):
            print(f"wrote {path}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from xmodlm.bench import run_bench

    result = run_bench(
        device=args.device, quick=args.quick, reps=args.reps, include_law=not args.no_law,
        include_decode=not args.no_decode, progress=not args.json,
    )
    _print_json(result)  # the figures are one JSON object either way
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="xmod",
        description="Sparse-depth language models (X-MoD): train, evaluate, fit scaling laws.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("info", help="parameters, FLOPs per token and layout of a config")
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("presets", help="list the shipped config presets")
    p.set_defaults(func=cmd_presets)

    p = sub.add_parser("data", help="prepare training data")
    data_sub = p.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    p = data_sub.add_parser(
        "prepare",
        help="build the default corpus (or your files): splits, BPE tokenizer, token files",
    )
    p.add_argument("--out", default="data/corpus", help="output directory (default data/corpus)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--text", nargs="+", metavar="PATH", help="plain-text files or directories")
    p.add_argument("--jsonl", nargs="+", metavar="PATH", help="JSONL files with a 'text' field")
    p.add_argument("--parquet", nargs="+", metavar="PATH", help="Parquet files with a 'text' column")
    p.add_argument("--hf-dataset", metavar="NAME", help="a Hugging Face dataset (needs a network)")
    p.add_argument("--seed", type=int, default=0, help="seed of the document split")
    p.set_defaults(func=cmd_data_prepare)

    p = sub.add_parser("train", help="train a model; rerun on the same --out to resume")
    _add_config_args(p)
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("sweep", help="run a sweep spec (resumable) and write results.csv")
    p.add_argument("spec", help="sweep spec YAML")
    p.add_argument("--out", default="runs/sweep", help="sweep directory")
    p.add_argument("--executor", default="local", choices=["local", "ray", "slurm"])
    p.add_argument("--workers", type=int, default=1, help="concurrent runs (local executor)")
    p.add_argument("--max-retries", type=int, default=2, help="retries of a failed run")
    p.add_argument("--data", default=None, help="data directory (overrides the spec)")
    p.add_argument("--ray-address", default=None, help="Ray cluster address (default: local)")
    p.add_argument("--slurm-local", action="store_true",
                   help="run slurm jobs with submitit's local executor (testing)")
    p.add_argument("--dry-run", action="store_true", help="print the expanded runs and exit")
    p.add_argument("--quiet", action="store_true", help="no live progress line")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("results", help="rebuild a sweep's results table from its run dirs")
    p.add_argument("sweep_dir")
    p.add_argument("--out", default=None, help="output CSV (default SWEEP_DIR/results.csv)")
    p.set_defaults(func=cmd_results)

    p = sub.add_parser("generate", help="sample text from a trained run (causal routing)")
    p.add_argument("run_dir")
    p.add_argument("--prompt", action="append", required=True,
                   help="prompt text (repeat for several prompts in one batch)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("eval", help="held-out losses, routing statistics, downstream tasks")
    p.add_argument("run_dir")
    p.add_argument("--data", default=None, help="data directory (default: the run's)")
    p.add_argument("--split", default="test")
    p.add_argument("--tasks", default="cloze,minimal_pairs", help="comma-separated; '' for none")
    p.add_argument("--max-items", type=int, default=200)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser(
        "lm-eval", help="lm-evaluation-harness tasks on a run (needs the 'eval' extra)"
    )
    p.add_argument("run_dir")
    p.add_argument("--tasks", required=True,
                   help="comma-separated harness task names; offline: xmod_cloze,"
                        "xmod_minimal_pairs,xmod_cloze_gen,xmod_heldout")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--limit", type=float, default=None,
                   help="at most N documents per task (or a fraction if below 1)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--include-path", default=None, help="a directory of extra task YAMLs")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default newest)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="also write the JSON record here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_lm_eval)

    p = sub.add_parser("show-routing", help="picture of which tokens the sparse blocks took")
    p.add_argument("run_dir")
    p.add_argument("--text", required=True)
    p.add_argument("--out", required=True, help="PNG (an HTML page is written beside it)")
    p.add_argument("--training-plots", default=None, metavar="DIR",
                   help="also plot coverage, depth histogram and overlap from metrics.jsonl")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=cmd_show_routing)

    p = sub.add_parser("law", help="fit and apply the X-MoD scaling law")
    law_sub = p.add_subparsers(dest="law_command", required=True, parser_class=_Parser)
    p = law_sub.add_parser("fit", help="fit the dense law and the X-MoD delta law")
    p.add_argument("results", help="results table (CSV or Parquet)")
    p.add_argument("--form", default="auto", help="delta form (auto: chosen by held-out error)")
    p.add_argument("--holdout", default=None,
                   help="leave-cell-out | top-compute | longest-context")
    p.add_argument("--n-boot", type=int, default=1000, help="bootstrap replicates")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the fit JSON here (for predict/recommend)")
    p.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_law_fit)
    p = law_sub.add_parser("predict", help="predict losses for the rows of a table")
    p.add_argument("fit", help="fit JSON from `xmod law fit --out`")
    p.add_argument("--input", required=True, help="table of configurations (CSV or Parquet)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_law_predict)

    p = sub.add_parser("recommend", help="which routing configuration to train, by the law")
    p.add_argument("--compute", type=float, required=True, help="training FLOPs C")
    p.add_argument("--context", type=int, required=True, help="context length T")
    p.add_argument("--active-params", type=float, required=True, help="N_ae of the backbone")
    p.add_argument("--max-total-params", type=float, default=None)
    p.add_argument("--law", default=None, help="fit JSON (default: the shipped fit)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_recommend)

    p = sub.add_parser("report", help="written report of a sweep: sparse vs FLOP-matched dense, law")
    p.add_argument("results", help="results table (CSV/Parquet) or a sweep directory")
    p.add_argument("--out", required=True, help="directory for report.md, report.json, comparisons.csv")
    p.add_argument("--law", default=None, help="fit JSON to summarise and plot with the runs")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("bench", help="speed figures, measured side by side in one process")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--quick", action="store_true", help="smoke size, under a minute")
    p.add_argument("--reps", type=int, default=None, help="timed rounds")
    p.add_argument("--no-law", action="store_true", help="skip the law-fit timing")
    p.add_argument("--no-decode", action="store_true", help="skip the decode timing")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser(
        "demo", help="prepare the corpus, train compute-matched dense-tiny and xmod-tiny"
    )
    p.add_argument("--data", default="data/corpus", help="data directory")
    p.add_argument("--out", default="runs/demo", help="where the two runs go")
    p.add_argument("--compute", type=float, default=1.6e13, help="training FLOPs per model")
    p.set_defaults(func=cmd_demo)

    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.func
    try:
        return handler(args)
    except UserError as err:
        sys.stderr.write(f"xmod {args.command}: error: {err}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("xmod: interrupted\n")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
