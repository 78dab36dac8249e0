"""The results table: one row per finished, diverged or failed run, in the run-record
schema the law reads.

Rows come from each run's ``summary.json``; a failed run (``failure.json``, no
summary) is a row built from its configuration with status ``failed`` and the
tail of its error in ``error``; a diverged run is a row with status
``diverged``. The law reads only rows whose status says finished (``ok``), so
those rows are records, never data. Runs that are unfinished, or whose summary
is unreadable, are *reported* and left out, never silently used.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from xmodlm import record
from xmodlm.errors import UserError
from xmodlm.fileio import atomic_write_text
from xmodlm.folders import KINDS, SWEEP_RUNS, folder_kind

COLUMNS = list(record.RUN_COLUMNS)
EXTRA = list(record.EXTRA_COLUMNS) + list(record.EVAL_COLUMNS)
ERROR_LINES = 3  # lines of a failed run's error tail kept in the ``error`` column


def _config_row(run_dir: Path) -> dict[str, Any]:
    """The configuration columns of a run without a summary (it failed before writing one)."""
    from xmodlm import flops
    from xmodlm.config import load_config

    for name in ("config.yaml", "sweep_config.yaml"):
        path = run_dir / name
        if not path.is_file():
            continue
        try:
            cfg = load_config(path)
        except (UserError, OSError):
            continue
        return {
            **record.config_row(cfg.model, flops.count(cfg.model)),
            "compute": cfg.train.compute or None, "seed": cfg.train.seed, "lr": cfg.train.lr,
            "warmup_steps": cfg.train.warmup_steps, "compile_setting": cfg.train.compile,
            "optimizer": cfg.train.optimizer,
        }
    return {}


def _recorded_before(run_dir: Path) -> dict[str, Any]:
    """CPU kind, compile mode and optimiser of a run whose summary predates them: the
    CPU's model name from ``env.json`` (marked: its kind was not recorded), the
    compile mode its config resolves to on that machine, and its config's optimiser."""
    out: dict[str, Any] = {}
    try:
        env = json.loads((run_dir / "env.json").read_text())
    except (OSError, ValueError):
        env = {}
    if isinstance(env, dict) and env.get("cpu"):
        out["cpu_kind"] = env.get("cpu_kind") or f"{env['cpu']} (kind not recorded)"
    row = _config_row(run_dir)
    if "optimizer" in row:
        out["optimizer"] = row["optimizer"]
    if "compile_setting" in row:
        on_gpu = isinstance(env, dict) and bool(env.get("cuda"))
        out["compile"] = "on" if row["compile_setting"] == "on" or (
            row["compile_setting"] == "auto" and on_gpu) else "off"
    return out


def _failed_row(run_dir: Path) -> dict[str, Any]:
    try:
        failure = json.loads((run_dir / "failure.json").read_text())
        tail = str(failure.get("error_tail", "")) if isinstance(failure, dict) else ""
    except (OSError, ValueError):
        tail = "failure.json unreadable"
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    error = " | ".join(lines[-ERROR_LINES:]) or "failed (no error output)"
    return {**_config_row(run_dir), "status": "failed", "run_id": run_dir.name, "error": error}


def _row(run_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    path = run_dir / "summary.json"
    if not path.is_file():
        if (run_dir / "failure.json").is_file():
            return _failed_row(run_dir), None
        return None, "unfinished"
    try:
        s = json.loads(path.read_text())
    except ValueError:
        return None, "corrupt summary.json"
    if not isinstance(s, dict):
        return None, "corrupt summary.json"
    loss = s.get("final_val_loss")
    diverged = s.get("status") == "diverged" or (
        isinstance(loss, (int, float)) and not math.isfinite(loss)
    )
    needed = ["tokens", "flops_per_token", "params_active", "status", "family"]
    numbers = [s.get(k) for k in ("tokens", "flops_per_token")]
    if (any(s.get(k) is None for k in needed) or (not diverged and loss is None)
            or not all(isinstance(v, (int, float)) for v in numbers)):
        return None, "incomplete summary.json"
    row = record.row_from_summary(s, run_dir.name)
    if any(row.get(k) is None for k in ("cpu_kind", "compile", "optimizer")):
        row.update({k: v for k, v in _recorded_before(run_dir).items() if row.get(k) is None})
    evaluated = run_dir / record.EVAL_FILE
    if evaluated.is_file():
        try:
            row.update(record.eval_columns(json.loads(evaluated.read_text())))
        except (ValueError, AttributeError):
            return None, f"corrupt {record.EVAL_FILE}"
    return row, None


def collect_results(sweep_dir: str | Path) -> tuple[pd.DataFrame, dict[str, str]]:
    """(table of finished, diverged and failed runs, {run_id: why it was left out})."""
    root = Path(sweep_dir)
    if not root.is_dir():
        raise UserError(f"sweep directory {str(root)!r} not found")
    kind = folder_kind(root)
    if kind != "sweep":
        what = f"holds {KINDS[kind]}" if kind else "holds no runs/ folder"
        raise UserError(f"{str(root)!r} is not a sweep folder: it {what}")
    runs_root = root / SWEEP_RUNS
    rows, left_out = [], {}
    found = runs_root.iterdir() if runs_root.is_dir() else ()  # sweep.json, no run yet
    for run_dir in sorted(p for p in found if p.is_dir()):
        row, why = _row(run_dir)
        if row is None:
            left_out[run_dir.name] = str(why)
        else:
            rows.append(row)
    tasks = sorted({k for row in rows for k in row if k.startswith("task_")})
    return pd.DataFrame(rows, columns=COLUMNS + EXTRA + tasks), left_out


def write_results(sweep_dir: str | Path, out: str | Path | None = None) -> tuple[Path, int, dict]:
    """Write ``results.csv`` (atomically) and return (path, rows, left-out runs)."""
    table, left_out = collect_results(sweep_dir)
    path = Path(out) if out else Path(sweep_dir) / "results.csv"
    atomic_write_text(path, table.to_csv(index=False))
    return path, len(table), left_out
