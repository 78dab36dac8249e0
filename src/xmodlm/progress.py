"""Progress of long work, on stderr: the one helper every long phase uses, a
command's (training steps, evaluation batches, bootstrap replicates, ...) and a
sweep's live line of runs alike.

A phase is a :class:`Progress` with a name, a total and a unit:

* on a terminal, a tqdm bar (stage, count, rate and ETA);
* otherwise (a log file, a pipe, a batch job), plain lines
  ``stage: done/total unit, 12s elapsed, ETA 40s``: at most one every
  :data:`PLAIN_EVERY_S` seconds, plus the last, so logs stay short;
* nothing when switched off: ``enabled=False``, or :func:`set_enabled` (the CLI's
  ``--quiet``) for every phase of the process.

Work done in parallel items of unequal size (a sweep's runs) also counts the items
running and failed, and weighs its ETA by each item's estimated cost
(:meth:`Progress.finished`).

Everything goes to stderr, so a command's ``--json`` output on stdout stays clean.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator, Mapping
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
    the count. ``enabled=None`` follows :func:`set_enabled`.

    ``weights`` (item name -> estimated cost, e.g. seconds) make the ETA weigh items
    by cost rather than count them, with :meth:`finished` ending each item by name:
    a sweep's runs differ by tiers several times apart, and a small run costs more to
    start and evaluate than to train, so counting runs misjudges the time left. Until
    ``parallel`` items (as many as run at once) have ended, the ETA is the estimate
    counted down: the total cost over ``parallel``, less the time so far (the first
    item to end is the cheapest of those running, and what the others have done is
    not seen yet: on micro-quick the speed seen at the first end put the ETA 51% over
    the truth). Then it is the time so far times the cost left over the cost
    finished (the estimate, corrected by the speed seen). ``every_s=0`` writes a plain
    line at every change of the counts (a sweep's runs are few and long).
    """

    def __init__(
        self,
        total: int | None,
        desc: str,
        unit: str = "it",
        initial: int = 0,
        enabled: bool | None = None,
        every_s: float | None = None,
        weights: Mapping[str, float] | None = None,
        parallel: int = 1,
    ) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.done = initial
        self._start_done = initial
        self.failed = 0
        self.running: int | None = None  # shown once set (set_running)
        self.weights = dict(weights or {})
        self.weighted = bool(self.weights)
        self.weight_left = sum(self.weights.values())
        self.weight_done = 0.0
        self.ended = 0  # weighted items ended, done or failed
        self.parallel = max(1, parallel)
        self.enabled = _ENABLED if enabled is None else bool(enabled)
        self.every_s = PLAIN_EVERY_S if every_s is None else every_s
        self.stream = sys.stderr  # read now: a test (or caller) may have replaced it
        self.t0 = self._last = time.monotonic()
        self.postfix: dict[str, Any] = {}
        self.bar: Any = None
        self._closed = False
        self._printed_final = False
        self._shown: tuple[int, int | None, int] | None = None  # counts of the last line
        if self.enabled and isatty(self.stream):
            from tqdm import tqdm

            # weighted: tqdm's own ETA counts items, so ours goes in the postfix instead
            fmt = "{l_bar}{bar}| {n_fmt}/{total_fmt} {unit} [{elapsed}{postfix}]"
            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit,
                            dynamic_ncols=True, file=self.stream, mininterval=1.0,
                            bar_format=fmt if self.weighted else None)

    def update(self, n: int = 1, **postfix: Any) -> None:
        self.done += n
        if postfix:
            self.postfix = postfix
        if self.enabled and self.bar is not None:
            self.bar.update(n)
        self._show()

    def finished(self, name: str, failed: bool = False) -> None:
        """Item ``name`` ended: one more done, or failed (counted apart, never done);
        its weight moves from the cost left to the cost finished."""
        weight = self.weights.pop(name, 0.0)
        self.weight_left -= weight
        self.weight_done += weight
        self.ended += 1
        if failed:
            self.failed += 1
            self._show()
        else:
            self.update(1)

    def set_running(self, running: int) -> None:
        """How many items run now (shown beside the count)."""
        self.running = running
        self._show()

    def _show(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            if status := self._status(bar=True):
                parts = [*status, *([self._postfix()] if self.postfix else [])]
                self.bar.set_postfix_str(", ".join(parts), refresh=False)
            elif self.postfix:
                self.bar.set_postfix(self.postfix, refresh=False)
            return
        counts = (self.done, self.running, self.failed)
        if counts == self._shown:  # a poll that changed nothing
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

    def eta(self) -> float | None:
        """Seconds left (nan where nothing says yet; None once every item ended)."""
        if self.total is None or self.done + self.failed >= self.total:
            return None
        elapsed = time.monotonic() - self.t0
        if self.weighted:
            countdown = (self.weight_left + self.weight_done) / self.parallel - elapsed
            if self.weight_done > 0 and (self.ended >= self.parallel or countdown <= 0):
                return elapsed * self.weight_left / self.weight_done
            return countdown if countdown > 0 else float("nan")  # past the estimate
        ran = self.done - self._start_done
        return elapsed / ran * (self.total - self.done) if ran > 0 else float("nan")

    def _status(self, bar: bool = False) -> list[str]:
        """What the line says beside the count: items running and failed, the time
        (a bar shows its own elapsed time, and its own ETA unless weighted)."""
        parts = [] if self.running is None else [f"{self.running} running"]
        parts += [f"{self.failed} failed"] if self.failed else []
        if not bar:
            parts.append(f"{_duration(time.monotonic() - self.t0)} elapsed")
        if (eta := self.eta()) is not None and (self.weighted or not bar):
            parts.append(f"ETA {_duration(eta)}")
        return parts

    def _postfix(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in self.postfix.items())

    def line(self) -> str:
        """The plain progress line as it reads now."""
        count = f"{self.done}/{self.total}" if self.total is not None else f"{self.done}"
        text = ", ".join([f"{self.desc}: {count} {self.unit}", *self._status()])
        return text + (f" ({self._postfix()})" if self.postfix else "")

    def _line(self, final: bool = False) -> None:
        print(self.line(), file=self.stream, flush=True)
        self._printed_final = final
        self._shown = (self.done, self.running, self.failed)

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
        elif (not failed and not self._printed_final
              and self._shown != (self.done, self.running, self.failed)):
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
