"""Running a sweep: resumable, retrying, on an existing engine.

Each run is one ``xmod train`` subprocess with its own run directory
``OUT/runs/<id>``, so a run is resumed exactly as a single training run is, and
one failing run never takes the others down. The state of a run is read from
its directory, never kept elsewhere:

* ``summary.json`` with status ``ok`` (or ``diverged``): finished, skipped;
* ``failure.json``: failed ``attempts`` times; retried until ``max_retries``;
* anything else: pending, or interrupted (then ``xmod train`` resumes it).

Executors hand runs to an engine and do no scheduling of their own:

* ``local``: a process pool on this machine, cores shared between workers;
* ``ray``: one Ray task per run (``ray.init(address=...)``: a cluster or a local
  instance);
* ``slurm``: one Slurm job per run through submitit (``LocalExecutor`` for tests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xmodlm.errors import UserError
from xmodlm.fileio import atomic_write_json, atomic_write_text
from xmodlm.record import EVAL_FILE
from xmodlm.sweep.spec import RunSpec

if TYPE_CHECKING:
    from xmodlm.config import Config

ERROR_TAIL_LINES = 20

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
    (rather than found missing by every run in turn)."""
    from xmodlm.data.batches import load_split

    for data_dir in sorted({r.cfg.data.dir for r in runs}):
        for split in ("train", "val"):
            load_split(data_dir, split)


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


def run_job(job: Job) -> dict[str, Any]:
    """Train one run in a subprocess, then evaluate its final checkpoint if asked;
    return its outcome (never raises for run errors). A run already trained is only
    evaluated (a sweep resumed after its evaluation was added, or had failed)."""
    run = Path(job.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    cfg_path = run / "sweep_config.yaml"
    atomic_write_text(cfg_path, job.config_yaml)
    env = {**os.environ, "OMP_NUM_THREADS": str(job.threads)}
    log_path = run / "train.log"
    t0 = time.time()
    outcome: dict[str, Any] = {"run_id": job.run_id, "returncode": 0}
    if _trained_status(run) != "ok":
        cmd = [sys.executable, "-m", "xmodlm", "train", str(cfg_path), "--out", str(run), "--quiet",
               *(arg for item in job.run_set for arg in ("--set", item))]
        with open(log_path, "a") as log:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        outcome["returncode"] = proc.returncode
        status = _trained_status(run)
        if proc.returncode not in (0, 1) or status is None:
            return _failed({**outcome, "wall_s": time.time() - t0}, log_path)
    outcome["status"] = _trained_status(run)
    if job.eval_args and outcome["status"] == "ok" and not (run / EVAL_FILE).is_file():
        cmd = [sys.executable, "-m", "xmodlm", "eval", str(run), "--json", "--quiet",
               *job.eval_args]
        with open(log_path, "a") as log:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, env=env, text=True)
        if proc.returncode != 0:
            return _failed({**outcome, "returncode": proc.returncode,
                            "wall_s": time.time() - t0}, log_path)
        atomic_write_text(run / EVAL_FILE, proc.stdout)
    outcome["wall_s"] = time.time() - t0
    return outcome


def check_run_set(items: Sequence[str], cfg: Config) -> tuple[str, ...]:
    """The ``--run-set`` overrides, checked: settings of how runs execute, not of
    what they train.

    A run's id hashes its configuration, so changing any setting in the spec
    makes new runs. The train settings that a resumed run may change freely
    (:data:`xmodlm.train.trainer.RESUME_FREE`: device, compile, logging and
    checkpoint cadence, trackers) do not change what is trained; these may be set
    per invocation instead, passed to every run's ``xmod train`` (``--set``), so
    that a committed sweep can be resumed compiled, or on a GPU, under the same
    ids. Each value is checked on ``cfg`` (one of the sweep's run configs).
    """
    from xmodlm.train.trainer import RESUME_FREE

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


class Progress:
    """A one-line live display: done / running / failed and an ETA.

    The ETA weighs runs by their compute budgets (``costs``: FLOPs of each run
    to do): a sweep's runs differ by tiers several times apart, so counting runs
    would misjudge the time left by as much. It is the time so far times the
    FLOPs left over the FLOPs finished in this invocation.
    """

    def __init__(
        self, total: int, done: int, enabled: bool = True, costs: dict[str, float] | None = None,
    ) -> None:
        self.total, self.done, self.failed, self.running = total, done, 0, 0
        self.enabled = enabled
        self.t0 = time.time()
        self.costs = dict(costs or {})
        self.cost_left = sum(self.costs.values())
        self.cost_done = 0.0
        # on a terminal the line redraws in place; piped to a log, a plain line is
        # written only when the counts change (not every few seconds)
        self.live = sys.stderr.isatty()
        self.shown: tuple[int, int, int] | None = None

    def update(self, running: int) -> None:
        self.running = running
        counts = (self.done, self.running, self.failed)
        if not self.enabled or (not self.live and counts == self.shown):
            return
        self.shown = counts
        elapsed = time.time() - self.t0
        eta = elapsed * self.cost_left / self.cost_done if self.cost_done > 0 else float("nan")
        eta_s = "?" if eta != eta else f"{eta / 60:.1f} min"
        line = (f"sweep: {self.done}/{self.total} done, {self.running} running,"
                f" {self.failed} failed, ETA {eta_s}")
        sys.stderr.write(f"\r{line}   " if self.live else f"{line}\n")
        sys.stderr.flush()

    def finished(self, run_id: str, failed: bool) -> None:
        """Count a run that ended here (done or failed) and show the new counts."""
        if failed:
            self.failed += 1
        else:
            self.done += 1
        cost = self.costs.pop(run_id, 0.0)
        self.cost_left -= cost
        self.cost_done += cost
        self.update(self.running)

    def close(self) -> None:
        if self.enabled and self.live:
            sys.stderr.write("\n")


def run_sweep(
    runs: list[RunSpec],
    out_dir: str | Path,
    executor: str = "local",
    workers: int | None = None,
    max_retries: int = 2,
    progress: bool = True,
    eval_args: tuple[str, ...] = (),
    run_set: Sequence[str] = (),
    **options: Any,
) -> dict[str, Any]:
    """Run every unfinished run of a sweep; return counts and each run's outcome.

    ``eval_args``: ``xmod eval`` options (:func:`xmodlm.sweep.spec.eval_args`); each
    run's final checkpoint is then evaluated right after training, into
    ``RUN/eval.json``, while the checkpoint is on this machine. ``run_set``:
    overrides of how the runs execute (:func:`check_run_set`), ids unchanged.

    ``options``: the executor's own (:data:`EXECUTORS`: ``address`` for ray;
    ``folder``, ``params``, ``local`` for slurm). Options and data directories are
    checked before any run starts. A diverged run is finished (rerunning it would
    diverge again) but counted apart.
    """
    check_options(executor, workers, max_retries)
    run_set = check_run_set(run_set, runs[0].cfg) if runs else ()
    engine = make_executor(executor, workers, **options)
    check_data(runs)
    out = Path(out_dir)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    workers = max(1, workers or 1)
    threads = max(1, cores // workers)
    todo, done, costs = [], 0, {}
    runs = adopt_earlier_runs(runs, out / "runs")
    for r in runs:
        state, attempts = run_state(out / "runs" / r.run_id, needs_eval=bool(eval_args))
        if state == "done":
            done += 1
        elif attempts <= max_retries:
            todo.append(Job(r.run_id, str(out / "runs" / r.run_id), r.cfg.to_yaml(), threads,
                            tuple(eval_args), run_set))
            costs[r.run_id] = float(r.compute)
    bar = Progress(len(runs), done, enabled=progress, costs=costs)
    outcomes: list[dict[str, Any]] = []
    for outcome in engine.submit(todo, bar, threads):
        outcomes.append(outcome)
        run = out / "runs" / outcome["run_id"]
        if outcome["status"] == "failed":
            _, attempts = run_state(run, needs_eval=bool(eval_args))
            atomic_write_json(run / "failure.json", {**outcome, "attempts": attempts + 1})
        else:
            (run / "failure.json").unlink(missing_ok=True)
        bar.finished(outcome["run_id"], failed=outcome["status"] == "failed")
    bar.close()
    return {"total": len(runs), "skipped": done, "ran": len(outcomes),
            "failed": sum(o["status"] == "failed" for o in outcomes),
            "diverged": sum(o["status"] == "diverged" for o in outcomes), "outcomes": outcomes}


Submit = Callable[[list[Job], Progress], Iterable[dict[str, Any]]]


@dataclass(frozen=True)
class LocalExecutor:
    """Runs on this machine: a pool of ``workers`` `xmod train` subprocesses."""

    workers: int = 1

    def submit(self, jobs: list[Job], bar: Progress, threads: int) -> Iterable[dict[str, Any]]:
        return _run_local(jobs, bar, self.workers)


@dataclass(frozen=True)
class RayExecutor:
    """One Ray task per run (``address``: an existing cluster; default a local one)."""

    address: str | None = None

    def submit(self, jobs: list[Job], bar: Progress, threads: int) -> Iterable[dict[str, Any]]:
        return _run_ray(jobs, bar, threads, self.address)


@dataclass(frozen=True)
class SlurmExecutor:
    """One Slurm job per run through submitit. ``folder``: submitit's log folder
    (default OUT/slurm_logs); ``params``: submitit parameters (partition, gpus_per_node,
    timeout_min, ...); ``local``: submitit's local executor (for testing)."""

    folder: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    local: bool = False

    def submit(self, jobs: list[Job], bar: Progress, threads: int) -> Iterable[dict[str, Any]]:
        return _run_slurm(jobs, bar, self.folder, self.params, self.local)


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


def _run_local(jobs: list[Job], bar: Progress, workers: int) -> Iterable[dict[str, Any]]:
    """A thread pool of subprocess launchers: each worker runs one `xmod train` at a time."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: set[Future[dict[str, Any]]] = {pool.submit(run_job, j) for j in jobs}
        bar.update(min(workers, len(pending)))
        while pending:
            finished, pending = wait(pending, timeout=2.0, return_when=FIRST_COMPLETED)
            bar.update(min(workers, len(pending)))
            for fut in finished:
                yield fut.result()


def _run_ray(
    jobs: list[Job], bar: Progress, threads: int, address: str | None
) -> Iterable[dict[str, Any]]:
    try:
        import ray
    except ImportError:
        raise UserError("executor 'ray' needs Ray: pip install 'xmod-lm[ray]'") from None
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    try:
        remote = ray.remote(num_cpus=threads)(run_job)
        refs = [remote.remote(j) for j in jobs]
        while refs:
            ready, refs = ray.wait(refs, num_returns=1, timeout=2.0)
            bar.update(len(refs))
            for ref in ready:
                yield ray.get(ref)
    finally:
        if started:
            ray.shutdown()


def _run_slurm(
    jobs: list[Job],
    bar: Progress,
    folder: str | None,
    params: dict[str, Any],
    local: bool,
) -> Iterable[dict[str, Any]]:
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
    while submitted:
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
        bar.update(len(submitted))
        if submitted:
            time.sleep(1.0)
