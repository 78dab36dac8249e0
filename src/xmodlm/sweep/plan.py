"""Sweep planning: what ``xmod sweep --dry-run`` shows before anything trains.

One row per expanded run (its config columns and counts, :meth:`RunSpec.row`),
the epochs it would read of the training split, and an estimate of its seconds,
from the measured matmul peak or, better, from the runs a sweep folder has
already finished. Kept in the sweep package, beside the spec and the estimate it
reads, so that the CLI only prints it and a user can call it from Python.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from xmodlm.errors import UserError
from xmodlm.sweep.estimate import DEFAULT_FIXED_S, estimate_seconds, measured_rate
from xmodlm.sweep.runner import run_state
from xmodlm.sweep.spec import RunSpec


def train_tokens(runs: list[RunSpec]) -> int | None:
    """Tokens in the training split the runs read (the first run's data directory),
    or None where it is not prepared yet."""
    from xmodlm.data.batches import load_manifest

    if not runs:
        return None
    try:
        return int(load_manifest(runs[0].cfg.data.dir)["splits"]["train"]["tokens"])
    except (UserError, OSError, KeyError, ValueError, TypeError):
        return None


def dry_run(
    runs: list[RunSpec], figures: list[dict[str, Any]], workers: int, out: str | Path,
    rate_from: str | Path | None = None, needs_eval: bool = False,
) -> str:
    """The plan as text: the table of runs and a line with the estimate of what is
    left (a resumed sweep's finished runs are marked ``done`` and cost nothing;
    ``needs_eval``: a run is finished once its evaluation is written too).

    ``figures``: each run's :func:`~xmodlm.sweep.spec.check_requirements` figures
    (its epochs). The rate comes from the finished runs of ``rate_from``, else of
    ``out`` where that folder exists (a sweep being resumed), else from the matmul
    peak; an explicit ``rate_from`` without finished runs is an error.
    """
    import pandas as pd

    table = pd.DataFrame([r.row() for r in runs])
    table["epochs"] = [f["max_epochs"] for f in figures]
    source = rate_from or (out if Path(out).is_dir() else None)
    measured = None if source is None else measured_rate(source)
    if rate_from and measured is None:
        raise UserError(f"--rate-from {rate_from}: no finished runs (runs/*/summary.json)")
    table["est_s"] = estimate_seconds(
        runs, workers=workers, rate=None if measured is None else measured.rate,
        fixed_s=None if measured is None else measured.fixed_s,
    )
    table["done"] = [run_state(Path(out) / "runs" / r.run_id, needs_eval)[0] == "done"
                     for r in runs]
    fmt = {"capacity": "{:.4g}".format, "params_active": "{:.4g}".format,
           "flops_per_token": "{:.4g}".format, "tokens": "{:.4g}".format,
           "compute": "{:.3g}".format, "est_s": "{:.0f}".format,
           "head_frac": "{:.2f}".format, "sparsity": "{:g}".format,
           "anchor_stride": "{:.4g}".format, "lr": "{:.3g}".format,
           "tokens_per_param": "{:.1f}".format,
           "epochs": lambda v: "?" if v is None or v != v else f"{v:.2f}",
           "done": lambda v: "done" if v else "-"}
    how = ("from the measured matmul peak; rough" if measured is None else
           f"from {measured.rate:.3g} FLOP/s a run, measured by {measured.runs} finished"
           f" runs in {source}")
    fixed = (f"{DEFAULT_FIXED_S:.0f} s a run to start and evaluate (assumed)"
             if measured is None or measured.fixed_s is None else
             f"{measured.fixed_s:.1f} s a run to start and evaluate (measured)")
    done = int(table["done"].sum())
    left = table.loc[~table["done"], "est_s"].sum() / 60 / workers
    count = (f"{len(table)} runs" if not done else
             f"{len(table)} runs, {done} done; the {len(table) - done} left")
    return (table.to_string(index=False, formatters=fmt) + "\n"
            + f"{count} estimated {left:.0f} min with {workers} worker(s) ({how}; {fixed})")


def plan_table(runs: list[RunSpec]) -> Any:
    """The planned runs as results-table rows without outcomes: each run's id, its
    record columns (:func:`xmodlm.record.config_row`), seed, optimiser, peak rate,
    compute and the tokens and steps it buys. What ``xmod law predict`` reads, so a
    prediction can be made, and committed, for runs before they start."""
    import pandas as pd

    from xmodlm import flops, record

    rows = []
    for run in runs:
        m, t = run.cfg.model, run.cfg.train
        counts = flops.count(m)
        rows.append({"run_id": run.run_id, **record.config_row(m, counts), "seed": t.seed,
                     "optimizer": t.optimizer, "lr": t.lr, "compute": run.compute,
                     "tokens": run.compute / counts.flops_train, "steps": run.steps})
    return pd.DataFrame(rows)
