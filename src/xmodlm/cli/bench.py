"""``xmod bench``: the speed figures, measured side by side in one run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from xmodlm.cli.common import (
    check_device,
    print_json,
)
from xmodlm.errors import UserError


def bench_args(sub: argparse._SubParsersAction) -> None:
    """``xmod bench``'s arguments, beside the command that reads them."""
    p = sub.add_parser("bench", help="speed figures, measured side by side in one process")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="device the figures are measured on")
    p.add_argument("--quick", action="store_true",
                   help="smoke mode, under a minute: few rounds, no compile, bench size shrunk"
                   " (the default when --sizes is not given)")
    p.add_argument("--sizes", default=None, metavar="LIST",
                   help="comma-separated sizes: bench, w128-t128, w128-t512, w256-t256, or all:"
                   " the full bench at those sizes, eager and compiled (all: 30-60 minutes on"
                   " 2 cores and a 7 GB peak, set by the width scan at width 1024); without it, the quick"
                   " smoke set (about 1 GB)")
    p.add_argument("--threads", default=None, metavar="LIST",
                   help="comma-separated thread counts to time each size at, e.g. 1,2"
                   " (default: the current torch thread count)")
    p.add_argument("--reps", type=int, default=None, help="timed rounds (default per size)")
    p.add_argument("--no-compile", action="store_true", help="time eager models only")
    p.add_argument("--compile-modes", default=None, metavar="LIST",
                   help="compiled modes timed beside eager: compiled (per block),"
                   " compiled_model (whole model, as train.compile=on); default both")
    p.add_argument("--decode-runs", default=None, metavar="RUN,RUN,...",
                   help="instead: decode speed and KV bytes of trained runs side by side"
                   " (real test prompts, causal routing; first run is the reference)")
    p.add_argument("--no-law", action="store_true", help="skip the law-fit timing")
    p.add_argument("--no-decode", action="store_true", help="skip the decode timing")
    p.add_argument("--no-widths", action="store_true",
                   help="skip the width scan (X-MoD over dense at widths 128-1024, one thread)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from xmodlm.bench import run_bench

    if args.reps is not None and args.reps < 1:
        raise UserError(f"--reps {args.reps}: must be >= 1 (timed rounds)")
    if args.decode_runs:
        from xmodlm.bench.decode import decode_runs

        runs = [r for r in args.decode_runs.split(",") if r]
        for run in runs:
            if not Path(run).is_dir():
                raise UserError(f"--decode-runs: {run!r} is not a run directory")
        print_json(decode_runs(runs, rounds=args.reps or 5, device=check_device(args.device)))
        return 0
    # the full bench takes 30-60 minutes on 2 cores: it is asked for by naming sizes
    quick = args.quick or args.sizes is None
    if quick and not args.quick and not args.quiet:
        print("[bench] the quick smoke set (under a minute); --sizes all for the full bench",
              file=sys.stderr, flush=True)
    result = run_bench(
        device=args.device, quick=quick, reps=args.reps, include_law=not args.no_law,
        include_decode=not args.no_decode, include_widths=not args.no_widths,
        include_compile=False if args.no_compile else None,
        compile_modes=args.compile_modes, progress=not args.quiet, sizes=args.sizes,
        threads=args.threads,
    )
    print_json(result)  # the figures are one JSON object either way
    return 0
