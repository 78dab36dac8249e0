"""Running a sweep: resumable, retrying, on an existing engine.

Each run is one ``xmod train`` subprocess with its own run directory
``OUT/runs/<id>``, so a run is resumed exactly as a single training run is, and
one failing run never takes the others down. The state of a run is read from
its directory, never kept elsewhere:

* ``summary.json`` with status ``ok`` (or ``diverged``): finished, skipped;
* ``failure.json``: failed ``attempts`` times; retried until ``max_retries``;
* anything else: pending, or interrupted (then ``xmod train`` resumes it).

SIGINT and SIGTERM stop a sweep in one go (:class:`SweepStop`): the signal is
forwarded to every running ``xmod train`` / ``xmod eval`` child, each child writes
its checkpoint and exits, those runs are recorded as interrupted (not failed: no
``failure.json``, a rerun resumes them), no queued run starts, and the sweep exits
with 128 + the signal's number (130 or 143).

Executors hand runs to an engine and do no scheduling of their own:

* ``local``: a process pool on this machine, cores shared between workers;
* ``ray``: one Ray task per run (``ray.init(address=...)``: a cluster or a local
  instance);
* ``slurm``: one Slurm job per run through submitit (``LocalExecutor`` for tests).
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
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xmodlm.errors import UserError
from xmodlm.fileio import atomic_write_json, atomic_write_text
from xmodlm.progress import Progress
from xmodlm.record import EVAL_FILE
from xmodlm.sweep.spec import RunSpec

if TYPE_CHECKING:
    from xmodlm.config import Config

ERROR_TAIL_LINES = 20
SWEEP_FILE = "sweep.json"  # OUT/sweep.json: the name of the spec whose runs OUT holds
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

def check_options(executor: str, workers: int | None, max_retries: int) -> None:
    """Options of a sweep, checked before any run starts."""
    if executor not in EXECUTORS:
        raise UserError(f"executor {executor!r} unknown; allowed: {', '.join(EXECUTORS)}")
    if workers is not None and workers < 1:
        raise UserError(f"--workers {workers}: must be >= 1 (concurrent runs)")
    if max_retries < 0:
        raise UserError(f"--max-retries {max_retries}: must be >= 0")


def check_data(runs: list[RunSpec]) -> None:
    """Each distinct data directory of the runs, checked once before any run starts
    (rather than found missing by every run in turn), and every run against its
    data: a vocabulary below the data's, or a context longer than a split holds,
    would fail run after run, each only in its own log."""
    from xmodlm.data.batches import load_manifest, load_split

    for data_dir in sorted({r.cfg.data.dir for r in runs}):
        vocab = load_manifest(data_dir)["vocab_size"]
        splits = {split: load_split(data_dir, split) for split in ("train", "val")}
        mine = [r for r in runs if r.cfg.data.dir == data_dir]
        if small := [r for r in mine if r.cfg.model.vocab_size < vocab]:
            raise UserError(
                f"sweep spec: run {small[0].run_id} has model.vocab_size"
                f" {small[0].cfg.model.vocab_size}, below the vocabulary of {vocab} of {data_dir}"
                f" ({len(small)} run(s)): set model.vocab_size >= {vocab}"
            )
        longest = max(mine, key=lambda r: r.cfg.model.context)
        for data in splits.values():
            try:
                data.check_context(longest.cfg.model.context)
            except UserError as err:
                raise UserError(f"sweep spec: run {longest.run_id} of {data_dir}: {err}") from None


@dataclass(frozen=True)
class Job:
    """What a worker needs to run one training run (plain data: it crosses processes)."""

    run_id: str
    run_dir: str
    config_yaml: str
    threads: int
    eval_args: tuple[str, ...] = ()  # ``xmod eval`` options; empty: no evaluation
    run_set: tuple[str, ...] = ()  # ``--set`` overrides of how the run executes (check_run_set)


def _trained_status(run: Path) -> str | None:
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
    if _trained_status(run) != "ok":
        cmd = [sys.executable, "-m", "xmodlm", "train", str(cfg_path), "--out", str(run), "--quiet",
               *(arg for item in job.run_set for arg in ("--set", item))]
        with open(log_path, "a") as log:
            code, _ = _run_child(cmd, env, stop, stdout=log, stderr=subprocess.STDOUT)
        outcome["returncode"] = code
        status = _trained_status(run)
        if status is None and _interrupted(code, stop):
            return {**outcome, "status": "interrupted", "wall_s": time.time() - t0}
        if code not in (0, 1) or status is None:
            return _failed({**outcome, "wall_s": time.time() - t0}, log_path)
    outcome["status"] = _trained_status(run)
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


def check_run_set(items: Sequence[str], cfg: Config) -> tuple[str, ...]:
    """The ``--run-set`` overrides, checked: settings of how runs execute, not of
    what they train.

    A run's id hashes its configuration, so changing any setting in the spec
    makes new runs. The train settings that a resumed run may change freely
    (:data:`xmodlm.config.RESUME_FREE`: device, compile, logging and
    checkpoint cadence, trackers) do not change what is trained; these may be set
    per invocation instead, passed to every run's ``xmod train`` (``--set``), so
    that a committed sweep can be resumed compiled, or on a GPU, under the same
    ids. Each value is checked on ``cfg`` (one of the sweep's run configs).
    """
    from xmodlm.config import RESUME_FREE

    allowed = ", ".join(f"train.{k}" for k in sorted(RESUME_FREE))
    for item in items:
        key = item.split("=", 1)[0].strip()
        section, _, name = key.partition(".")
        if "=" not in item or section != "train" or name not in RESUME_FREE:
            raise UserError(
                f"--run-set {item!r}: only settings that do not change what is trained may be"
                f" set for one invocation (KEY=VALUE with KEY one of {allowed}); put the others"
                " in the spec's set"
            )
    if items:
        cfg.merge(list(items)).validate()
    return tuple(items)


def run_state(run_dir: Path, needs_eval: bool = False) -> tuple[str, int]:
    """(state, failed attempts) of a run directory: done | failed | pending. With
    ``needs_eval``, a trained run is done once its evaluation is written too."""
    status = _trained_status(run_dir) if (run_dir / "summary.json").is_file() else None
    if status == "diverged" or (status == "ok" and (not needs_eval or (run_dir / EVAL_FILE).is_file())):
        return "done", 0
    failure = run_dir / "failure.json"
    attempts = 0
    if failure.is_file():
        try:
            attempts = int(json.loads(failure.read_text()).get("attempts", 0))
        except ValueError:
            attempts = 0
    return ("failed" if attempts else "pending"), attempts


def claim_out(out: Path, name: str | None, runs: list[RunSpec]) -> None:
    """Refuse a sweep folder that holds another spec's runs; record this spec's name.

    Two specs in one folder would mix their runs in one ``results.csv``. The folder
    says whose it is in ``sweep.json`` (a changed spec of the same name, with more
    seeds or budgets, is the same sweep). A folder from before that file is another
    sweep's when it holds runs and none of them is one of these.
    """
    marker = out / SWEEP_FILE
    try:
        owner = json.loads(marker.read_text()).get("name") if marker.is_file() else None
    except (OSError, ValueError, AttributeError):
        owner = None
    existing = {d.name for d in (out / "runs").iterdir() if d.is_dir()} \
        if (out / "runs").is_dir() else set()
    if owner is not None and name is not None and owner != name:
        raise UserError(
            f"--out {str(out)!r} holds the runs of sweep {owner!r}, not {name!r}: give another"
            f" --out (both in one folder would mix in one results.csv)"
        )
    if owner is None and existing and not existing & {r.run_id for r in runs}:
        raise UserError(
            f"--out {str(out)!r} holds {len(existing)} runs, none of them of this spec: it is"
            " another sweep's folder; give another --out"
        )
    if name is not None and owner is None:
        atomic_write_json(marker, {"name": name})


def adopt_earlier_runs(runs: list[RunSpec], runs_dir: Path) -> list[RunSpec]:
    """The runs, each under the id of an earlier run directory that is the same run.

    A run id hashes the resolved configuration, so a release that adds a config
    field (with its default) gives every run a new id, and a sweep resumed with
    it, on a results folder committed by an older release, would train every
    finished run again. A run directory whose ``config.yaml`` agrees with a run's
    configuration on every field it records, while the fields it lacks are at
    their defaults in the new one, is that run: it keeps its directory.
    """
    import dataclasses

    import yaml

    from xmodlm.config import Config

    if not runs_dir.is_dir():
        return runs
    ids = {r.run_id for r in runs}
    earlier = {}
    for d in sorted(runs_dir.iterdir()):
        if d.name in ids or not (d / "config.yaml").is_file():
            continue
        try:
            earlier[d.name] = yaml.safe_load((d / "config.yaml").read_text())
        except (OSError, yaml.YAMLError):
            continue
    if not earlier:
        return runs
    defaults = Config().to_dict()
    out = []
    for r in runs:
        new = r.cfg.to_dict()
        match = next((rid for rid, old in earlier.items() if _same_run(old, new, defaults)), None)
        if match is not None and not (runs_dir / r.run_id).exists():
            del earlier[match]
            r = dataclasses.replace(r, run_id=match)
        out.append(r)
    return out


def _same_run(old: Any, new: Any, defaults: Any) -> bool:
    """``old`` (an earlier config) equals ``new`` wherever ``old`` has a value, and
    every key only ``new`` has is at its default."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key, value in new.items():
            if key in old:
                if not _same_run(old[key], value, (defaults or {}).get(key)):
                    return False
            elif not isinstance(defaults, dict) or defaults.get(key) != value:
                return False
        return set(old) <= set(new)
    return old == new


def _estimated_seconds(runs: dict[str, RunSpec], out: Path, workers: int) -> dict[str, float]:
    """Each run's estimated wall time (:func:`xmodlm.sweep.spec.estimate_seconds`: a
    fixed cost plus its FLOPs over a rate), measured by this sweep's finished runs
    where there are some."""
    from xmodlm.sweep.spec import estimate_seconds, measured_rate

    if not runs:
        return {}
    measured = measured_rate(out)
    seconds = estimate_seconds(list(runs.values()), workers=workers,
                               rate=None if measured is None else measured.rate,
                               fixed_s=None if measured is None else measured.fixed_s)
    return dict(zip(runs, seconds, strict=True))


def run_sweep(
    runs: list[RunSpec],
    out_dir: str | Path,
    executor: str = "local",
    workers: int | None = None,
    max_retries: int = 2,
    progress: bool = True,
    eval_args: tuple[str, ...] = (),
    run_set: Sequence[str] = (),
    name: str | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Run every unfinished run of a sweep; return counts and each run's outcome.

    ``name``: the spec's name, recorded in ``OUT/sweep.json``; a folder holding
    another sweep's runs is refused (:func:`claim_out`).

    ``eval_args``: ``xmod eval`` options (:func:`xmodlm.sweep.spec.eval_args`); each
    run's final checkpoint is then evaluated right after training, into
    ``RUN/eval.json``, while the checkpoint is on this machine. ``run_set``:
    overrides of how the runs execute (:func:`check_run_set`), ids unchanged.

    ``options``: the executor's own (:data:`EXECUTORS`: ``address`` for ray;
    ``folder``, ``params``, ``local`` for slurm). Options and data directories are
    checked before any run starts. A diverged run is finished (rerunning it would
    diverge again) but counted apart.

    SIGINT or SIGTERM (from the main thread's handlers, :class:`SweepStop`) stops the
    sweep: running runs checkpoint and are counted ``interrupted``, queued runs do
    not start, and ``signal`` in the result names the signal (else None).
    """
    check_options(executor, workers, max_retries)
    run_set = check_run_set(run_set, runs[0].cfg) if runs else ()
    engine = make_executor(executor, workers, **options)
    check_data(runs)
    out = Path(out_dir)
    runs = adopt_earlier_runs(runs, out / "runs")
    claim_out(out, name, runs)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    workers = max(1, workers or 1)
    threads = max(1, cores // workers)
    todo, done, to_run = [], 0, {}
    for r in runs:
        state, attempts = run_state(out / "runs" / r.run_id, needs_eval=bool(eval_args))
        if state == "done":
            done += 1
        elif attempts <= max_retries:
            todo.append(Job(r.run_id, str(out / "runs" / r.run_id), r.cfg.to_yaml(), threads,
                            tuple(eval_args), run_set))
            to_run[r.run_id] = r
    costs = _estimated_seconds(to_run, out, workers)
    # the ETA weighs runs by their estimated seconds (a fixed cost plus FLOPs over a rate)
    bar = Progress(len(runs), "sweep", unit="done", initial=done, enabled=progress, every_s=0,
                   weights=costs, parallel=workers)
    outcomes: list[dict[str, Any]] = []
    with SweepStop().installed() as stop:
        for outcome in engine.submit(todo, bar, threads, stop):
            outcomes.append(outcome)
            _record(out / "runs" / outcome["run_id"], outcome, bool(eval_args), bar)
    bar.close()
    ran = [o for o in outcomes if o["status"] != "interrupted"]
    return {"total": len(runs), "skipped": done, "ran": len(ran),
            "failed": sum(o["status"] == "failed" for o in outcomes),
            "diverged": sum(o["status"] == "diverged" for o in outcomes),
            "interrupted": len(outcomes) - len(ran), "signal": stop.signum,
            "not_started": len(todo) - len(outcomes), "outcomes": outcomes}


def _record(run: Path, outcome: dict[str, Any], needs_eval: bool, bar: Progress) -> None:
    """Write what a run's outcome means into its directory: a failure is counted in
    ``failure.json``; a finished run loses an old one; an interrupted run is left
    as it is (pending: a rerun resumes it)."""
    if outcome["status"] == "interrupted":
        return
    if outcome["status"] == "failed":
        _, attempts = run_state(run, needs_eval=needs_eval)
        atomic_write_json(run / "failure.json", {**outcome, "attempts": attempts + 1})
    else:
        (run / "failure.json").unlink(missing_ok=True)
    bar.finished(outcome["run_id"], failed=outcome["status"] == "failed")


@dataclass(frozen=True)
class LocalExecutor:
    """Runs on this machine: a pool of ``workers`` `xmod train` subprocesses."""

    workers: int = 1

    def submit(
        self, jobs: list[Job], bar: Progress, threads: int, stop: SweepStop
    ) -> Iterable[dict[str, Any]]:
        return _run_local(jobs, bar, self.workers, stop)


@dataclass(frozen=True)
class RayExecutor:
    """One Ray task per run (``address``: an existing cluster; default a local one)."""

    address: str | None = None

    def submit(
        self, jobs: list[Job], bar: Progress, threads: int, stop: SweepStop
    ) -> Iterable[dict[str, Any]]:
        return _run_ray(jobs, bar, threads, self.address, stop)


@dataclass(frozen=True)
class SlurmExecutor:
    """One Slurm job per run through submitit. ``folder``: submitit's log folder
    (default OUT/slurm_logs); ``params``: submitit parameters (partition, gpus_per_node,
    timeout_min, ...); ``local``: submitit's local executor (for testing)."""

    folder: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    local: bool = False

    def submit(
        self, jobs: list[Job], bar: Progress, threads: int, stop: SweepStop
    ) -> Iterable[dict[str, Any]]:
        return _run_slurm(jobs, bar, self.folder, self.params, self.local, stop)


EXECUTORS: dict[str, type] = {"local": LocalExecutor, "ray": RayExecutor, "slurm": SlurmExecutor}
"""Executor name -> class: a new engine is one class with ``submit`` and its options."""


def make_executor(name: str, workers: int | None = None, **options: Any) -> Any:
    """The executor ``name`` with ``options`` (its dataclass fields); UserError on an
    unknown name or option. ``workers`` is the local executor's option."""
    if name not in EXECUTORS:
        raise UserError(f"executor {name!r} unknown; allowed: {', '.join(EXECUTORS)}")
    cls = EXECUTORS[name]
    known = {f.name for f in fields(cls)}
    if name == "local":
        options = {"workers": max(1, workers or 1), **options}
    if bad := sorted(set(options) - known):
        raise UserError(
            f"executor {name}: unknown option {bad[0]!r}; allowed: {', '.join(sorted(known)) or 'none'}"
        )
    return cls(**options)


def parse_executor_options(items: list[str]) -> dict[str, Any]:
    """``key=value`` strings (values read as YAML; ``params.k=v`` nests under params)."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"--executor-opt {item!r}: expected key=value, e.g. folder=logs")
        key, value = item.split("=", 1)
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            raise UserError(f"--executor-opt {item!r}: value is not valid YAML") from None
        if key.startswith("params."):
            out.setdefault("params", {})[key[len("params."):]] = parsed
        else:
            out[key] = parsed
    return out


def _run_local(
    jobs: list[Job], bar: Progress, workers: int, stop: SweepStop
) -> Iterable[dict[str, Any]]:
    """A thread pool of subprocess launchers: each worker runs one `xmod train` at a time.

    Jobs are handed to the pool one free worker at a time, so after ``stop`` no
    queued job is left in it to start.
    """
    queue = list(jobs)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: set[Future[dict[str, Any]]] = set()
        while queue or pending:
            while queue and len(pending) < workers and stop.signum is None:
                pending.add(pool.submit(run_job, queue.pop(0), stop))
            if not pending:
                break
            bar.set_running(len(pending))
            finished, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            for fut in finished:
                yield fut.result()


def _run_ray(
    jobs: list[Job], bar: Progress, threads: int, address: str | None, stop: SweepStop
) -> Iterable[dict[str, Any]]:
    """One Ray task per job. After ``stop`` every task left is cancelled (its child
    is sent SIGINT by :func:`_run_child` and waited for) and counted interrupted."""
    try:
        import ray
    except ImportError:
        raise UserError("executor 'ray' needs Ray: pip install 'xmod-lm[ray]'") from None
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    try:
        remote = ray.remote(num_cpus=threads)(run_job)
        ids = {remote.remote(j): j.run_id for j in jobs}
        refs = list(ids)
        while refs and stop.signum is None:
            ready, refs = ray.wait(refs, num_returns=1, timeout=1.0)
            bar.set_running(len(refs))
            for ref in ready:
                yield ray.get(ref)
        for ref in refs:
            ray.cancel(ref)
        if refs:
            ray.wait(refs, num_returns=len(refs))
        for ref in refs:
            yield {"run_id": ids[ref], "status": "interrupted", "returncode": None}
    finally:
        if started:
            ray.shutdown()


def _run_slurm(
    jobs: list[Job],
    bar: Progress,
    folder: str | None,
    params: dict[str, Any],
    local: bool,
    stop: SweepStop,
) -> Iterable[dict[str, Any]]:
    """One submitit job per run. After ``stop`` the jobs left are cancelled (Slurm
    sends them SIGTERM) and counted interrupted."""
    try:
        import submitit
    except ImportError:
        raise UserError("executor 'slurm' needs submitit: pip install 'xmod-lm[slurm]'") from None
    if not jobs:
        return
    log_dir = folder or str(Path(jobs[0].run_dir).parent.parent / "slurm_logs")
    ex = submitit.LocalExecutor(folder=log_dir) if local else submitit.AutoExecutor(folder=log_dir)
    ex.update_parameters(**({"timeout_min": 60 * 24} | params))
    submitted = [ex.submit(run_job, j) for j in jobs]
    while submitted and stop.signum is None:
        still = []
        for sj in submitted:
            if sj.done():
                try:
                    yield sj.result()
                except Exception as err:  # the job itself died (node failure, timeout)
                    run_id = Path(sj.submission().args[0].run_dir).name
                    yield {"run_id": run_id, "status": "failed", "error_tail": str(err)[-2000:]}
            else:
                still.append(sj)
        submitted = still
        bar.set_running(len(submitted))
        if submitted:
            time.sleep(1.0)
    for sj in submitted:
        sj.cancel(check=False)
        yield {"run_id": Path(sj.submission().args[0].run_dir).name, "status": "interrupted",
               "returncode": None}
