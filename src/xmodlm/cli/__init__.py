"""The ``xmod`` command: thin wrappers over library functions.

Each subcommand parses its arguments, calls one library function and prints the
result. :func:`main` is the error boundary:

* expected failures are one line on stderr and exit status 2: an argument the
  parser rejects, a :class:`~xmodlm.errors.UserError` (bad value, bad file, bad
  spec), and an ``OSError`` of the machine (a full disk, a read-only file system,
  a missing permission), named with its path and cause;
* anything else is a bug of ours: one line saying so and where the full trace was
  written (``error.log`` in the run directory of ``xmod train``, else a temporary
  file), exit status 1.

The commands live by group, each beside the arguments it reads:
:mod:`~xmodlm.cli.train` (info, presets, data prepare, train, demo),
:mod:`~xmodlm.cli.sweep` (sweep, results, report), :mod:`~xmodlm.cli.run`
(generate, export, eval, calibrate, lm-eval, show-routing, plot),
:mod:`~xmodlm.cli.law` (law fit, law predict, recommend) and
:mod:`~xmodlm.cli.bench`; what they share (the one-line parser, argument types,
output checks) is :mod:`~xmodlm.cli.common`.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import tempfile
import traceback
from pathlib import Path

from xmodlm.cli import bench, law, run, sweep, train
from xmodlm.cli.common import Handler, Parser
from xmodlm.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="xmod",
        description="Sparse-depth language models (X-MoD): train, evaluate, fit scaling laws.",
    )
    from xmodlm import __version__

    parser.add_argument("--version", action="version", version=f"xmod-lm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    train.info_args(sub)
    train.presets_args(sub)
    train.data_args(sub)
    train.train_args(sub)
    sweep.sweep_args(sub)
    sweep.results_args(sub)
    run.generate_args(sub)
    run.export_args(sub)
    run.eval_args(sub)
    run.calibrate_args(sub)
    run.lm_eval_args(sub)
    run.show_routing_args(sub)
    run.plot_args(sub)
    law.law_args(sub)
    law.recommend_args(sub)
    sweep.report_args(sub)
    bench.bench_args(sub)
    train.demo_args(sub)
    _quiet_everywhere(sub)
    return parser


def _quiet_everywhere(sub: argparse._SubParsersAction) -> None:
    """Every command takes ``--quiet``: a script can pass it to any of them. Those
    that show no progress of their own accept it (main silences progress anywhere)."""
    for parser in sub.choices.values():
        nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if nested:
            _quiet_everywhere(nested[0])
        elif "--quiet" not in parser._option_string_actions:
            parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _os_error(err: OSError, args: argparse.Namespace) -> str:
    """An OSError as 'path: cause': the file it hit when it says, else the command's
    output or run directory (a failed write() or fsync() names no file)."""
    cause = err.strerror or (errno.errorcode.get(err.errno, "") if err.errno else "") or str(err)
    where = " -> ".join(str(f) for f in (err.filename, err.filename2) if f)
    if where:
        return f"{where}: {cause}"
    for key in ("out", "run_dir", "sweep_dir"):
        if getattr(args, key, None):
            return f"{cause} (working in {getattr(args, key)})"
    return cause


def _trace_file(args: argparse.Namespace) -> str | None:
    """Write the current exception's full trace where the user will look for it:
    ``error.log`` in the run directory of ``xmod train``, else a temporary file."""
    text = traceback.format_exc()
    out = getattr(args, "out", None) if getattr(args, "command", None) == "train" else None
    if out and Path(out).is_dir():
        try:
            with open(Path(out) / "error.log", "a", encoding="utf-8") as f:
                f.write(text)
            return str(Path(out) / "error.log")
        except OSError:
            pass
    try:
        fd, path = tempfile.mkstemp(prefix="xmod-error-", suffix=".log")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        return path
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # bare `xmod`: the command list
        parser.print_help()
        return 0
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help (0) or an argument the parser rejected (2)
        return exit_.code if isinstance(exit_.code, int) else 2
    handler: Handler = args.func
    nested = getattr(args, f"{args.command}_command", None)  # xmod law fit, xmod data prepare
    name = f"xmod {args.command}" + (f" {nested}" if nested else "")
    from xmodlm.progress import set_enabled

    progress_was = set_enabled(not getattr(args, "quiet", False))
    try:
        return handler(args)
    except UserError as err:
        sys.stderr.write(f"{name}: error: {_one_line(err)}\n")
        return 2
    except OSError as err:  # the machine: full disk, read-only file system, permissions
        sys.stderr.write(f"{name}: error: {_one_line(_os_error(err, args))}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("xmod: interrupted\n")
        return 130
    except Exception as err:  # a bug of ours: one line, the trace kept in a file
        where = _trace_file(args)
        kept = f"full trace in {where}" if where else "the trace could not be written"
        sys.stderr.write(
            f"{name}: internal error (a bug, please report it):"
            f" {type(err).__name__}: {_one_line(err)[:300]}; {kept}\n"
        )
        return 1
    finally:
        set_enabled(progress_was)
