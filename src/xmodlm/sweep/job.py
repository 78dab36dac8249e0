"""One run of a sweep, as child processes: ``xmod train`` and then, if asked,
``xmod eval``, each in its own process so one failing run never takes the others
down; and :class:`SweepStop`, which passes SIGINT and SIGTERM on to those children
(each checkpoints and exits; the run counts as interrupted, and a rerun resumes it).
A :class:`Job` is plain data, so any executor can ship it to another process or
machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xmodlm.fileio import atomic_write_text
from xmodlm.record import EVAL_FILE

ERROR_TAIL_LINES = 20
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
INTERRUPTED_CODES = frozenset({130, 143, -signal.SIGINT, -signal.SIGTERM})
"""Exit statuses of a child stopped by SIGINT or SIGTERM: ``xmod`` says 130 (it
caught the signal and checkpointed), a process killed before it could catch it
says minus the signal."""


class SweepStop:
    """The sweep's answer to SIGINT and SIGTERM: remember the signal, pass it on.

    Every child process a job starts is adopted here while it runs. A signal sets
    :attr:`signum` (no queued run starts after it) and is forwarded to each child,
    which checkpoints and exits; a child adopted after the signal gets it at once,
    so none starts training into a stopped sweep.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._children: set[subprocess.Popen[Any]] = set()
        self._lock = threading.Lock()

    def stop(self, signum: int) -> None:
        """Stop the sweep: remember ``signum`` and forward it to every running child."""
        with self._lock:
            self.signum = signum
            children = list(self._children)
        for child in children:
            _signal_child(child, signum)

    def adopt(self, child: subprocess.Popen[Any]) -> None:
        with self._lock:
            self._children.add(child)
            signum = self.signum
        if signum is not None:
            _signal_child(child, signum)

    def release(self, child: subprocess.Popen[Any]) -> None:
        with self._lock:
            self._children.discard(child)

    @contextlib.contextmanager
    def installed(self) -> Iterator[SweepStop]:
        """Handle SIGINT and SIGTERM with :meth:`stop` (main thread only; restored after)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        for s in STOP_SIGNALS:
            signal.signal(s, lambda signum, frame: self.stop(signum))
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def _signal_child(child: subprocess.Popen[Any], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        if child.poll() is None:
            child.send_signal(signum)


def _run_child(
    cmd: list[str], env: dict[str, str], stop: SweepStop | None, **streams: Any
) -> tuple[int, Any]:
    """(exit status, captured stdout) of one child run to its end.

    The child is adopted by ``stop`` while it runs, so a signal to the sweep
    reaches it. Should this thread be interrupted instead (a cancelled Ray task),
    the child is sent SIGINT and waited for: it is never orphaned, still training
    under its run's lock.
    """
    with subprocess.Popen(cmd, env=env, **streams) as child:
        if stop is not None:
            stop.adopt(child)
        try:
            out, _ = child.communicate()
        except BaseException:
            _signal_child(child, signal.SIGINT)
            child.wait()
            raise
        finally:
            if stop is not None:
                stop.release(child)
    return child.returncode, out


@dataclass(frozen=True)
class Job:
    """What a worker needs to run one training run (plain data: it crosses processes)."""

    run_id: str
    run_dir: str
    config_yaml: str
    threads: int
    eval_args: tuple[str, ...] = ()  # ``xmod eval`` options; empty: no evaluation
    run_set: tuple[str, ...] = ()  # ``--set`` overrides of how the run executes (check_run_set)


def trained_status(run: Path) -> str | None:
    """The status in a run's summary.json, or None (none yet, or unreadable)."""
    try:
        status = json.loads((run / "summary.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return None
    return status if isinstance(status, str) else None


def _failed(outcome: dict[str, Any], log: Path) -> dict[str, Any]:
    lines = log.read_text(errors="replace").splitlines()
    return {**outcome, "status": "failed", "error_tail": "\n".join(lines[-ERROR_TAIL_LINES:])}


def _interrupted(returncode: int, stop: SweepStop | None) -> bool:
    """Whether a child that ended with ``returncode`` was stopped by a signal: its
    exit status says so, or the sweep was stopping and the run left no summary."""
    return returncode in INTERRUPTED_CODES or (
        stop is not None and stop.signum is not None and returncode != 0
    )


def run_job(job: Job, stop: SweepStop | None = None) -> dict[str, Any]:
    """Train one run in a subprocess, then evaluate its final checkpoint if asked;
    return its outcome (never raises for run errors). A run already trained is only
    evaluated (a sweep resumed after its evaluation was added, or had failed).

    ``stop``: the sweep's :class:`SweepStop`; once it is set no child starts, and a
    child stopped by a signal makes the outcome ``interrupted`` (resumed by a rerun),
    never ``failed``.
    """
    outcome: dict[str, Any] = {"run_id": job.run_id, "returncode": 0}
    if stop is not None and stop.signum is not None:
        return {**outcome, "status": "interrupted", "wall_s": 0.0}
    run = Path(job.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    cfg_path = run / "sweep_config.yaml"
    atomic_write_text(cfg_path, job.config_yaml)
    env = {**os.environ, "OMP_NUM_THREADS": str(job.threads)}
    log_path = run / "train.log"
    t0 = time.time()
    if trained_status(run) != "ok":
        cmd = [sys.executable, "-m", "xmodlm", "train", str(cfg_path), "--out", str(run), "--quiet",
               *(arg for item in job.run_set for arg in ("--set", item))]
        with open(log_path, "a") as log:
            code, _ = _run_child(cmd, env, stop, stdout=log, stderr=subprocess.STDOUT)
        outcome["returncode"] = code
        status = trained_status(run)
        if status is None and _interrupted(code, stop):
            return {**outcome, "status": "interrupted", "wall_s": time.time() - t0}
        if code not in (0, 1) or status is None:
            return _failed({**outcome, "wall_s": time.time() - t0}, log_path)
    outcome["status"] = trained_status(run)
    if job.eval_args and outcome["status"] == "ok" and not (run / EVAL_FILE).is_file():
        cmd = [sys.executable, "-m", "xmodlm", "eval", str(run), "--json", "--quiet",
               *job.eval_args]
        with open(log_path, "a") as log:
            code, stdout = _run_child(cmd, env, stop, stdout=subprocess.PIPE, stderr=log,
                                      text=True)
        if code != 0 and _interrupted(code, stop):
            return {**outcome, "returncode": code, "status": "interrupted",
                    "wall_s": time.time() - t0}
        if code != 0:
            return _failed({**outcome, "returncode": code, "wall_s": time.time() - t0}, log_path)
        atomic_write_text(run / EVAL_FILE, stdout)
    outcome["wall_s"] = time.time() - t0
    return outcome
