"""Run the benchmark and keep its JSON: ``python benchmarks/run_bench.py [--quick] [--out F]``.

The same as ``xmod bench --json --sizes all`` (every size unless --sizes names some); it also writes the result (with the machine
record inside it) to ``--out`` so that a figure quoted in docs/benchmarks.md can
be traced to the run that produced it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from xmodlm.bench import run_bench
from xmodlm.errors import UserError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="smoke mode, under a minute")
    parser.add_argument("--sizes", default=None, help="e.g. bench,w128-t128 (default all)")
    parser.add_argument("--threads", default=None, help="e.g. 1,2 (default: current count)")
    parser.add_argument("--reps", type=int, default=None, help="timed rounds (default per size)")
    parser.add_argument("--no-law", action="store_true")
    parser.add_argument("--no-decode", action="store_true")
    parser.add_argument("--no-widths", action="store_true")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    try:
        result = run_bench(
            device=args.device,
            quick=args.quick,
            reps=args.reps,
            include_law=not args.no_law,
            include_decode=not args.no_decode,
            include_widths=not args.no_widths,
            include_compile=False if args.no_compile else None,
            progress=True,
            sizes=args.sizes,
            threads=args.threads,
        )
    except UserError as err:
        sys.stderr.write(f"run_bench: error: {err}\n")
        return 2
    text = json.dumps(result, indent=1)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
