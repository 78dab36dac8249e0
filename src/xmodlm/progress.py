"""Progress of long work, on stderr: the helper each command's phases use (a sweep's
live line of runs, with its cost-weighted ETA, is :class:`xmodlm.sweep.runner.Progress`).

A phase (training steps, evaluation batches, bootstrap replicates, ...) is a
:class:`Progress` with a name, a total and a unit:

* on a terminal, a tqdm bar (stage, count, rate and ETA);
* otherwise (a log file, a pipe, a batch job), plain lines
  ``stage: done/total unit, 12s elapsed, ETA 40s``: at most one every
  :data:`PLAIN_EVERY_S` seconds, plus the last, so logs stay short;
* nothing when switched off: ``enabled=False``, or :func:`set_enabled` (the CLI's
  ``--quiet``) for every phase of the process.

Everything goes to stderr, so a command's ``--json`` output on stdout stays clean.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar

PLAIN_EVERY_S = 30.0

T = TypeVar("T")

_ENABLED = True


def set_enabled(on: bool) -> bool:
    """Switch every later progress display of this process on or off; return the old setting."""
    global _ENABLED
    old, _ENABLED = _ENABLED, bool(on)
    return old


def enabled() -> bool:
    return _ENABLED


def isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


def _duration(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """One phase of work: ``update()`` after each unit, ``close()`` at the end (or use
    it as a context manager). ``postfix`` keywords (e.g. ``loss=...``) are shown beside
    the count. ``enabled=None`` follows :func:`set_enabled`."""

    def __init__(
        self,
        total: int | None,
        desc: str,
        unit: str = "it",
        initial: int = 0,
        enabled: bool | None = None,
        every_s: float | None = None,
    ) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.done = initial
        self._start_done = initial
        self.enabled = _ENABLED if enabled is None else bool(enabled)
        self.every_s = PLAIN_EVERY_S if every_s is None else every_s
        self.stream = sys.stderr  # read now: a test (or caller) may have replaced it
        self.t0 = self._last = time.monotonic()
        self.postfix: dict[str, Any] = {}
        self.bar: Any = None
        self._closed = False
        self._printed_final = False
        if self.enabled and isatty(self.stream):
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit,
                            dynamic_ncols=True, file=self.stream, mininterval=1.0)

    def update(self, n: int = 1, **postfix: Any) -> None:
        self.done += n
        if postfix:
            self.postfix = postfix
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            return
        now = time.monotonic()
        last = self.total is not None and self.done >= self.total
        if last and self._printed_final:  # past the total: the last line is out already
            return
        if last or now - self._last >= self.every_s:
            self._last = now
            self._line(final=last)

    def note(self, message: str) -> None:
        """A one-line message for the person watching (above the bar on a terminal)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    def line(self) -> str:
        """The plain progress line as it reads now."""
        elapsed = time.monotonic() - self.t0
        count = f"{self.done}/{self.total}" if self.total is not None else f"{self.done}"
        text = f"{self.desc}: {count} {self.unit}, {_duration(elapsed)} elapsed"
        if self.total is not None and self.done < self.total:
            ran = self.done - self._start_done
            eta = elapsed / ran * (self.total - self.done) if ran > 0 else float("nan")
            text += f", ETA {_duration(eta)}"
        if self.postfix:
            text += " (" + ", ".join(f"{k} {v}" for k, v in self.postfix.items()) + ")"
        return text

    def _line(self, final: bool = False) -> None:
        print(self.line(), file=self.stream, flush=True)
        self._printed_final = final

    def close(self, failed: bool = False) -> None:
        """End the phase: the last plain line (also when the total was not reached),
        unless ``failed`` (the error that stopped it says enough)."""
        if self._closed:
            return
        self._closed = True
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        elif not failed and not self._printed_final:
            self._line(final=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(failed=exc_type is not None)


class _Tracked(Generic[T]):
    """An iterable that reports each item it yields; keeps ``len`` of a sized one."""

    def __init__(self, items: Iterable[T], progress: Progress) -> None:
        self.items, self.progress = items, progress

    def __len__(self) -> int:
        return len(self.items)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[T]:
        for item in self.items:
            yield item
            self.progress.update(1)
        self.progress.close()


def track(
    items: Iterable[T], desc: str, unit: str = "it", total: int | None = None,
    enabled: bool | None = None,
) -> _Tracked[T]:
    """``items``, reporting progress as they are consumed (closed at the end)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    return _Tracked(items, Progress(total, desc, unit, enabled=enabled))
