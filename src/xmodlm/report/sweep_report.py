"""``xmod report``: the written report of a sweep, computed from its results table.

Every figure in a sweep's write-up should come from one command, so that it can
be recomputed from the committed table rather than trusted. The report answers
the questions a reader asks first, in this order:

1. What ran: runs per family, compute tiers, widths, contexts, seeds, and runs
   left out (not finished).
2. Sparse vs dense at equal compute: each non-dense run against its FLOP-matched
   dense reference (:mod:`xmodlm.pairing`: the dense run of the same context,
   width, seed and peak learning rate, at the same budget). Differences are in the causal-routing validation loss
   (what decoding gets; the top-k one beside it). Per family and per compute
   tier: how many lose, and the median, best and worst difference in nats; per
   configuration over seeds: the paired mean +- standard error with its 95%
   t-interval, *resolved* only when the interval excludes zero.
   Where the sweep varies the peak learning rate, each model's loss per
   learning rate, and the best one, judged on the seeds every rate has.
3. The dense ladder: at each tier, every dense shape (width, depth, learning rate)
   with its loss over seeds, the best one (on shared seeds) and the others'
   paired difference to it. A best shape at the edge of the tested sizes means the
   compute-optimal size was not bracketed and a dense law fitted on it is an
   extrapolation. Where a budget has dense at several sizes, each routed
   configuration against dense of its own active size (:func:`equal_size`): FLOP
   matching changes the active size, and this separates that from routing. Dense
   runs of control sweeps (``dense_controls``) join these two, never the pairing.
4. Routing at inference: the causal-minus-top-k loss gap of routed runs.
5. Training dynamics, where the run records sit beside the table (``runs/RUN_ID/``
   of the sweep directory): per configuration (as in 2, dense included, and the
   depth), mean +- SE over seeds of loss spikes, gradient-norm peaks, residual
   RMS per block at init and at the end, and the routing at the end
   (:mod:`xmodlm.report.dynamics`); ``residual_rms.png`` draws the residual RMS and
   ``depth_hist.png`` the sparse depth per token.
   A run without ``metrics.jsonl`` is skipped and counted.
6. Optionally, the law: selected delta form, its parameters with 95% intervals,
   held-out metrics, and the law's plots.

Outputs ``report.md``, ``comparisons.csv`` (one row per matched non-dense run)
and ``report.json`` (the same numbers), all written atomically.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from xmodlm import record
from xmodlm.errors import UserError
from xmodlm.fileio import atomic_write_json, atomic_write_text
from xmodlm.law.table import finished_runs, read_table
from xmodlm.pairing import NO_PARTNER, dense_partners
from xmodlm.progress import Progress
from xmodlm.report.isoflop import isoflop, isoflop_markdown

if TYPE_CHECKING:
    from xmodlm.law.fit import LawFit

REQUIRED = ("family", "width", "context", "val_loss")
TIER_GAP = 0.15  # decades between distinct compute budgets
CONFIG_KEYS = ("family", "stride", "capacity", "gating", "balance_coef")
PAIR_KEYS = ("tier", "context", "width", *CONFIG_KEYS, "layout", "lr")


def _config_label(key: tuple[Any, ...]) -> str:
    family, stride, capacity, gating, balance = key
    if family == "moe":
        return "moe"
    return f"{family} S={stride} c={capacity:g} {gating} bal={balance:g}"


def _run_label(row: dict[str, Any]) -> str:
    """The configuration of a run (or of a group of seeds) as the report names it:
    mechanism settings, anchors when only the first block of the stack is dense,
    and the peak learning rate where the sweep records it."""
    base = record.DENSE if record.is_dense(row["family"]) else _config_label(
        tuple(row[k] for k in CONFIG_KEYS))
    return (base + (" anchors=first" if _first_anchor_only(row) else "")
            + (f" lr={row['lr']:g}" if np.isfinite(row["lr"]) else ""))


def _load(raw: pd.DataFrame, path: str | Path) -> tuple[pd.DataFrame, int]:
    """The finished runs of the results table ``raw`` (read from ``path``), compute numeric."""
    missing = [c for c in REQUIRED if c not in raw.columns]
    if "compute" not in raw.columns and not {"flops_per_token", "tokens"} <= set(raw.columns):
        missing.append("compute (or flops_per_token and tokens)")
    if missing:
        raise UserError(
            f"results table {str(path)!r} lacks column(s) {', '.join(missing)};"
            " `xmod sweep` writes all of them"
        )
    df, left_out = finished_runs(raw)
    df = df.reset_index(drop=True).copy()
    if "compute" not in df.columns:
        df["compute"] = df["flops_per_token"] * df["tokens"]
    for col in ("width", "context", "val_loss", "compute"):
        df[col] = pd.to_numeric(df[col], errors="coerce")
    bad = ~(np.isfinite(df["val_loss"]) & (df["compute"] > 0) & (df["width"] > 0))
    if bad.any():
        row = int(bad.idxmax())
        raise UserError(
            f"results table {str(path)!r} row {row}: val_loss, compute and width must be"
            " positive finite numbers"
        )
    if df.empty:
        raise UserError(f"results table {str(path)!r} has no finished runs")
    df["family"] = df["family"].astype(str).str.strip().str.lower()
    if "seed" not in df.columns:
        df["seed"] = 0
    for col, default in (("stride", 1), ("capacity", 1.0), ("gating", "-"), ("balance_coef", 0.0),
                         ("layout", ""), ("lr", np.nan)):
        if col not in df.columns:
            df[col] = default
    df["layout"] = df["layout"].fillna("").astype(str)
    df["lr"] = pd.to_numeric(df["lr"], errors="coerce")
    # budgets are per context: FLOP-matching at another context gives other budgets
    # (2.2e13 at T = 128 beside 2.8e13 at T = 512 must not read as one tier)
    df["tier"] = 0.0
    for rows in df.groupby("context").indices.values():
        df.loc[df.index[rows], "tier"] = _tiers(df["compute"].to_numpy(float)[rows])
    # the compared loss: causal routing where recorded (dense runs: the same number)
    causal = pd.to_numeric(df.get("val_loss_causal", pd.Series(np.nan, df.index)), errors="coerce")
    df["loss"] = causal.where(np.isfinite(causal), df["val_loss"])
    return df, left_out


def _tiers(compute: np.ndarray) -> np.ndarray:
    """Budget of each run: the median compute of its cluster of nearby computes (2 digits)."""
    logc = np.log10(compute)
    order = np.argsort(logc)
    cluster = np.zeros(len(logc), dtype=int)
    for prev, cur in zip(order[:-1], order[1:], strict=True):
        cluster[cur] = cluster[prev] + (logc[cur] - logc[prev] > TIER_GAP)
    centers = pd.Series(logc).groupby(cluster).transform("median").to_numpy()
    return np.array([float(f"{10**c:.2g}") for c in centers])


def _task_columns(df: pd.DataFrame) -> list[str]:
    """The downstream-task accuracy columns of a results table (``task_<name>``)."""
    return sorted(c for c in df.columns if c.startswith("task_"))


def mixed_pair(run: pd.Series, ref: pd.Series) -> str:
    """What a routed run and its dense partner do not share of
    :data:`record.PAIRING_COLUMNS` ("" when they share all, or it is not recorded)."""
    return ", ".join(
        f"{k}: {run.get(k)} vs {ref.get(k)}" for k in record.PAIRING_COLUMNS
        if pd.notna(run.get(k)) and pd.notna(ref.get(k)) and run.get(k) != ref.get(k)
    )


def match_to_dense(df: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """One row per non-dense run with its FLOP-matched dense reference
    (:func:`xmodlm.pairing.dense_partners`); and the unmatched count."""
    partners = dense_partners(df, record.is_dense(df["family"]))
    rows, unmatched = [], 0
    for i in np.flatnonzero(~record.is_dense(df["family"].to_numpy())):
        if partners[i] == NO_PARTNER:
            unmatched += 1
            continue
        run, ref = df.iloc[i], df.iloc[partners[i]]
        lr = float(run.get("lr", np.nan))
        rows.append(
            {
                "tier": run["tier"],
                "family": run["family"],
                "context": int(run["context"]),
                "width": int(run["width"]),
                "seed": run["seed"],
                "stride": run["stride"],
                "capacity": run["capacity"],
                "gating": run["gating"],
                "balance_coef": float(run["balance_coef"]),
                "layout": run.get("layout", ""),
                "lr": lr,
                "loss": run.get("loss", run["val_loss"]),
                "dense_loss": ref.get("loss", ref["val_loss"]),
                "delta": run.get("loss", run["val_loss"]) - ref.get("loss", ref["val_loss"]),
                "delta_topk": run["val_loss"] - ref["val_loss"],
                "compute_ratio": run["compute"] / ref["compute"],
                "run_id": run.get("run_id"),
                "dense_run_id": ref.get("run_id"),
                "mixed": mixed_pair(run, ref),
                **{f"delta_{k}": float(run[k]) - float(ref[k]) for k in _task_columns(df)
                   if pd.notna(run.get(k)) and pd.notna(ref.get(k))},
            }
        )
    return pd.DataFrame(rows), unmatched


def _summary(delta: pd.Series) -> dict[str, Any]:
    return {
        "n": len(delta),
        "lose": int((delta > 0).sum()),
        "median": float(delta.median()),
        "best": float(delta.min()),
        "worst": float(delta.max()),
    }


def over_seeds(d: np.ndarray) -> dict[str, Any]:
    """Mean +- standard error of per-seed values and the 95% t-interval (n - 1
    degrees of freedom); ``resolved`` only when n >= 2 and the interval excludes
    zero. One seed gives a value with no error bar: reported, never resolved."""
    from scipy.stats import t as student_t

    n = len(d)
    mean = float(np.mean(d))
    se = float(np.std(d, ddof=1) / np.sqrt(n)) if n > 1 else None
    half = float(student_t.ppf(0.975, n - 1) * se) if se is not None else None
    ci = [mean - half, mean + half] if half is not None else None
    return {"n": n, "mean": mean, "se": se, "ci95": ci,
            "resolved": bool(ci is not None and (ci[0] > 0 or ci[1] < 0))}


def paired(comparisons: pd.DataFrame) -> list[dict[str, Any]]:
    """Each configuration's paired difference to dense over its seeds (:func:`over_seeds`)."""
    out = []
    keys = list(PAIR_KEYS)
    for key, g in comparisons.groupby(keys, dropna=False, sort=True):
        row = dict(zip(keys, key, strict=True))
        out.append({
            "config": _run_label(row), "family": str(row["family"]),
            "tier": float(row["tier"]), "context": int(row["context"]), "width": int(row["width"]),
            "seeds": sorted(int(x) for x in g["seed"]), **over_seeds(g["delta"].to_numpy(float)),
            "mean_topk": float(g["delta_topk"].mean()),
        })
    return out


def paired_tasks(comparisons: pd.DataFrame) -> list[dict[str, Any]]:
    """Each configuration's downstream-task accuracy minus its dense run's, over seeds
    (:func:`over_seeds`), per task evaluated on both (``task_<name>`` columns, from
    each run's ``eval.json``). Positive: the routed model is better."""
    tasks = sorted(c[len("delta_"):] for c in comparisons.columns if c.startswith("delta_task_"))
    out = []
    keys = list(PAIR_KEYS)
    for key, g in comparisons.groupby(keys, dropna=False, sort=True):
        row = dict(zip(keys, key, strict=True))
        for task in tasks:
            d = g[f"delta_{task}"].dropna().to_numpy(float)
            if len(d):
                out.append({"config": _run_label(row), "tier": float(row["tier"]),
                            "context": int(row["context"]), "width": int(row["width"]),
                            "task": task[len("task_"):], **over_seeds(d)})
    return out


HEADLINE_FAMILIES = ("xmod", "mod", "moe")


def headline(
    pairs: list[dict[str, Any]], df: pd.DataFrame, fit: LawFit | None = None
) -> list[dict[str, Any]]:
    """The sweep's answer in one table: a row per (context, budget, width).

    In each cell, every routed family's *headline configuration* minus its
    FLOP-matched dense run of the same seed (a :func:`paired` row: mean +- SE
    over seeds, resolved or not). The headline configuration is the family's
    one with the most seeds in the cell: a study gives its headline cells the
    most seeds, and choosing the best mean instead would pick on seed noise.
    Among configurations with equally many seeds, the one run in the most cells
    of the sweep (a study runs its headline at every budget, its law cells at
    some); where that ties too (an ablation, a learning-rate sweep) the family
    has no headline there: ``{"tied": k, "n": seeds}``. With a law ``fit``, each
    row also carries what :func:`~xmodlm.law.recommend.recommend` answers at that
    budget and context for the cell's dense model's active parameters.
    """
    rows = []
    cells = sorted({(p["context"], p["tier"], p["width"]) for p in pairs})
    spread = Counter(p["config"] for p in pairs)  # cells each configuration ran in
    for context, tier, width in cells:
        here = [p for p in pairs if (p["context"], p["tier"], p["width"]) == (context, tier, width)]
        row: dict[str, Any] = {"context": context, "tier": tier, "width": width, "families": {}}
        for family in HEADLINE_FAMILIES:
            mine = [p for p in here if p["family"] == family]
            most = max(((p["n"], spread[p["config"]]) for p in mine), default=(0, 0))
            top = [p for p in mine if (p["n"], spread[p["config"]]) == most]
            if len(top) == 1:
                row["families"][family] = top[0]
            elif top:  # no configuration stands out: nothing to headline
                row["families"][family] = {"tied": len(top), "n": most[0]}
        if fit is not None:
            row["law"] = _law_answer(fit, df, context, tier, width)
        rows.append(row)
    return rows


def _law_answer(fit: LawFit, df: pd.DataFrame, context: int, tier: float, width: int) -> dict[str, Any]:
    """``recommend`` at one cell's budget, context and dense model size (its answer, and
    the best sparse candidate's predicted difference to dense with P(beats dense))."""
    from xmodlm.law.recommend import recommend

    dense = df[record.is_dense(df["family"]) & (df["context"] == context) & (df["tier"] == tier)
               & (df["width"] == width)]
    if dense.empty or "params_active" not in dense.columns:
        return {"answer": None, "why": "no dense run with its active parameters in the cell"}
    try:
        rec = recommend(tier, int(context), float(dense["params_active"].median()), law=fit)
    except UserError as err:
        return {"answer": None, "why": str(err)}
    top = min(rec["candidates"], key=lambda e: e["vs_dense"], default=None)
    return {
        "answer": rec["answer"], "why": rec["reason"], "identified": rec["law"]["identified"],
        "top": None if top is None else {
            "stride": top["stride"], "capacity": top["capacity"], "vs_dense": top["vs_dense"],
            "p_beats_dense": top["p_beats_dense"], "p_routing_helps": top["p_routing_helps"],
        },
    }


# Mechanisms an ablation varies, each with its reference level (the X-MoD default):
# a contrast is (other level) minus (reference), all else equal.
FACTORS = {
    "gating": ("variance_scaled", lambda r: str(r["gating"])),
    "balancing": ("on", lambda r: "on" if float(r["balance_coef"]) > 0 else "off"),
    "anchors": ("every S-th block", lambda r: "first block only" if _first_anchor_only(r)
                else "every S-th block"),
}
_MATCH = ["tier", "context", "width", "family", "stride", "capacity", "lr", "seed"]


def mechanism_effects(comparisons: pd.DataFrame) -> list[dict[str, Any]]:
    """What each mechanism the sweep varies does, all else equal: a factorial
    ablation's main effects, and the same effects within each level of every
    other factor, paired by seed.

    For a factor (:data:`FACTORS`) with a level other than its reference, each
    routed run at that level is matched with the run at the reference level that
    differs in that factor only (same other mechanisms, budget, context, width,
    stride, capacity, learning rate and seed); the contrast is the difference of
    their differences to dense, i.e. of their losses. Contrasts are averaged over
    the matched cells within each seed first, then summarised as mean +- standard
    error over seeds with a t-interval: seeds are the independent draws (cells of
    one seed share its data order and its dense run). Negative: the level is
    better than the reference.

    The main effect (``within`` None) averages over the other factors' levels,
    which hides interactions: a gate that diverges only without anchors shows
    up as a large, noisy main effect. So each effect is also given within each
    level of each other factor that has two or more (``within`` = {factor:
    level}), from the same matched pairs restricted to that level.
    """
    routed = comparisons[comparisons["family"] != "moe"]
    if routed.empty:
        return []
    rows = [r for _, r in routed.iterrows()]
    levels = {name: [get(r) for r in rows] for name, (_, get) in FACTORS.items()}
    varied = [f for f in FACTORS if len(set(levels[f])) > 1]
    out = []
    for name, (ref_level, _) in FACTORS.items():
        present = sorted(set(levels[name]) - {ref_level})
        if ref_level not in levels[name] or not present:
            continue
        others = [f for f in FACTORS if f != name]

        def key(i: int, others: list[str] = others) -> tuple[Any, ...]:
            r = rows[i]
            return (*(None if pd.isna(r[k]) else r[k] for k in _MATCH),
                    *(levels[f][i] for f in others))

        ref = {key(i): rows[i]["delta"] for i in range(len(rows)) if levels[name][i] == ref_level}
        subsets: list[dict[str, str] | None] = [None] + [
            {f: v} for f in others if f in varied for v in sorted(set(levels[f]))
        ]
        for level in present:
            for within in subsets:
                by_seed: dict[Any, list[float]] = {}
                for i in range(len(rows)):
                    if levels[name][i] != level or key(i) not in ref:
                        continue
                    if within and any(levels[f][i] != v for f, v in within.items()):
                        continue
                    by_seed.setdefault(rows[i]["seed"], []).append(
                        rows[i]["delta"] - ref[key(i)])
                if not by_seed:
                    continue
                stats = over_seeds(np.array([np.mean(v) for v in by_seed.values()]))
                out.append({
                    "factor": name, "level": level, "reference": ref_level, "within": within,
                    "pairs": int(sum(len(v) for v in by_seed.values())), "seeds": stats["n"],
                    **stats,
                })
    return out


def _first_anchor_only(row: dict[str, Any]) -> bool:
    """:func:`xmodlm.record.first_anchor_only` of a table row (layout may be missing)."""
    return record.first_anchor_only(str(row.get("layout") or ""), int(row["stride"]))


def learning_rates(df: pd.DataFrame) -> list[dict[str, Any]]:
    """Per model (configuration, budget, context, width) tried at two or more peak
    learning rates: mean loss +- SE at each over seeds, and the best.

    The best is judged on the seeds every rate has (``common_seeds``), since seed
    noise at these scales is as large as a learning rate's effect: a check run on
    seed 0 beside a three-seed mean would otherwise be compared with two other
    seeds' luck. Only without a shared seed are the all-seed means compared.
    Empty unless the sweep varies lr."""
    if df["lr"].nunique() < 2:
        return []
    out = []
    keys = ["tier", "context", "width", *CONFIG_KEYS, "n_layers"]
    keys = [k for k in keys if k in df.columns]
    for key, g in df.groupby(keys, dropna=False, sort=True):
        if g["lr"].nunique() < 2:
            continue
        row = dict(zip(keys, key, strict=True))
        common = set.intersection(*(set(h["seed"]) for _, h in g.groupby("lr")))
        by_lr = []
        for lr, h in g.groupby("lr"):
            x = h["loss"].to_numpy(float)
            se = float(x.std(ddof=1) / np.sqrt(len(x))) if len(x) > 1 else None
            shared = h.loc[h["seed"].isin(common), "loss"].to_numpy(float)
            by_lr.append({"lr": float(lr), "n": len(x), "mean": float(x.mean()), "se": se,
                          "mean_common": float(shared.mean()) if len(shared) else None})
        judged = "mean_common" if common else "mean"
        best = min(by_lr, key=lambda e: e[judged])
        label = record.DENSE if record.is_dense(row["family"]) else _config_label(
            tuple(row[k] for k in CONFIG_KEYS))
        out.append({"model": f"{label} L={int(row.get('n_layers', 0))}", "tier": float(row["tier"]),
                    "context": int(row["context"]), "width": int(row["width"]),
                    "by_lr": by_lr, "best_lr": best["lr"],
                    "common_seeds": sorted(int(s) for s in common),
                    "best_at_edge": best["lr"] in (by_lr[0]["lr"], by_lr[-1]["lr"])})
    return out


def _dense_shapes(dense: pd.DataFrame) -> list[dict[str, Any]]:
    """The dense shapes (width, depth, peak learning rate) among ``dense`` rows of
    one budget, each with its loss over seeds and ``_by_seed`` (mean loss per seed,
    a Series), which callers use for paired differences and drop before output."""
    shapes = []
    for (width, depth, lr), h in dense.groupby(["width", "n_layers", "lr"], dropna=False):
        shapes.append({
            "width": int(width), "n_layers": None if pd.isna(depth) else int(depth),
            "lr": None if pd.isna(lr) else float(lr),
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


def _dense_ladder(df: pd.DataFrame) -> list[dict[str, Any]]:
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
        # the pairing rule's learning rate: the routed run's own where dense has it
        same_lr = budget[budget["lr"] == row["lr"]]
        shapes = _dense_shapes(same_lr if not same_lr.empty else budget)
        sizes = sorted({e["params_active"] for e in shapes})
        if len(sizes) < 2:
            continue
        best, _ = _best_shape(_dense_shapes(budget))
        n = float(runs["params_active"].iloc[0])
        by_seed = runs.groupby("seed")["loss"].mean()
        entry: dict[str, Any] = {
            "config": _config_label(tuple(row[k] for k in CONFIG_KEYS)),
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


def _law_section(fit: LawFit, fit_path: str | Path) -> dict[str, Any]:
    data = fit.to_json()
    section: dict[str, Any] = {"path": str(fit_path), "runs": data["runs"],
                               "baseline": fit.baseline}
    section["dense"] = [
        {"context": d["context"], "params": {k: v["value"] for k, v in d["params"].items()}}
        for d in data["dense"]
    ]
    if fit.delta is not None:
        form = data["delta"]["forms"][fit.selected]
        section["selected"] = fit.selected
        section["why"] = (fit.selection or {}).get("why", "")
        section["params"] = {
            k: {"value": v["value"], "ci": v["ci"]}
            for k, v in form["params"].items()
            if not v.get("fixed")
        }
        section["terms"] = law_terms(section["params"], form["params"], bool(fit.delta_flags()))
    section["metrics"] = data["metrics"]
    return section


TERM_PARAMS = {"capacity": "g_cap", "context": "g_ctx", "interaction": "g_int"}


def law_terms(
    fitted: dict[str, Any], every: dict[str, Any], flagged: bool = False
) -> dict[str, dict[str, Any]]:
    """Which of the three named terms of the delta law the data resolve.

    Each term has one signed coefficient (``capacity``: g_cap, ``context``:
    g_ctx, ``interaction``: g_int; :mod:`xmodlm.law.delta`). A term is resolved
    when its coefficient was fitted (not held at zero for want of contexts or
    strides), its 95% bootstrap interval excludes zero, and the delta law is
    not ``flagged`` as unidentified (then no interval of it means anything).
    """
    out = {}
    for term, name in TERM_PARAMS.items():
        if name in fitted:
            v = fitted[name]
            lo, hi = v["ci"]
            out[term] = {"param": name, "value": v["value"], "ci": v["ci"], "fixed": False,
                         "resolved": bool(lo > 0 or hi < 0) and not flagged,
                         "flagged": flagged}
        else:
            value = every.get(name, {}).get("value", 0.0)
            out[term] = {"param": name, "value": value, "ci": None, "fixed": True,
                         "resolved": False}
    return out


def dynamics(
    df: pd.DataFrame, results: str | Path, out_dir: str | Path,
    comparisons: pd.DataFrame | None = None,
) -> dict[str, Any]:
    """The training-dynamics section: each finished run's record read from the
    sweep directory of ``results`` (``runs/RUN_ID/``, or ``RUN_ID/`` beside the
    table), grouped as the paired comparison groups (plus the depth, since per-block
    figures only average over one), dense included as the reference; and
    ``residual_rms.png`` in ``out_dir``. Runs without a record are counted.
    ``comparisons`` (:func:`match_to_dense`) names each routed run's dense run, for
    the spikes counted against it."""
    from xmodlm.report.dynamics import (
        PAIRED_SPIKE_THRESHOLD,
        SPIKE_THRESHOLD,
        SPIKE_WINDOW,
        run_dynamics,
        summarise,
        with_paired_spikes,
    )
    from xmodlm.report.dynamics_plots import plot_depth_hist, plot_residual_rms

    root = Path(results).parent
    runs_root = root / "runs" if (root / "runs").is_dir() else root
    keys = [*PAIR_KEYS, "n_layers"] if "n_layers" in df.columns else list(PAIR_KEYS)
    cache: dict[Any, Any] = {}
    found, skipped = [], 0
    for i, run in df.iterrows():
        run_id = run.get("run_id")
        dyn = None
        if isinstance(run_id, str) and run_id.strip():
            warmup = pd.to_numeric(run.get("warmup_steps"), errors="coerce")
            dyn = run_dynamics(runs_root / run_id.strip(),
                               warmup=int(warmup) if np.isfinite(warmup) else None, cache=cache)
        if dyn is None:
            skipped += 1
        else:
            found.append((i, {**dyn, "run_id": run_id.strip()}))
    if comparisons is not None and not comparisons.empty and "dense_run_id" in comparisons:
        partner = {r: d for r, d in zip(comparisons["run_id"], comparisons["dense_run_id"],
                                        strict=True) if isinstance(r, str) and isinstance(d, str)}
        found = with_paired_spikes(found, partner, runs_root)
    section: dict[str, Any] = {
        "spike_threshold": SPIKE_THRESHOLD, "spike_window": SPIKE_WINDOW,
        "paired_spike_threshold": PAIRED_SPIKE_THRESHOLD,
        "runs": len(found), "skipped_no_metrics": skipped, "configs": [], "plot": None,
    }
    if not found:
        return section
    by_row = dict(found)
    runs = df.loc[list(by_row)]
    for key, g in runs.groupby(keys, dropna=False, sort=True):
        row = dict(zip(keys, key, strict=True))
        depth = f" L={int(row['n_layers'])}" if pd.notna(row.get("n_layers")) else ""
        dyns = [by_row[i] for i in g.index]
        section["configs"].append({
            "config": _run_label(row) + depth,
            "tier": float(row["tier"]), "context": int(row["context"]),
            "width": int(row["width"]), "n": len(dyns),
            "seeds": sorted(int(x) for x in g["seed"]),
            "run_ids": [d["run_id"] for d in dyns],
            **summarise(dyns),
        })
    groups = [{**c, **_plot_names(c)} for c in section["configs"]]
    plot = plot_residual_rms(groups, Path(out_dir) / "residual_rms.png")
    section["plot"] = plot.name if plot is not None else None
    depth = plot_depth_hist(groups, Path(out_dir) / "depth_hist.png")
    section["depth_plot"] = depth.name if depth is not None else None
    return section


def _plot_names(config: dict[str, Any]) -> dict[str, str]:
    """A dynamics group's ``panel`` (the budget and context it was trained at: the
    same settings recur at each, and only runs of one budget compare) and its legend
    ``label`` within the panel (the configuration and its width d)."""
    return {"panel": f"budget {config['tier']:.2g} FLOPs, context {config['context']}",
            "label": f"{config['config']} d={config['width']}"}


def _with_dense_controls(
    raw: pd.DataFrame, controls: Sequence[str | Path]
) -> tuple[pd.DataFrame, list[dict[str, Any]]]:
    """``raw`` with the dense runs of each control table appended, marked ``_control``.

    A control is another sweep's results on the same budgets (a depth or width
    ladder of dense models): its dense runs join the dense ladder and the
    equal-size comparison, never the FLOP-matched pairing, which stays with the
    reference the routed runs were matched to. A run already in ``raw`` (same
    ``run_id``) is not counted twice."""
    parts, seen, summary = [raw.assign(_control=False)], set(), []
    if "run_id" in raw.columns:
        seen = set(raw["run_id"].dropna().astype(str))
    for path in controls:
        table = read_table(path)
        if "family" not in table.columns:
            raise UserError(f"dense control {str(path)!r} lacks column 'family';"
                            " `xmod sweep` writes it")
        dense = table[record.is_dense(table["family"].astype(str).str.strip().str.lower())]
        if "run_id" in dense.columns:
            dense = dense[~dense["run_id"].astype(str).isin(seen)]
            seen |= set(dense["run_id"].dropna().astype(str))
        summary.append({"path": str(path), "dense_runs": len(dense)})
        parts.append(dense.assign(_control=True))
    return pd.concat(parts, ignore_index=True), summary


def sweep_report(
    results: str | Path, out_dir: str | Path, law: str | Path | None = None,
    dense_controls: Sequence[str | Path] = (),
) -> dict[str, Any]:
    """Write ``report.md``, ``comparisons.csv`` and ``report.json`` for ``results``; return
    the JSON. ``dense_controls``: results tables whose dense runs join the dense ladder
    and the equal-size comparison (:func:`_with_dense_controls`)."""
    bar = Progress(4 + (law is not None), "report", unit="stage")
    raw = read_table(results)
    combined, controls = _with_dense_controls(raw, dense_controls)
    every, _ = _load(combined, results)
    left_out = finished_runs(raw)[1]  # of this sweep's runs; the controls' are theirs
    df = every[~every["_control"].astype(bool)].reset_index(drop=True)
    comparisons, unmatched = match_to_dense(df)
    bar.update(1, done="runs read and matched to dense")
    report: dict[str, Any] = {
        "results": str(results),
        "runs": {
            "finished": len(df),
            "left_out": left_out,
            "by_family": {k: int(v) for k, v in df["family"].value_counts().sort_index().items()},
        },
        "tiers": sorted(float(t) for t in df["tier"].unique()),
        "widths": sorted(int(w) for w in df["width"].unique()),
        "contexts": sorted(int(c) for c in df["context"].unique()),
        "seeds": sorted(int(s) for s in pd.to_numeric(df["seed"]).unique()),
        "unmatched": unmatched,
        "vs_dense": {},
        "vs_dense_by_tier": {},
        "vs_dense_by_config": {},
        "loss": "causal routing where recorded (top-k beside it)",
        "mixed_pairs": [],
        "paired": [],
        "learning_rates": learning_rates(df),
        "dense_controls": controls,
        "dense_ladder": _dense_ladder(every),
        "equal_size": equal_size(every),
        "isoflop": isoflop(every, CONFIG_KEYS),
        "causal_gap": None,
        "dynamics": None,
        "law": None,
        "headline": [],
        "mechanisms": [],
        "tasks": [],
    }
    if not comparisons.empty:
        report["vs_dense"] = {
            fam: _summary(g["delta"]) for fam, g in comparisons.groupby("family")
        }
        report["vs_dense_by_tier"] = {
            f"{tier:g}": _summary(g["delta"]) for tier, g in comparisons.groupby("tier")
        }
        report["vs_dense_by_config"] = {
            _config_label(key): _summary(g["delta"])
            for key, g in comparisons.groupby(list(CONFIG_KEYS), dropna=False)
        }
        report["paired"] = paired(comparisons)
        mixed = comparisons[comparisons["mixed"] != ""]
        report["mixed_pairs"] = [
            {"run_id": r.run_id, "dense_run_id": r.dense_run_id, "mixed": r.mixed}
            for r in mixed.itertuples()
        ]
        report["mechanisms"] = mechanism_effects(comparisons)
        report["tasks"] = paired_tasks(comparisons)
    if "val_loss_causal" in df.columns:
        routed = df[(df["stride"] > 1) & (df["capacity"] < 1)]
        gap = pd.to_numeric(routed["val_loss_causal"], errors="coerce") - routed["val_loss"]
        gap = gap[np.isfinite(gap)]
        if len(gap):
            report["causal_gap"] = {
                "n": len(gap),
                "median": float(gap.median()),
                "min": float(gap.min()),
                "max": float(gap.max()),
            }
    bar.update(1, done="comparisons summarised")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report["dynamics"] = dynamics(df, results, out, comparisons)
    bar.update(1, done="training dynamics read from the run records")
    fit = None
    if law is not None:
        from xmodlm.law.fit import load_fit
        from xmodlm.report.law_plots import plot_law

        fit = load_fit(law)
        report["law"] = _law_section(fit, law)
        plots = plot_law(fit, raw, out / "plots")
        report["law"]["plots"] = [str(p.relative_to(out)) for p in plots]
        bar.update(1, done="law summarised and plotted")
    report["headline"] = headline(report["paired"], df, fit)
    atomic_write_text(out / "comparisons.csv", comparisons.to_csv(index=False))
    atomic_write_json(out / "report.json", report)
    atomic_write_text(out / "report.md", render_markdown(report, comparisons))
    bar.update(1, done="report written")
    bar.close()
    return report


def _over_seeds_cells(stat: dict[str, Any]) -> str:
    """``mean +- SE | 95% interval | resolved`` of an :func:`over_seeds` summary."""
    se = f" +- {stat['se']:.3f}" if stat["se"] is not None else " (1 seed)"
    ci = f"[{stat['ci95'][0]:+.3f}, {stat['ci95'][1]:+.3f}]" if stat["ci95"] else "-"
    return f"{stat['mean']:+.3f}{se} | {ci} | {'yes' if stat['resolved'] else 'no'}"


def _fmt(x: float) -> str:
    return f"{x:+.3f}"


def render_markdown(report: dict[str, Any], comparisons: pd.DataFrame) -> str:
    """The report as Markdown (every number from ``report`` / ``comparisons``)."""
    runs = report["runs"]
    fams = ", ".join(f"{n} {k}" for k, n in runs["by_family"].items())
    lines = [
        f"# Sweep report: `{report['results']}`",
        "",
        f"{runs['finished']} finished runs ({fams}); {runs['left_out']} left out as not finished.",
        f"Compute tiers {', '.join(f'{t:.2g}' for t in report['tiers'])};"
        f" widths {report['widths']}; contexts {report['contexts']}; seeds {report['seeds']}.",
        *_headline_markdown(report.get("headline") or []),
        "",
        "## Against the FLOP-matched dense model",
        "",
        "Difference in causal-routing validation loss (nats), run minus its dense reference"
        " of the same context, width, seed and budget; positive means the dense model is"
        " better.",
        "",
    ]
    if report["vs_dense"]:
        lines += ["| group | runs | lose to dense | median | best | worst |", "|---|---|---|---|---|---|"]
        tables = (
            ("", report["vs_dense"]),
            ("C = ", report["vs_dense_by_tier"]),
            ("", report["vs_dense_by_config"]),
        )
        for title, table in tables:
            for key, s in table.items():
                lines.append(
                    f"| {title}{key} | {s['n']} | {s['lose']} | {_fmt(s['median'])} |"
                    f" {_fmt(s['best'])} | {_fmt(s['worst'])} |"
                )
        wins = comparisons[comparisons["delta"] < 0].sort_values("delta")
        if len(wins):
            lines += ["", f"Runs that beat their dense reference ({len(wins)}):", ""]
            for _, w in wins.iterrows():
                lines.append(
                    f"* C = {w['tier']:.2g}, width {w['width']}, {w['family']} S = {w['stride']},"
                    f" c = {w['capacity']:g}: {_fmt(w['delta'])}"
                )
    else:
        lines.append("No non-dense run has a FLOP-matched dense reference in this table.")
    if report["unmatched"]:
        lines += ["", f"{report['unmatched']} non-dense runs have no dense reference and are not compared."]
    if report["paired"]:
        lines += [
            "",
            "### Per configuration, paired over seeds",
            "",
            "Mean +- standard error of the paired difference (causal; top-k mean beside it);"
            " resolved when the 95% t-interval excludes zero (never with one seed).",
            "",
            "| C | T | width | configuration | seeds | mean +- SE | 95% interval | resolved | top-k mean |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for p in report["paired"]:
            lines.append(
                f"| {p['tier']:.2g} | {p['context']} | {p['width']} | {p['config']} | {p['n']} |"
                f" {_over_seeds_cells(p)} | {p['mean_topk']:+.3f} |"
            )
    if report.get("tasks"):
        lines += [
            "", "### Downstream tasks, paired over seeds", "",
            "Accuracy on the offline tasks (each run's final checkpoint, causal routing;"
            " `eval.json`) minus its dense run's, mean +- standard error over seeds;"
            " positive: the routed model is better.", "",
            "| C | T | width | configuration | task | seeds | mean +- SE | 95% interval |"
            " resolved |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for t in report["tasks"]:
            lines.append(f"| {t['tier']:.2g} | {t['context']} | {t['width']} | {t['config']} |"
                         f" {t['task']} | {t['n']} | {_over_seeds_cells(t)} |")
    if report.get("mechanisms"):
        lines += [
            "", "### Mechanisms, all else equal", "",
            "Each level minus the reference level of one mechanism, the other mechanisms,"
            " budget, context, width, learning rate and seed held equal (causal loss, nats);"
            " averaged over the matched cells within a seed, then mean +- standard error over"
            " seeds. Negative: the level is better than the reference. *within*: all matched"
            " pairs (the main effect), or only those at one level of another mechanism"
            " (where the effect depends on it, the main effect misleads).", "",
            "| mechanism | level | reference | within | matched pairs | seeds | mean +- SE |"
            " 95% interval | resolved |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for m in report["mechanisms"]:
            within = ", ".join(f"{f} {v}" for f, v in (m.get("within") or {}).items()) or "all"
            lines.append(
                f"| {m['factor']} | {m['level']} | {m['reference']} | {within} | {m['pairs']} |"
                f" {m['seeds']} | {_over_seeds_cells(m)} |"
            )
    if report["learning_rates"]:
        lines += ["", "## Peak learning rate", "",
                  "Models tried at two or more peak learning rates. Causal validation loss"
                  " on the seeds every rate has (the best in bold: seed noise is as large as"
                  " the rates' effect, so rates are compared on shared seeds), then the mean"
                  " +- standard error over all seeds of each rate.", ""]
        for m in report["learning_rates"]:
            shared = m.get("common_seeds") or []

            def bold(e: dict[str, Any], text: str, m: dict[str, Any] = m) -> str:
                return f"**{text}**" if e["lr"] == m["best_lr"] else text

            on = (f"seed{'s' if len(shared) > 1 else ''} {', '.join(map(str, shared))}: "
                  + ", ".join(bold(e, f"{e['lr']:g}: {e['mean_common']:.4f}")
                              for e in m["by_lr"]) + "; all seeds: ") if shared else ""
            cells = ", ".join(
                (f"{e['lr']:g}: {e['mean']:.4f}" if shared
                 else bold(e, f"{e['lr']:g}: {e['mean']:.4f}"))
                + (f" +- {e['se']:.4f}" if e["se"] is not None else "") + f" (n={e['n']})"
                for e in m["by_lr"]
            )
            edge = " (best at the edge of the tried range)" if m["best_at_edge"] else ""
            lines.append(f"* {m['model']}, C = {m['tier']:.2g}, T = {m['context']}:"
                         f" {on}{cells}{edge}")
    lines += [
        "", "## Dense ladder", "",
        "Dense shapes on one budget: mean loss +- SE over seeds (n), and each shape minus the"
        " best one, paired by seed (* where the 95% interval excludes zero). The best is"
        " judged on the seeds every shape has.", "",
        "| context | C | width | blocks | lr | active params | loss | minus best |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d in report["dense_ladder"]:
        for e in d["shapes"]:
            se = f" +- {e['se']:.4f}" if e["se"] is not None else ""
            versus = _diff_cell(e["minus_best"]) if "minus_best" in e else "best"
            lr = f"{e['lr']:g}" if e["lr"] is not None else "-"
            params = f"{e['params_active'] / 1e6:.2f}M" if e["params_active"] is not None else "-"
            depth = e["n_layers"] if e["n_layers"] is not None else "-"
            lines.append(f"| {d['context']} | {d['tier']:.2g} | {e['width']} | {depth} |"
                         f" {lr} | {params} | {e['mean']:.4f}{se} ({e['n']}) | {versus} |")
    edges = sum(d["at_edge"] for d in report["dense_ladder"])
    if edges:
        lines += [
            "",
            f"At {edges} of {len(report['dense_ladder'])} budgets the best dense shape is the"
            " smallest or the largest tried: the compute-optimal size is not bracketed there, and"
            " a dense law fitted on these runs extrapolates its optimum.",
        ]
    if report["dense_controls"]:
        lines += ["", "Dense runs from control sweeps on the same budgets join the ladder (never"
                  " the FLOP-matched pairing): " + "; ".join(
                      f"`{c['path']}` ({c['dense_runs']} runs)" for c in report["dense_controls"]
                  ) + "."]
    if report.get("mixed_pairs"):
        lines += ["", f"**{len(report['mixed_pairs'])} compared pairs mix CPU kinds, dtypes or"
                  " compile modes** (each such pair is two draws, not one paired comparison):", ""]
        lines += [f"* {m['run_id']} vs {m['dense_run_id']}: {m['mixed']}"
                  for m in report["mixed_pairs"]]
    lines += _equal_size_markdown(report["equal_size"])
    lines += isoflop_markdown(report.get("isoflop") or [], _config_label)
    gap = report["causal_gap"]
    if gap:
        lines += [
            "",
            "## Causal routing at inference",
            "",
            f"Causal minus top-k validation loss over {gap['n']} routed runs: median"
            f" {_fmt(gap['median'])} (range {_fmt(gap['min'])} to {_fmt(gap['max'])}).",
        ]
    lines += _dynamics_markdown(report.get("dynamics"))
    law = report["law"]
    if law:
        baseline = ("each sparse run's delta measured against its FLOP-matched dense run"
                    if law.get("baseline") == "paired"
                    else "each sparse run's delta measured against the dense law at its own size")
        lines += ["", "## Law", "", f"Fit `{law['path']}` ({law['runs']['n']} runs; {baseline})."]
        if law.get("selected"):
            lines += ["", f"Selected delta form `{law['selected']}`: {law['why']}.", ""]
            lines += ["| parameter | value | 95% interval |", "|---|---|---|"]
            for k, v in law["params"].items():
                lines.append(f"| {k} | {v['value']:.4g} | [{v['ci'][0]:.4g}, {v['ci'][1]:.4g}] |")
            lines += ["", "Resolved: the term's coefficient was fitted and its 95% interval"
                      " excludes zero.", "", "| term | coefficient | value | resolved |",
                      "|---|---|---|---|"]
            for term, t in law.get("terms", {}).items():
                state = ("held at 0 (the data cannot show it)" if t["fixed"]
                         else "no (the delta law is not identified)" if t.get("flagged")
                         else "yes" if t["resolved"] else "no")
                lines.append(f"| {term} | {t['param']} | {t['value']:.4g} | {state} |")
        held = law["metrics"].get("heldout") or {}
        by_protocol = law["metrics"].get("heldout_by_protocol") or {}
        if by_protocol:
            lines += _protocols_markdown(by_protocol, law["metrics"].get("heldout_protocol"))
        elif held:
            ratio = held.get("ratio")
            tau = held.get("kendall_tau")
            lines += [
                "",
                f"Held-out ({law['metrics'].get('heldout_protocol')}): RMSE of ln L"
                f" {held['rmse']:.4f} vs {held['in_fit_rmse']:.4f} in fit"
                + (f" (ratio {ratio:.2f})" if ratio is not None else "")
                + (f", Kendall tau {tau:.2f}" if tau is not None else "")
                + ".",
            ]
        for p in law.get("plots", []):
            lines += ["", f"![{Path(p).stem}]({p})"]
    return "\n".join(lines) + "\n"


FAMILY_NAMES = {"xmod": "X-MoD", "mod": "MoD", "moe": "MoE"}


def _headline_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The :func:`headline` table: routed families minus dense per context and budget."""
    if not rows:
        return []
    fams = [f for f in HEADLINE_FAMILIES if any(f in r["families"] for r in rows)]
    with_law = any("law" in r for r in rows)
    head = ["T", "C", "width", *(FAMILY_NAMES[f] for f in fams)] + (["law recommends"] if with_law else [])
    lines = [
        "", "## Headline", "",
        "Each routed family's headline configuration (its one with the most seeds in the"
        " cell) minus the FLOP-matched dense run of the same seed: causal-routing validation"
        " loss, nats, mean +- standard error over seeds (n); * where the 95% interval excludes"
        " zero. Negative: the routed model is better."
        + (" Law: `xmod recommend` at the cell's budget, context and dense size; P is the"
           " smaller of P(beats dense) and P(routing helps), which must both reach its"
           " threshold, and a law flagged as not identified gives no sparse answer."
           if with_law else ""), "",
        "| " + " | ".join(head) + " |", "|" + "---|" * len(head),
    ]
    configs: dict[str, set[str]] = {}
    for r in rows:
        cells = [str(r["context"]), f"{r['tier']:.2g}", str(r["width"])]
        for f in fams:
            p = r["families"].get(f)
            if p is None:
                cells.append("-")
                continue
            if "tied" in p:
                cells.append(f"- ({p['tied']} configurations with {p['n']} seeds)")
                continue
            configs.setdefault(f, set()).add(p["config"])
            se = f" +- {p['se']:.3f}" if p["se"] is not None else ""
            cells.append(f"{p['mean']:+.3f}{se} ({p['n']}){'*' if p['resolved'] else ''}")
        if with_law:
            law = r.get("law") or {}
            top = law.get("top")
            answer = law.get("answer") or "-"
            if top is not None:
                p = min(top["p_beats_dense"], top["p_routing_helps"])
                answer += (f" (best sparse: S={top['stride']} c={top['capacity']:g},"
                           f" {top['vs_dense']:+.3f} predicted, P {p:.2f}"
                           + ("; law not identified" if not law.get("identified", True) else "")
                           + ")")
            cells.append(answer)
        lines.append("| " + " | ".join(cells) + " |")
    if configs:
        lines.append("")
    for f in fams:
        if configs.get(f):
            lines.append(f"* {FAMILY_NAMES[f]}: {'; '.join(sorted(configs[f]))}")
    return lines


def _protocols_markdown(by_protocol: dict[str, dict[str, Any]], selecting: str | None) -> list[str]:
    """The selected law's held-out scores under each protocol, one row each."""
    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else f"{x:{fmt}}"

    lines = ["", "Held-out scores of the selected law (RMSE of ln L on the held-out runs;"
             " ratio: to the in-fit RMSE of the same refits; Kendall tau and regret within each"
             " choice of configuration):", "",
             "| protocol | runs | RMSE | ratio | Kendall tau | regret |", "|---|---|---|---|---|---|"]
    for protocol, m in by_protocol.items():
        name = protocol + (" (selects the form)" if protocol == selecting else "")
        if "rmse" not in m:
            why = m.get("not_applicable") or m.get("failed") or "-"
            lines.append(f"| {name} | - | {why} | | | |")
            continue
        lines.append(f"| {name} | {m['n']} | {m['rmse']:.4f} | {num(m['ratio'], '.2f')} |"
                     f" {num(m['kendall_tau'], '.2f')} | {num(m['regret'], '.4f')} |")
    return lines


def _diff_cell(stat: dict[str, Any] | None) -> str:
    """``mean +- SE (n)`` of a paired difference, ``*`` when resolved; ``-`` without."""
    if stat is None:
        return "-"
    se = f" +- {stat['se']:.3f}" if stat["se"] is not None else ""
    return f"{stat['mean']:+.3f}{se} ({stat['n']}){'*' if stat['resolved'] else ''}"


def _equal_size_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The section of :func:`equal_size`: empty where no budget has dense at two sizes."""
    if not rows:
        return []
    lines = [
        "", "## At equal active size", "",
        "Each routed configuration minus dense of its own active size on the same budget:"
        " per seed, the dense loss interpolated linearly in ln N_active between the two dense"
        " shapes that bracket it (same context, budget and peak learning rate), then paired over"
        " seeds (* where the 95% interval excludes zero). FLOP matching gives a routed model more"
        " or fewer active parameters than its dense partner, and on a short budget size alone"
        " moves the loss; this takes the size out. Beside it, the paired difference to the"
        " budget's best dense shape, whatever its size.", "",
        "| T | C | width | configuration | active params | dense between | minus dense at its size"
        " | 95% interval | minus best dense |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        stat = r["minus_dense_at_size"]
        if stat is None:
            lo, hi = r["dense_sizes"]
            between = f"outside {lo / 1e6:.2f}M-{hi / 1e6:.2f}M"
            ci = "-"
        else:
            between = " and ".join(f"{b['params_active'] / 1e6:.2f}M" for b in r["bracket"])
            ci = f"[{stat['ci95'][0]:+.3f}, {stat['ci95'][1]:+.3f}]" if stat["ci95"] else "-"
        lr = f" lr={r['lr']:g}" if r["lr"] is not None else ""
        depth = f" L={r['n_layers']}" if r["n_layers"] is not None else ""
        best = r["best_dense"]
        shape = ", ".join(
            ([f"width {best['width']}"] if best["width"] != r["width"] or best["n_layers"] is None
             else []) + ([f"{best['n_layers']} blocks"] if best["n_layers"] is not None else [])
        )
        lines.append(
            f"| {r['context']} | {r['tier']:.2g} | {r['width']} | {r['config']}{depth}{lr} |"
            f" {r['params_active'] / 1e6:.2f}M | {between} | {_diff_cell(stat)} | {ci} |"
            f" {shape}: {_diff_cell(r['minus_best_dense'])} |"
        )
    return lines


def _pm(stat: dict[str, Any] | None, fmt: str, index: int | None = None) -> str:
    """``mean +- SE`` of a :func:`~xmodlm.report.dynamics.mean_se` summary (an element
    of a per-block one with ``index``); the mean alone from one seed, ``-`` without.
    ``fmt`` is a format spec, or ``sig3`` for figures whose scale varies by orders
    of magnitude (the residual RMS: 0.02 at init, up to 70 trained)."""
    if stat is None:
        return "-"
    mean, se = stat["mean"], stat["se"]
    if index is not None:
        mean, se = mean[index], (se[index] if se is not None else None)
    if fmt == "sig3":  # three significant digits in the mean, the error to the same place
        places = max(0, 2 - int(np.floor(np.log10(abs(mean))))) if mean else 3
        fmt = f".{places}f"
    return f"{mean:{fmt}}" + (f" +- {se:{fmt}}" if se is not None else "")


def _dynamics_markdown(dyn: dict[str, Any] | None) -> list[str]:
    """The training-dynamics section of ``report.md`` (nothing when it was not computed)."""
    if dyn is None:
        return []
    lines = ["", "## Training dynamics", ""]
    if not dyn["configs"]:
        return lines + [f"No run records with metrics.jsonl beside the table"
                        f" ({dyn['skipped_no_metrics']} runs skipped)."]
    sources = sorted({s for c in dyn["configs"] for s in c["init_tokens"]})
    lines += [
        f"From the metrics.jsonl of {dyn['runs']} runs"
        + (f" ({dyn['skipped_no_metrics']} without one skipped)" if dyn["skipped_no_metrics"]
           else "")
        + "; mean +- standard error over seeds. Spikes: logged training steps after warmup"
        f" whose loss exceeds the median of the {dyn['spike_window']} logged losses before it"
        f" by more than {dyn['spike_threshold']:g} nats; spikes vs dense: the same rule on"
        " the loss minus the FLOP-matched dense run's at the same step (same seed, so the"
        f" same batches) with {dyn.get('paired_spike_threshold', 0.2):g} nats. Gradient norm"
        " (before clipping):"
        " largest and 99th percentile of the logged steps after warmup. Residual RMS of the"
        f" last block at init ({'; '.join(sources) or 'no record of it and no config'}) and at"
        " the last evaluation; every block in"
        " `residual_rms.png`. Routing at the last evaluation: coverage and Jaccard overlap"
        " averaged over windows and consecutive sparse blocks; depth sd: the standard deviation"
        " of the number of sparse blocks a token passes through (its mean is fixed by the"
        " capacity); the whole histogram in `depth_hist.png`.",
        "",
        "| C | T | width | configuration | seeds | spikes | spikes vs dense | max grad norm |"
        " p99 grad norm | last-block RMS init | last-block RMS end | coverage | depth sd |"
        " Jaccard |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in dyn["configs"]:
        lines.append(
            f"| {c['tier']:.2g} | {c['context']} | {c['width']} | {c['config']} | {c['n']} |"
            f" {_pm(c['spikes'], '.2f')} | {_pm(c.get('paired_spikes'), '.2f')} |"
            f" {_pm(c['grad_norm_max'], '.3f')} |"
            f" {_pm(c['grad_norm_p99'], '.3f')} | {_pm(c['residual_rms_init'], 'sig3', -1)} |"
            f" {_pm(c['residual_rms_end'], 'sig3', -1)} | {_pm(c['coverage_mean'], '.3f')} |"
            f" {_pm(c['sparse_depth_sd'], '.3f')} | {_pm(c['jaccard_mean'], '.3f')} |"
        )
    if dyn["plot"]:
        lines += ["", f"![residual RMS per block]({dyn['plot']})"]
    if dyn.get("depth_plot"):
        lines += ["", f"![sparse depth per token]({dyn['depth_plot']})"]
    return lines
