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

Each run is a :mod:`~xmodlm.sweep.job`, handed to an engine by one of the
:mod:`~xmodlm.sweep.executors`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xmodlm.errors import UserError
from xmodlm.fileio import atomic_write_json
from xmodlm.folders import SWEEP_FILE
from xmodlm.progress import Progress
from xmodlm.record import EVAL_FILE
from xmodlm.sweep.executors import check_options, make_executor
from xmodlm.sweep.job import Job, SweepStop, trained_status
from xmodlm.sweep.spec import RunSpec

if TYPE_CHECKING:
    from xmodlm.config import Config



def check_data(runs: list[RunSpec]) -> None:
    """Each distinct data directory of the runs, checked once before any run starts
    (rather than found missing by every run in turn), and every run against its
    data: a vocabulary other than the data's, or a context longer than a split holds,
    would fail run after run, each only in its own log."""
    from xmodlm.data.batches import load_manifest, load_split

    for data_dir in sorted({r.cfg.data.dir for r in runs}):
        vocab = load_manifest(data_dir)["vocab_size"]
        splits = {split: load_split(data_dir, split) for split in ("train", "val")}
        mine = [r for r in runs if r.cfg.data.dir == data_dir]
        if other := [r for r in mine if r.cfg.model.vocab_size != vocab]:
            raise UserError(
                f"sweep spec: run {other[0].run_id} has model.vocab_size"
                f" {other[0].cfg.model.vocab_size}, not the vocabulary of {vocab} of {data_dir}"
                f" ({len(other)} run(s)), which training requires: set model.vocab_size={vocab}"
            )
        longest = max(mine, key=lambda r: r.cfg.model.context)
        for data in splits.values():
            try:
                data.check_context(longest.cfg.model.context)
            except UserError as err:
                raise UserError(f"sweep spec: run {longest.run_id} of {data_dir}: {err}") from None


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


def check_source_tree(allow_dirty: bool) -> None:
    """Refuse to start runs from a source tree whose tracked files differ from its
    commit, unless ``allow_dirty``. A run records the commit it ran
    (:func:`xmodlm.hardware.git_state`; ``<sha>-dirty`` for such a tree), and a
    result whose code no commit holds cannot be rerun or checked. Nothing to refuse
    where the package is not a git checkout."""
    from xmodlm.hardware import git_state

    state = None if allow_dirty else git_state()
    if state is not None and state.dirty:
        raise UserError(
            f"the source tree {state.root} has uncommitted changes to tracked files, so no"
            f" commit holds the code these runs would train: commit them, or pass --allow-dirty"
            f" (each run then records its commit as {state.commit[:12]}-dirty)"
        )


def run_state(run_dir: Path, needs_eval: bool = False) -> tuple[str, int]:
    """(state, failed attempts) of a run directory: done | failed | pending. With
    ``needs_eval``, a trained run is done once its evaluation is written too."""
    status = trained_status(run_dir) if (run_dir / "summary.json").is_file() else None
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
    """Each run's estimated wall time (:func:`xmodlm.sweep.estimate.estimate_seconds`: a
    fixed cost plus its FLOPs over a rate), measured by this sweep's finished runs
    where there are some."""
    from xmodlm.sweep.estimate import estimate_seconds, measured_rate

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
    allow_dirty: bool = True,
    **options: Any,
) -> dict[str, Any]:
    """Run every unfinished run of a sweep; return counts and each run's outcome.

    ``allow_dirty=False`` (what ``xmod sweep`` passes unless told otherwise): refuse
    to start from a source tree with uncommitted changes (:func:`check_source_tree`).

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
    check_source_tree(allow_dirty)
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
