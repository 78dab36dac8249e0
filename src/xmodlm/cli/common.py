"""What every command group shares: the parser that fails in one line, the help that
shows defaults, argument types checked where they are parsed, output paths checked
before any work, and JSON printing.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xmodlm.config import SEED_MAX
from xmodlm.errors import UserError

Handler = Callable[[argparse.Namespace], int]


class Formatter(argparse.HelpFormatter):
    """``--help`` shows each option's default (unless unset, off, or already said)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default in (None, False, argparse.SUPPRESS, [])
            or not (action.option_strings or action.nargs in ("?", "*"))
        ):
            return text
        return f"{text} (default: %(default)s)".lstrip()


class Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line and exit status 2 (no usage dump)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        if kwargs.get("help") is None and kwargs.get("default") not in (None, False):
            kwargs["help"] = "(default: %(default)s)"
        return super().add_argument(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False, default=json_default))


def json_default(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "__fspath__"):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def finite(text: str) -> float:
    """argparse type: a finite number (``float`` alone accepts nan and inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number")
    return value


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """argparse type: an integer in [low, high], checked where it is parsed (a negative
    count or a seed beyond what the generators take would otherwise fail deep inside)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            bound = f"in {low}..{high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"{text}: must be an integer {bound}")
        return value

    return parse


seed_int = int_in(0, SEED_MAX)
count_int = int_in(1)
index_int = int_in(0)


def positive(text: str) -> float:
    """argparse type: a finite number > 0 (rates, sizes, budgets)."""
    value = finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text}: must be > 0")
    return value


def check_device(name: str) -> str:
    """``--device`` of eval, generate, show-routing and lm-eval: cpu, cuda, cuda:N or auto,
    and CUDA only where it is available."""
    if name not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", name):
        raise UserError(f"--device {name!r}: must be cpu, cuda, cuda:N or auto")
    from xmodlm.hardware import resolve_device

    return str(resolve_device(name))


def check_text(text: str, flag: str) -> str:
    """Text from the command line must be UTF-8 (invalid bytes arrive as surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(f"{flag} is not valid UTF-8 text") from None
    return text


def _blocking_file(path: Path) -> Path | None:
    """The first existing non-directory among ``path``'s parents (a path under a file)."""
    for parent in reversed(path.parents):
        if parent.exists() and not parent.is_dir():
            return parent
    return None


def check_out_dir(path: str | Path, own: str | None, flag: str = "--out") -> Path:
    """An output directory: absent (it is created) or a directory, never under a file,
    and never one that holds another writer's corpus, run, sweep or export (``own``:
    the kind this command writes, :func:`xmodlm.folders.check_writable`)."""
    from xmodlm.folders import check_writable

    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UserError(f"{flag} {str(out)!r} is a file, not a directory")
    blocker = _blocking_file(out)
    if blocker is not None:
        raise UserError(f"{flag} {str(out)!r}: {str(blocker)!r} is a file, not a directory")
    check_writable(out, own, flag)
    return out


def check_out_file(path: str | Path, suffixes: tuple[str, ...], flag: str = "--out") -> Path:
    """An output file: not a directory, its folder not under a file, and its extension
    one of ``suffixes``, the formats its writer produces."""
    out = Path(path)
    if out.is_dir():
        raise UserError(f"{flag} {str(out)!r} is a directory; give a file name")
    if out.suffix.lower() not in suffixes:
        raise UserError(
            f"{flag} {str(out)!r}: this command writes {', '.join(suffixes)} files; give a name"
            " ending in one of them"
        )
    blocker = _blocking_file(out)
    if blocker is not None:
        raise UserError(f"{flag} {str(out)!r}: {str(blocker)!r} is a file, not a directory")
    return out


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="preset name (e.g. xmod-tiny) or path to a YAML file")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set model.stride=8 (repeatable)",
    )
