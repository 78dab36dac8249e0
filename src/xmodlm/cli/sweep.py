"""``xmod sweep``, ``results`` and ``report``: many runs of a spec, their table and
the report on it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from xmodlm.cli.common import (
    check_out_dir,
    check_out_file,
    print_json,
)
from xmodlm.errors import UserError


def sweep_args(sub: argparse._SubParsersAction) -> None:
    """``xmod sweep``'s arguments, beside the command that reads them."""
    p = sub.add_parser("sweep", help="run a sweep spec (resumable) and write results.csv")
    p.add_argument("spec", help="sweep spec YAML")
    p.add_argument("--out", default="runs/sweep", help="sweep directory")
    from xmodlm.sweep.executors import EXECUTORS

    p.add_argument("--executor", default="local", choices=list(EXECUTORS),
                   help="where runs train: this machine, a Ray cluster or Slurm")
    p.add_argument("--workers", type=int, default=1, help="concurrent runs (local executor)")
    p.add_argument("--max-retries", type=int, default=2, help="retries of a failed run")
    p.add_argument("--data", default=None, help="data directory (overrides the spec)")
    p.add_argument("--executor-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="an executor option (repeatable): ray address=...; slurm folder=...,"
                   " params.partition=..., params.gpus_per_node=1, local=true")
    p.add_argument("--ray-address", default=None, help="Ray cluster address (default: local)")
    p.add_argument("--slurm-local", action="store_true",
                   help="run slurm jobs with submitit's local executor (testing)")
    p.add_argument("--dry-run", action="store_true", help="print the expanded runs and exit")
    p.add_argument("--plan", default=None, metavar="CSV",
                   help="with --dry-run: also write the planned runs' records (ids, config"
                   " columns, compute, tokens) here, for `xmod law predict --input`")
    p.add_argument("--rate-from", default=None, metavar="SWEEP_DIR",
                   help="with --dry-run: estimate times from the FLOP/s that this sweep folder's"
                   " finished runs reached (default: --out's own finished runs, if any)")
    p.add_argument("--run-set", action="append", default=[], metavar="train.KEY=VALUE",
                   help="a setting of how the runs execute, for this invocation only and"
                   " without changing run ids (repeatable): train.compile=on,"
                   " train.device=cuda, train.ckpt_every=..., trackers")
    p.add_argument("--allow-dirty", action="store_true",
                   help="start runs although tracked files have uncommitted changes (each run"
                   " records its commit as <sha>-dirty); refused otherwise")
    p.add_argument("--quiet", action="store_true", help="no live progress line")
    p.set_defaults(func=cmd_sweep)


def cmd_sweep(args: argparse.Namespace) -> int:
    from xmodlm.sweep import expand, load_spec, run_sweep, write_results
    from xmodlm.sweep.executors import check_options, make_executor, parse_executor_options
    from xmodlm.sweep.plan import dry_run, train_tokens
    from xmodlm.sweep.runner import check_run_set
    from xmodlm.sweep.spec import check_requirements, eval_args

    check_options(args.executor, args.workers, args.max_retries)
    options = parse_executor_options(args.executor_opt)
    if args.ray_address is not None:
        options["address"] = args.ray_address
    if args.slurm_local:
        options["local"] = True
    make_executor(args.executor, args.workers, **options)  # bad options: before any work
    if Path(args.spec).is_file():
        try:
            Path(args.spec).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise UserError(f"sweep spec {args.spec!r} is not UTF-8 text (a binary file?)") from None
    if args.plan and not args.dry_run:
        raise UserError("--plan writes the plan of a dry run: add --dry-run")
    if args.plan:
        check_out_file(args.plan, (".csv",), "--plan")
    if not args.dry_run:
        check_out_dir(args.out, "sweep")
    spec = load_spec(args.spec)
    runs = expand(spec, data_dir=args.data)
    check_run_set(args.run_set, runs[0].cfg)
    figures, broken = check_requirements(
        runs, spec["require"], train_tokens(runs), strict=not args.dry_run
    )
    if args.dry_run:
        print(dry_run(runs, figures, args.workers, args.out, rate_from=args.rate_from,
                      needs_eval=bool(eval_args(spec))))
        for line in broken:  # shown, not refused: a dry run is for fixing the spec
            print(line.replace("sweep spec: ", "would refuse: "))
        if args.plan:
            from xmodlm.fileio import atomic_write_text
            from xmodlm.sweep.plan import plan_table

            atomic_write_text(Path(args.plan), plan_table(runs).to_csv(index=False))
            print(f"plan of {len(runs)} runs written to {args.plan}")
        return 0
    result = run_sweep(
        runs, args.out, executor=args.executor, workers=args.workers,
        max_retries=args.max_retries, progress=not args.quiet, eval_args=eval_args(spec),
        run_set=args.run_set, name=spec.get("name"), allow_dirty=args.allow_dirty, **options,
    )
    path, n_rows, left_out = write_results(args.out)
    print(f"{result['ran']} ran, {result['skipped']} already done, {result['failed']} failed,"
          f" {result['diverged']} diverged;"
          f" {n_rows} rows in {path}" + (f" ({len(left_out)} left out)" if left_out else ""))
    if result["signal"] is not None:  # 130 (SIGINT) or 143 (SIGTERM), as a shell reports it
        import signal

        sys.stderr.write(
            f"xmod sweep: stopped by {signal.Signals(result['signal']).name}:"
            f" {result['interrupted']} run(s) checkpointed, {result['not_started']} not started;"
            " rerun the same command to resume\n"
        )
        return 128 + int(result["signal"])
    return 1 if result["failed"] else 0


def results_args(sub: argparse._SubParsersAction) -> None:
    """``xmod results``'s arguments, beside the command that reads them."""
    p = sub.add_parser("results", help="rebuild a sweep's results table from its run dirs")
    p.add_argument("sweep_dir")
    p.add_argument("--out", default=None, help="output CSV (default SWEEP_DIR/results.csv)")
    p.set_defaults(func=cmd_results)


def cmd_results(args: argparse.Namespace) -> int:
    from xmodlm.sweep import write_results

    if args.out:
        check_out_file(args.out, (".csv",))
    path, n_rows, left_out = write_results(args.sweep_dir, args.out)
    for run_id, why in sorted(left_out.items()):
        print(f"left out {run_id}: {why}", file=sys.stderr)
    print(f"{n_rows} rows written to {path}")
    return 0


def _results_table(path: str) -> Path:
    """A results table given as itself or as the sweep directory that holds it."""
    return Path(path) / "results.csv" if Path(path).is_dir() else Path(path)


def report_args(sub: argparse._SubParsersAction) -> None:
    """``xmod report``'s arguments, beside the command that reads them."""
    p = sub.add_parser("report", help="written report of a sweep: sparse vs FLOP-matched dense, law")
    p.add_argument("results", help="results table (CSV/Parquet) or a sweep directory")
    p.add_argument("--out", required=True, help="directory for report.md, report.json, comparisons.csv")
    p.add_argument("--law", default=None, help="fit JSON to summarise and plot with the runs")
    p.add_argument("--dense-control", action="append", default=[], metavar="RESULTS",
                   help="another sweep's results (table or directory) on the same budgets, whose"
                        " dense runs join the dense ladder and the equal-size comparison (never"
                        " the FLOP-matched pairing); repeatable")
    p.add_argument("--quiet", action="store_true",
                   help="no progress on stderr (else a bar on a terminal, plain lines when piped)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from xmodlm.report.sweep_report import sweep_report

    check_out_dir(args.out, None)
    results = _results_table(args.results)
    controls = [_results_table(c) for c in args.dense_control]
    report = sweep_report(results, args.out, law=args.law, dense_controls=controls)
    if args.json:
        print_json(report)
    else:
        print((Path(args.out) / "report.md").read_text(), end="")
    return 0
