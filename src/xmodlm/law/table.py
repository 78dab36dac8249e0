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

* ``is_sparse``: some block routes (:func:`xmodlm.record.is_sparse`: the recorded
  layout has an ``s``; without one, stride > 1 and capacity < 1);
* ``rho``: the sparse expansion ratio L / L_active of the recorded layout, else of the
  derived one, where it is S / (1 + c (S - 1)) (:func:`xmodlm.depth.expansion_ratio`);
* ``tier``: the compute tier, log10(C) rounded to the nearest quarter decade, so a
  sweep's budgets (1e15, 3e15, 1e16 ...) group together despite small drift;
* ``variant``: the family with its mechanism settings (``xmod``,
  ``xmod[gating=sigmoid]``, ``xmod[anchors=prefix]``, ``mod``, ``dense``), so that
  fits never pool families or ablation variants by accident;
* ``config``: an integer id shared by the seeds of one configuration (same
  variant, width, depth, routing, context and budget): the bootstrap resamples
  configurations, so seed noise widens the intervals instead of being averaged
  away as if seeds were independent configurations.

Which loss is fitted (DESIGN 5): ``val_loss`` is replaced by the causal-routing
loss (``val_loss_causal``) where the table has that column, because only causal
routing can decode; then every row must have a causal loss (a row without one is
refused, never given its top-k loss); ``loss="topk"`` keeps the optimistic top-k loss. Runs with fewer
optimiser steps than ``min_steps`` (column ``steps``) are left out and counted:
early training measures warmup, not the architecture.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from xmodlm import depth, record
from xmodlm.errors import UserError
from xmodlm.flops import capacity_tokens

RUN_COLUMNS = record.RUN_COLUMNS
FINISHED = ("ok", "done")
LOSSES = ("causal", "topk")
DEFAULT_MIN_STEPS = 1000
# X-MoD's own mechanism settings (the sweep's family defaults); any other value is an
# ablation variant with a delta law of its own
MECHANISM_DEFAULTS = record.XMOD_DEFAULTS
UNRECORDED_CONTEXT = 0
_POSITIVE = ("val_loss", "params_active", "tokens")


@dataclass(frozen=True)
class Runs:
    """Validated runs: the frame plus what was left out and why."""

    frame: pd.DataFrame
    dropped_unfinished: int = 0
    excluded_moe: int = 0
    dropped_short: int = 0
    loss: str = "topk"  # the loss actually in ``val_loss``
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


def is_moe(df: pd.DataFrame) -> pd.Series:
    """Which rows are MoE runs: the one family the sparse-depth law does not model (a
    fit leaves them out and counts them; a prediction input names them)."""
    if "family" not in df:
        return pd.Series(False, index=df.index)
    return df["family"].astype(str).str.strip().str.lower().eq("moe")


def validate(
    df: pd.DataFrame, need_loss: bool = True, loss: str = "causal", min_steps: int = 0,
    evaluated: bool = True,
) -> Runs:
    """Check a run table and fill defaults; ``need_loss=False`` for prediction inputs.

    ``evaluated``: each loss is the final checkpoint's on the whole evaluation split
    where every finished run has one (:func:`xmodlm.record.evaluated_losses`, with a
    note); False keeps the in-training validation losses, as a fit against the dense
    runs' validation curves must, since it reads those curves.

    ``loss``: ``causal`` (the default; falls back to top-k, with a note, when the
    table has no ``val_loss_causal``) or ``topk``. ``min_steps``: runs with fewer
    optimiser steps are dropped and counted (needs a ``steps`` column when > 0).
    """
    if loss not in LOSSES:
        raise UserError(f"loss={loss!r}: must be one of {', '.join(LOSSES)}")
    if min_steps < 0:
        raise UserError(f"min_steps={min_steps}: must be >= 0")
    required = ("params_active", "tokens", "val_loss") if need_loss else ("params_active", "tokens")
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise UserError(
            f"table is missing column(s) {', '.join(missing)}; it needs at least {', '.join(required)}"
        )
    frame = df.reset_index(drop=True)
    raw = frame.copy()  # original cells, for error messages about text that is not a number
    dropped = short = 0
    notes: list[str] = []
    frame = _once_each(frame, notes)
    used_loss = loss
    if need_loss:
        frame, dropped = finished_runs(frame)
        split = None
        if evaluated:
            frame, split = record.evaluated_losses(frame)
        if split:
            notes.append(f"losses: each run's final checkpoint on the whole {split} split")
        frame, used_loss = _choose_loss(frame, loss, notes)
        frame, short = _long_enough(frame, min_steps)
    moe = is_moe(frame)
    excluded = 0
    if moe.any():
        if not need_loss:
            raise UserError(f"row {moe.idxmax()}: family moe is outside the sparse-depth law")
        excluded = int(moe.sum())
        frame = frame[~moe]
    if frame.empty:
        raise UserError(
            f"table has no usable runs ({dropped} not finished with status ok/done,"
            f" {short} shorter than {min_steps} steps, {excluded} MoE);"
            " the law needs finished dense runs"
        )
    for col in _POSITIVE if need_loss else _POSITIVE[1:]:
        frame[col] = _numbers(frame, col)
        _require(frame, raw, col, frame[col] > 0, "a positive finite number")
    for col, default in (("stride", 1), ("capacity", 1.0)):
        frame[col] = _numbers(frame, col) if col in frame else default
    stride, capacity = frame["stride"], frame["capacity"]
    _require(frame, raw, "stride", (stride >= 1) & (stride % 1 == 0), "an integer >= 1")
    _require(frame, raw, "capacity", (capacity > 0) & (capacity <= 1), "in (0, 1]")
    frame["stride"] = frame["stride"].astype(int)
    layouts = frame["layout"].fillna("").astype(str) if "layout" in frame else [""] * len(frame)
    frame["is_sparse"] = [
        record.is_sparse(s, c, lay)
        for s, c, lay in zip(frame["stride"], frame["capacity"], layouts, strict=True)
    ]
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
    frame["rho"] = _expansion_ratios(frame, layouts)
    _fill_compute(frame, raw, notes)
    frame["tier"] = np.round(4 * np.log10(frame["compute"])) / 4
    if "family" not in frame:
        frame["family"] = np.where(frame["is_sparse"], "xmod", "dense")
    frame["variant"] = variants(frame)
    keys = [c for c in ("variant", "width", "n_layers", "params_active", "tokens", "context",
                        "stride", "capacity") if c in frame]
    frame["config"] = frame.groupby(keys, sort=True, dropna=False).ngroup()
    return Runs(frame, dropped, excluded, short, used_loss, notes)


def _once_each(frame: pd.DataFrame, notes: list[str]) -> pd.DataFrame:
    """Each run once: a row repeated whole (two tables joined) is counted once, with a
    note; two different rows under one ``run_id`` are refused, as either would weigh
    the run twice in the fit."""
    if "run_id" not in frame:
        return frame
    ids = frame["run_id"].astype(str)
    repeated = frame.duplicated(keep="first")
    if repeated.any():
        notes.append(f"{int(repeated.sum())} repeated row(s) counted once")
        frame, ids = frame[~repeated], ids[~repeated]
    clash = ids.duplicated(keep=False) & frame["run_id"].notna()
    if clash.any():
        rows = list(frame.index[clash])
        raise UserError(
            f"rows {rows[0]} and {rows[1]}: run_id {ids[rows[0]]!r} appears twice with different"
            " values; keep one row per run"
        )
    return frame


def _choose_loss(frame: pd.DataFrame, loss: str, notes: list[str]) -> tuple[pd.DataFrame, str]:
    """Put the requested loss into ``val_loss`` (the top-k one is kept as ``val_loss_topk``)."""
    frame = frame.copy()
    frame["val_loss_topk"] = frame["val_loss"]
    if loss == "topk":
        return frame, "topk"
    if "val_loss_causal" not in frame:
        notes.append("no val_loss_causal column: the top-k validation loss is fitted")
        return frame, "topk"
    # every row its own causal loss: a row without one (n/a, empty) is not quietly
    # given its top-k loss, which would mix two losses in one fit
    cells = frame.copy()  # as given, for the message
    frame["val_loss_causal"] = _numbers(frame, "val_loss_causal")
    _require(frame, cells, "val_loss_causal",
             frame["val_loss_causal"] > 0,
             "a positive finite number (the causal-routing loss; --loss topk fits the top-k"
             " loss instead)")
    frame["val_loss"] = frame["val_loss_causal"]
    return frame, "causal"


def _long_enough(frame: pd.DataFrame, min_steps: int) -> tuple[pd.DataFrame, int]:
    """The runs with at least ``min_steps`` optimiser steps, and how many were shorter."""
    if min_steps == 0:
        return frame, 0
    if "steps" not in frame:
        raise UserError(
            f"min_steps={min_steps} needs a steps column (optimiser steps per run);"
            " add it, or pass min_steps 0 to fit every run"
        )
    steps = pd.to_numeric(frame["steps"], errors="coerce")
    keep = steps >= min_steps
    return frame[keep], int((~keep).sum())


def variants(frame: pd.DataFrame) -> pd.Series:
    """Family plus every mechanism setting that differs from the family's usual one.

    The one naming of ablation variants: the law fits each apart, and the report's
    claims (:mod:`xmodlm.report.claims`) find the paper's ablations by these labels.
    ``frame`` needs ``family``, ``is_sparse`` and ``stride``; ``gating``, ``balance``,
    ``balance_coef`` and ``layout`` are read where present."""
    labels = []
    for _, row in frame.iterrows():
        family = str(row["family"]).strip().lower()
        if not row["is_sparse"]:
            labels.append("dense")
            continue
        if family not in ("xmod", "dense", "nan", ""):
            labels.append(family)  # mod, or another sparse family: its own law
            continue
        parts = []
        gating = str(row.get("gating", MECHANISM_DEFAULTS["gating"]))
        if gating not in ("nan", MECHANISM_DEFAULTS["gating"]):
            parts.append(f"gating={gating}")
        mech = record.recorded_mechanism(row.get("balance"), row.get("balance_coef"), None)
        if mech["balance"] == "none":
            parts.append("balance=none")
        elif mech["balance"] == "cv" and mech["balance_coef"] != MECHANISM_DEFAULTS["balance_coef"]:
            parts.append(f"balance=cv:{mech['balance_coef']:g}")
        layout = str(row.get("layout", "") or "")
        if record.prefix_only(layout, row["stride"]):
            parts.append("anchors=prefix")
        if record.no_prefix(layout):
            parts.append("prefix=0")
        labels.append(f"xmod[{','.join(parts)}]" if parts else "xmod")
    return pd.Series(labels, index=frame.index, dtype=object)


def _expansion_ratios(frame: pd.DataFrame, layouts: Sequence[str]) -> list[float]:
    """Each run's rho (:func:`xmodlm.depth.expansion_ratio`) from its recorded layout,
    else from the layout its stride and capacity derive (one period: the ratio of a
    derived layout does not depend on depth), with k rounded as the model executes it
    where the context is recorded, so that the law's rho is the FLOP count's."""
    out = []
    for s, c, T, lay in zip(frame["stride"], frame["capacity"], frame["context"], layouts,
                            strict=True):
        layout = lay or depth.legacy_layout(s, s, c)
        out.append(depth.expansion_ratio(layout, capacity_tokens(c, T) / T if T else c))
    return out


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
