"""Executors: each hands a sweep's jobs to an engine and does no scheduling of its own.

* ``local``: a process pool on this machine, cores shared between workers;
* ``ray``: one Ray task per run (``ray.init(address=...)``: a cluster or a local
  instance);
* ``slurm``: one Slurm job per run through submitit (``LocalExecutor`` for tests).

A new engine is one class with ``submit`` and its options in :data:`EXECUTORS`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from xmodlm.errors import UserError
from xmodlm.progress import Progress
from xmodlm.sweep.job import Job, SweepStop, run_job


def check_options(executor: str, workers: int | None, max_retries: int) -> None:
    """Options of a sweep, checked before any run starts."""
    if executor not in EXECUTORS:
        raise UserError(f"executor {executor!r} unknown; allowed: {', '.join(EXECUTORS)}")
    if workers is not None and workers < 1:
        raise UserError(f"--workers {workers}: must be >= 1 (concurrent runs)")
    if max_retries < 0:
        raise UserError(f"--max-retries {max_retries}: must be >= 0")


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
    from xmodlm.typed import load_yaml

    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"--executor-opt {item!r}: expected key=value, e.g. folder=logs")
        key, value = item.split("=", 1)
        parsed = load_yaml(value, f"--executor-opt {item!r}: value")
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
