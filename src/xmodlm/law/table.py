"""Results tables: read run records (CSV or Parquet) and validate them.

A full run record has the columns in ``RUN_COLUMNS`` (what ``xmod sweep`` writes).
A dense-only fit needs only ``params_active, tokens, val_loss``; missing columns
default to a dense run (stride 1, capacity 1) at one unrecorded context (0), and
compute to flops_per_token x tokens, or 6 N D without a FLOP column.

Validation is strict because a scaling law fitted to a bad row is silently
wrong: every problem a user can cause is a :class:`UserError` naming the column
or the row (rows are the table's 0-based data rows). Unfinished runs are not an
error; they are dropped and counted.

Derived columns added to the frame:

* ``is_sparse``: stride > 1 and capacity < 1 (anything else is dense in effect);
* ``rho``: the sparse expansion ratio L / L_active with L_active = L/S + c L (S-1)/S,
  which simplifies to S / (1 + c (S - 1)), so depth itself is not needed;
* ``tier``: the compute tier, log10(C) rounded to the nearest quarter decade, so a
  sweep's budgets (1e15, 3e15, 1e16 ...) group together despite small drift.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from xmodlm.errors import UserError

RUN_COLUMNS = (
    "family",
    "width",
    "n_layers",
    "stride",
    "capacity",
    "context",
    "gating",
    "balance_coef",
    "params_total",
    "params_active",
    "flops_per_token",
    "tokens",
    "compute",
    "seed",
    "val_loss",
    "val_bpb",
    "status",
)
FINISHED = ("ok", "done")
UNRECORDED_CONTEXT = 0
_POSITIVE = ("val_loss", "params_active", "tokens")


@dataclass(frozen=True)
class Runs:
    """Validated runs: the frame plus what was left out and why."""

    frame: pd.DataFrame
    dropped_unfinished: int = 0
    excluded_moe: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def dense(self) -> pd.DataFrame:
        return self.frame[~self.frame["is_sparse"]]

    @property
    def sparse(self) -> pd.DataFrame:
        return self.frame[self.frame["is_sparse"]]


def read_table(path: str | Path) -> pd.DataFrame:
    """Read a CSV (``.csv``, ``.tsv``) or Parquet (``.parquet``, ``.pq``) table."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"results table {str(path)!r} not found")
    suffix = path.suffix.lower()
    try:
        if suffix in (".parquet", ".pq"):
            return pd.read_parquet(path)
        if suffix in (".csv", ".tsv"):
            return pd.read_csv(path, sep="\t" if suffix == ".tsv" else ",")
    except (ValueError, OSError, pd.errors.ParserError) as err:
        raise UserError(
            f"results table {str(path)!r} is not readable: {err}".splitlines()[0]
        ) from None
    raise UserError(f"results table {str(path)!r}: expected a .csv, .tsv, .parquet or .pq file")


def finished_runs(df: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """The rows whose ``status`` says finished (all rows without the column), and how many not."""
    if "status" not in df.columns:
        return df, 0
    done = df["status"].astype(str).str.strip().str.lower().isin(FINISHED)
    return df[done], int((~done).sum())


def validate(df: pd.DataFrame, need_loss: bool = True) -> Runs:
    """Check a run table and fill defaults; ``need_loss=False`` for prediction inputs."""
    required = ("params_active", "tokens", "val_loss") if need_loss else ("params_active", "tokens")
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise UserError(
            f"table is missing column(s) {', '.join(missing)}; it needs at least {', '.join(required)}"
        )
    frame = df.reset_index(drop=True)
    raw = frame.copy()  # original cells, for error messages about text that is not a number
    dropped = 0
    if need_loss:
        frame, dropped = finished_runs(frame)
    moe = (
        frame["family"].astype(str).str.strip().str.lower().eq("moe") if "family" in frame else None
    )
    excluded = 0
    if moe is not None and moe.any():
        if not need_loss:
            raise UserError(f"row {moe.idxmax()}: family moe is outside the sparse-depth law")
        excluded = int(moe.sum())
        frame = frame[~moe]
    if frame.empty:
        raise UserError(
            f"table has no usable runs ({dropped} not finished with status ok/done,"
            f" {excluded} MoE); the law needs finished dense runs"
        )
    for col in _POSITIVE if need_loss else _POSITIVE[1:]:
        frame[col] = _numbers(frame, col)
        _require(frame, raw, col, frame[col] > 0, "a positive finite number")
    notes = []
    for col, default in (("stride", 1), ("capacity", 1.0)):
        frame[col] = _numbers(frame, col) if col in frame else default
    stride, capacity = frame["stride"], frame["capacity"]
    _require(frame, raw, "stride", (stride >= 1) & (stride % 1 == 0), "an integer >= 1")
    _require(frame, raw, "capacity", (capacity > 0) & (capacity <= 1), "in (0, 1]")
    frame["stride"] = frame["stride"].astype(int)
    frame["is_sparse"] = (frame["stride"] > 1) & (frame["capacity"] < 1)
    frame["rho"] = frame["stride"] / (1 + frame["capacity"] * (frame["stride"] - 1))
    if "context" in frame:
        frame["context"] = _numbers(frame, "context")
        context = frame["context"]
        _require(frame, raw, "context", (context > 0) & (context % 1 == 0), "an integer >= 1")
        frame["context"] = frame["context"].astype(int)
    elif frame["is_sparse"].any():
        raise UserError(
            "table has X-MoD runs (stride > 1, capacity < 1) but no context column;"
            " the delta law needs each run's context length"
        )
    else:
        frame["context"] = UNRECORDED_CONTEXT
        notes.append("no context column: all runs treated as one (unrecorded) context")
    _fill_compute(frame, raw, notes)
    frame["tier"] = np.round(4 * np.log10(frame["compute"])) / 4
    if "family" not in frame:
        frame["family"] = np.where(frame["is_sparse"], "xmod", "dense")
    for col in ("gating", "balance_coef"):
        if col in frame and frame.loc[frame["is_sparse"], col].nunique() > 1:
            values = ", ".join(map(str, sorted(frame.loc[frame["is_sparse"], col].unique())))
            notes.append(f"X-MoD runs mix {col} values ({values}); the delta law pools them")
    return Runs(frame, dropped, excluded, notes)


def load_runs(path: str | Path) -> Runs:
    """Read and validate a results table in one step (what ``xmod law fit`` does)."""
    return validate(read_table(path))


def _numbers(frame: pd.DataFrame, col: str) -> pd.Series:
    """The column as floats; text that is not a number becomes NaN and fails the checks."""
    return pd.to_numeric(frame[col], errors="coerce").astype(float)


def _require(frame: pd.DataFrame, raw: pd.DataFrame, col: str, ok: pd.Series, what: str) -> None:
    """Fail on the first row where ``ok`` is false or the value is not finite."""
    bad = ~(ok & np.isfinite(frame[col]))
    if bad.any():
        row = bad.idxmax()
        value = raw.at[row, col] if col in raw else frame.at[row, col]
        shown = repr(value) if isinstance(value, str) else str(value)
        raise UserError(f"row {row}: {col}={shown} must be {what}")


def _fill_compute(frame: pd.DataFrame, raw: pd.DataFrame, notes: list[str]) -> None:
    """Training compute C per run: recorded, else F_token x D, else 6 N D."""
    if "flops_per_token" in frame:
        fallback = _numbers(frame, "flops_per_token") * frame["tokens"]
        how = "flops_per_token x tokens"
    else:
        fallback = 6.0 * frame["params_active"] * frame["tokens"]
        how = "6 x params_active x tokens"
    recorded = _numbers(frame, "compute") if "compute" in frame else pd.Series(np.nan, frame.index)
    gaps = ~(recorded > 0)
    if gaps.any():
        notes.append(f"compute missing for {int(gaps.sum())} run(s): taken as {how}")
    frame["compute"] = recorded.where(~gaps, fallback)
    _require(
        frame, raw, "compute", frame["compute"] > 0, "a positive number (or give flops_per_token)"
    )
