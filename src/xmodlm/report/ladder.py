"""The dense shapes of a sweep's budgets: which dense model is best at each budget,
and each routed model against dense of its own active size.

A sweep that trains dense at several sizes on one budget answers two questions the
FLOP-matched pairing cannot: was the compute-optimal dense size bracketed (the
ladder), and how much of a routed model's difference is its active size rather
than its routing (the equal-size comparison). Both judge the best dense shape on
the seeds every shape has and pair differences by seed, as the learning-rate
section does (:mod:`xmodlm.report.analysis`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from xmodlm import record
from xmodlm.report.analysis import PAIR_KEYS, model_label, over_seeds


def _dense_shapes(dense: pd.DataFrame) -> list[dict[str, Any]]:
    """The dense shapes (width, depth, optimiser and peak learning rate) among ``dense`` rows of
    one budget, each with its loss over seeds and ``_by_seed`` (mean loss per seed,
    a Series), which callers use for paired differences and drop before output."""
    shapes = []
    for (width, depth, optimizer, lr), h in dense.groupby(
            ["width", "n_layers", "optimizer", "lr"], dropna=False):
        shapes.append({
            "width": int(width), "n_layers": None if pd.isna(depth) else int(depth),
            "optimizer": optimizer, "lr": None if pd.isna(lr) else float(lr),
            "params_active": float(h["params_active"].iloc[0])
            if "params_active" in h and pd.notna(h["params_active"].iloc[0]) else None,
            "seeds": sorted(int(x) for x in h["seed"]),
            **over_seeds(h["loss"].to_numpy(float)),
            "_by_seed": h.groupby("seed")["loss"].mean(),
        })
    return shapes


def _best_shape(shapes: list[dict[str, Any]]) -> tuple[dict[str, Any], set[Any]]:
    """The best of :func:`_dense_shapes` and the seeds every shape has. The best is
    judged on those shared seeds where there are any, so that seed luck does not
    pick the winner; with none shared, on each shape's own mean."""
    common = set.intersection(*(set(e["_by_seed"].index) for e in shapes))
    if common:
        return min(shapes, key=lambda e: float(e["_by_seed"][sorted(common)].mean())), common
    return min(shapes, key=lambda e: e["mean"]), common


def _paired_minus(a: pd.Series, b: pd.Series) -> dict[str, Any] | None:
    """:func:`over_seeds` of ``a - b`` on the seeds both have (None if none)."""
    seeds = sorted(set(a.index) & set(b.index))
    return over_seeds((a[seeds] - b[seeds]).to_numpy(float)) if seeds else None


def dense_ladder(df: pd.DataFrame) -> list[dict[str, Any]]:
    """The dense shapes tried on one budget: per (context, tier), each dense shape
    (width, depth, peak learning rate) with its mean loss +- SE over seeds, the best
    one, and the others' paired difference to it.

    As with learning rates, the best is judged on the seeds every shape has, and the
    differences are paired by seed (the same data order), so that seed luck does not
    pick the winner. ``at_edge``: the best shape is the smallest or the largest
    (active parameters) tried, so the compute-optimal dense size is not bracketed.
    ``widths``/``best_width`` keep the width view of the same answer."""
    out = []
    dense = df[record.is_dense(df["family"])]
    if "n_layers" not in dense.columns:
        dense = dense.assign(n_layers=np.nan)
    for (context, tier), group in dense.groupby(["context", "tier"]):
        shapes = _dense_shapes(group)
        best, common = _best_shape(shapes)
        for e in shapes:
            if e is not best:
                e["minus_best"] = _paired_minus(e["_by_seed"], best["_by_seed"])
            e["mean_common"] = (float(e["_by_seed"][sorted(common)].mean()) if common
                                else None)
        size = [e["params_active"] if e["params_active"] is not None
                else e["width"] ** 2 * (e["n_layers"] or 1) for e in shapes]
        edge = len(set(size)) > 1 and size[shapes.index(best)] in (min(size), max(size))
        for e in shapes:
            del e["_by_seed"]
        out.append({
            "context": int(context), "tier": float(tier),
            "widths": sorted(int(w) for w in group["width"].unique()),
            "best_width": best["width"], "best_n_layers": best["n_layers"],
            "best_loss": best["mean"], "common_seeds": sorted(int(x) for x in common),
            "shapes": shapes, "at_edge": bool(edge),
        })
    return out


def equal_size(df: pd.DataFrame) -> list[dict[str, Any]]:
    """Each routed configuration against dense of its own active size, on its budget.

    FLOP matching hands a routed model more or fewer active parameters than its
    dense partner (routed attention over c*T tokens is cheap, so at long contexts
    more blocks fit the budget), and on a short budget size alone moves the loss.
    Where the budget has dense runs at several sizes (a depth or width ladder of
    the same context, budget and peak learning rate), each seed's dense loss is
    interpolated linearly in ln N_active between the two dense shapes that bracket
    the routed model's N_active, and the routed loss minus it is paired over the
    seeds all three have. Nothing is extrapolated: a model outside the dense sizes
    tried gets the range instead. ``minus_best_dense``: the paired difference to
    the budget's best dense shape (:func:`_best_shape`), whatever its size."""
    if "params_active" not in df.columns:
        return []
    df = df.assign(params_active=pd.to_numeric(df["params_active"], errors="coerce"))
    if "n_layers" not in df.columns:
        df = df.assign(n_layers=np.nan)
    dense_all = df[record.is_dense(df["family"]) & np.isfinite(df["params_active"])]
    routed = df[~record.is_dense(df["family"]) & np.isfinite(df["params_active"])]
    out = []
    for key, runs in routed.groupby(list(PAIR_KEYS), dropna=False):
        row = dict(zip(PAIR_KEYS, key, strict=True))
        budget = dense_all[(dense_all["context"] == row["context"])
                           & (dense_all["tier"] == row["tier"])]
        if budget.empty:
            continue
        # the pairing rule's optimiser and learning rate: the routed run's own where dense
        # has them
        budget = budget[budget["optimizer"] == row["optimizer"]]
        if budget.empty:
            continue
        same_lr = budget[budget["lr"] == row["lr"]]
        shapes = _dense_shapes(same_lr if not same_lr.empty else budget)
        sizes = sorted({e["params_active"] for e in shapes})
        if len(sizes) < 2:
            continue
        best, _ = _best_shape(_dense_shapes(budget))
        n = float(runs["params_active"].iloc[0])
        by_seed = runs.groupby("seed")["loss"].mean()
        entry: dict[str, Any] = {
            "config": model_label(row),
            "tier": float(row["tier"]), "context": int(row["context"]),
            "width": int(row["width"]), "lr": None if pd.isna(row["lr"]) else float(row["lr"]),
            "n_layers": int(runs["n_layers"].iloc[0]) if pd.notna(runs["n_layers"].iloc[0]) else None,
            "params_active": n, "dense_sizes": [sizes[0], sizes[-1]],
            "minus_best_dense": _paired_minus(by_seed, best["_by_seed"]),
            "best_dense": {"width": best["width"], "n_layers": best["n_layers"],
                           "params_active": best["params_active"]},
            "minus_dense_at_size": None,
        }
        if sizes[0] <= n <= sizes[-1]:
            # of several shapes at one size, the better one stands for it
            lo = min((e for e in shapes if e["params_active"] <= n),
                     key=lambda e: (-e["params_active"], e["mean"]))
            hi = min((e for e in shapes if e["params_active"] >= n),
                     key=lambda e: (e["params_active"], e["mean"]))
            w = (float(np.log(n / lo["params_active"]) / np.log(hi["params_active"] / lo["params_active"]))
                 if hi["params_active"] > lo["params_active"] else 0.0)
            interpolated = (1 - w) * lo["_by_seed"] + w * hi["_by_seed"]  # NaN where a seed lacks
            entry["bracket"] = [
                {"width": e["width"], "n_layers": e["n_layers"], "params_active": e["params_active"]}
                for e in (lo, hi)
            ]
            entry["weight"] = w
            entry["minus_dense_at_size"] = _paired_minus(by_seed, interpolated.dropna())
        out.append(entry)
    return out
