"""The results table: one row per finished run, in the run-record schema the law reads.

Rows come from each run's ``summary.json``. Runs that are unfinished, failed or
whose summary is unreadable or incomplete are *reported* and left out, never
silently used.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from xmodlm.errors import UserError
from xmodlm.train.checkpoint import atomic_write_text

COLUMNS = [
    "family", "width", "n_layers", "stride", "capacity", "context", "gating", "balance_coef",
    "params_total", "params_active", "flops_per_token", "tokens", "compute", "seed",
    "val_loss", "val_bpb", "status",
]
EXTRA = [
    "run_id", "val_loss_causal", "routing_agreement", "wall_s",
    "steps", "batch_tokens", "lr", "warmup_steps", "epochs", "layout", "commit",
]


def _row(run_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    path = run_dir / "summary.json"
    if not path.is_file():
        failed = (run_dir / "failure.json").is_file()
        return None, "failed" if failed else "unfinished"
    try:
        s = json.loads(path.read_text())
    except ValueError:
        return None, "corrupt summary.json"
    needed = ["final_val_loss", "tokens", "flops_per_token", "params_active", "status"]
    if any(s.get(k) is None for k in needed):
        return None, "incomplete summary.json"
    if not math.isfinite(float(s["final_val_loss"])):
        return None, "non-finite loss"
    row = {
        "family": s["family"], "width": s["width"], "n_layers": s["n_layers"],
        "stride": s["stride"], "capacity": s["capacity"], "context": s["context"],
        "gating": s["gating"], "balance_coef": s["balance_coef"],
        "params_total": s["params_total"], "params_active": s["params_active"],
        "flops_per_token": s["flops_per_token"], "tokens": s["tokens"],
        "compute": s["flops_per_token"] * s["tokens"], "seed": s["seed"],
        "val_loss": s["final_val_loss"], "val_bpb": s["val_bpb"], "status": s["status"],
        "run_id": run_dir.name, "val_loss_causal": s.get("final_val_loss_causal"),
        "routing_agreement": s.get("routing_agreement"), "wall_s": s.get("wall_s"),
        **{k: s.get(k) for k in ("steps", "batch_tokens", "lr", "warmup_steps", "epochs",
                                 "layout", "commit")},
    }
    return row, None


def collect_results(sweep_dir: str | Path) -> tuple[pd.DataFrame, dict[str, str]]:
    """(table of finished runs, {run_id: why it was left out})."""
    root = Path(sweep_dir)
    runs_root = root / "runs" if (root / "runs").is_dir() else root
    if not runs_root.is_dir():
        raise UserError(f"sweep directory {str(root)!r} not found")
    rows, left_out = [], {}
    for run_dir in sorted(p for p in runs_root.iterdir() if p.is_dir()):
        row, why = _row(run_dir)
        if row is None:
            left_out[run_dir.name] = str(why)
        else:
            rows.append(row)
    return pd.DataFrame(rows, columns=COLUMNS + EXTRA), left_out


def write_results(sweep_dir: str | Path, out: str | Path | None = None) -> tuple[Path, int, dict]:
    """Write ``results.csv`` (atomically) and return (path, rows, left-out runs)."""
    table, left_out = collect_results(sweep_dir)
    path = Path(out) if out else Path(sweep_dir) / "results.csv"
    atomic_write_text(path, table.to_csv(index=False))
    return path, len(table), left_out
