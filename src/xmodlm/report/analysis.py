"""The numbers of a sweep report, computed from its results table alone.

Each function here takes the finished runs (:func:`finished_table`) or their
comparisons to dense (:func:`match_to_dense`) and returns plain dicts and lists
that go into ``report.json`` as they are; the wording lives in
:mod:`xmodlm.report.render`, and what needs more than the table (the run records,
control sweeps, a law fit) in :mod:`xmodlm.report.sweep_report`. Kept apart so
that a number can be tested, and recomputed, without the text around it.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from xmodlm import record
from xmodlm.errors import UserError
from xmodlm.law.table import finished_runs
from xmodlm.pairing import NO_PARTNER, dense_partners

if TYPE_CHECKING:
    from xmodlm.law.lawfit import LawFit

REQUIRED = ("family", "width", "context", "val_loss")
TIER_GAP = 0.15  # decades between distinct compute budgets
# what makes two runs of one family different models (seeds aside): the routing, the
# mechanism settings and the optimiser (AdamW, the default, goes unnamed in labels)
CONFIG_KEYS = ("family", "stride", "capacity", "gating", "balance", "balance_coef", "optimizer")
# the paper's construction (K, A): where a table records them, a routed model is named
# by them. They are one-to-one with (stride, capacity) there (K = 1/c, A = (S - 1)/K),
# so grouping by them as well splits no group; it only carries them to the label.
PAPER_KEYS = ("sparsity", "anchor_stride")
DEFAULT_OPTIMIZER = record.DEFAULT_OPTIMIZER
PAIR_KEYS = ("tier", "context", "width", *CONFIG_KEYS, *PAPER_KEYS, "layout", "lr")


def config_label(key: tuple[Any, ...]) -> str:
    family, stride, capacity, gating, balance, coef, optimizer = key
    return _label(family, f"S={stride} c={capacity:g}", gating, balance, coef, optimizer)


def _label(family: str, shape: str, gating: Any, balance: Any, coef: float, optimizer: Any) -> str:
    opt = "" if optimizer == DEFAULT_OPTIMIZER else f" {optimizer}"
    if family == "moe":
        return "moe" + opt
    bal = f"{balance}:{coef:g}" if balance == "cv" else str(balance)
    return f"{family} {shape} {gating} bal={bal}{opt}"


def model_label(row: dict[str, Any]) -> str:
    """The model of a run as the report names it: mechanism settings and optimiser
    (dense: the optimiser alone); an X-MoD of the paper's construction by its (A, K)
    rather than its stride and capacity."""
    key = {**row, **record.recorded_mechanism(row.get("balance"), row.get("balance_coef"),
                                       row.get("optimizer"))}
    if record.is_dense(row["family"]):
        return record.DENSE + ("" if key["optimizer"] == DEFAULT_OPTIMIZER
                               else f" {key['optimizer']}")
    k, a = pd.to_numeric(row.get("sparsity")), pd.to_numeric(row.get("anchor_stride"))
    shape = (f"A{float(a):g}K{float(k):g}" if row["family"] == "xmod" and pd.notna(k) and pd.notna(a)
             else f"S={key['stride']} c={key['capacity']:g}")
    return _label(row["family"], shape, key["gating"], key["balance"], key["balance_coef"],
                  key["optimizer"])


def run_label(row: dict[str, Any]) -> str:
    """The configuration of a run (or of a group of seeds) as the report names it: its
    model, anchors when only the first block of the stack is dense, and the peak
    learning rate where the sweep records it."""
    return (model_label(row) + (" anchors=prefix" if _prefix_only(row) else "")
            + (" prefix=0" if record.no_prefix(str(row.get("layout") or "")) else "")
            + (f" lr={row['lr']:g}" if np.isfinite(row["lr"]) else ""))


def finished_table(raw: pd.DataFrame, path: str | Path) -> tuple[pd.DataFrame, int]:
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
    df, split = record.evaluated_losses(df.reset_index(drop=True))
    df = df.copy()
    df.attrs["loss_source"] = split  # None: the in-training validation losses
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
                         ("layout", ""), ("lr", np.nan), ("balance", None), ("optimizer", None),
                         *((k, np.nan) for k in PAPER_KEYS)):
        if col not in df.columns:
            df[col] = default
    filled = [record.recorded_mechanism(*v) for v in zip(df["balance"], df["balance_coef"],
                                                    df["optimizer"], strict=True)]
    for col in ("balance", "balance_coef", "optimizer"):
        df[col] = [f[col] for f in filled]
    df["layout"] = df["layout"].fillna("").astype(str)
    for col in ("lr", *PAPER_KEYS):
        df[col] = pd.to_numeric(df[col], errors="coerce")
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
                **{k: run[k] for k in (*CONFIG_KEYS[1:], *PAPER_KEYS)},
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
            "config": run_label(row), "family": str(row["family"]),
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
                out.append({"config": run_label(row), "tier": float(row["tier"]),
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
    "balancing": ("on", lambda r: "off" if str(r["balance"]) == "none" else "on"),
    "anchors": ("every S-th block", lambda r: "prefix only" if _prefix_only(r)
                else "every S-th block"),
}
_MATCH = ["tier", "context", "width", "family", "stride", "capacity", "optimizer", "lr", "seed"]


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


def _prefix_only(row: dict[str, Any]) -> bool:
    """:func:`xmodlm.record.prefix_only` of a table row (layout may be missing)."""
    return record.prefix_only(str(row.get("layout") or ""), int(row["stride"]))


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
    keys = ["tier", "context", "width", *CONFIG_KEYS, *PAPER_KEYS, "n_layers"]
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
        depth = f" L={int(row['n_layers'])}" if "n_layers" in row else ""
        out.append({"model": model_label(row) + depth, "tier": float(row["tier"]),
                    "context": int(row["context"]), "width": int(row["width"]),
                    "by_lr": by_lr, "best_lr": best["lr"],
                    "common_seeds": sorted(int(s) for s in common),
                    "best_at_edge": best["lr"] in (by_lr[0]["lr"], by_lr[-1]["lr"])})
    return out


def against_dense(comparisons: pd.DataFrame) -> dict[str, Any]:
    """The routed runs against their FLOP-matched dense runs (:func:`match_to_dense`):
    a summary per family, per budget and per configuration, the paired differences
    over seeds, the pairs that mix machines, the mechanisms' effects and the
    downstream tasks. Nothing when no run was matched."""
    if comparisons.empty:
        return {}
    mixed = comparisons[comparisons["mixed"] != ""]
    keys = [*CONFIG_KEYS, *PAPER_KEYS]
    return {
        "vs_dense": {fam: _summary(g["delta"]) for fam, g in comparisons.groupby("family")},
        "vs_dense_by_tier": {
            f"{tier:g}": _summary(g["delta"]) for tier, g in comparisons.groupby("tier")
        },
        "vs_dense_by_config": {
            model_label(dict(zip(keys, key, strict=True))): _summary(g["delta"])
            for key, g in comparisons.groupby(keys, dropna=False)
        },
        "paired": paired(comparisons),
        "mixed_pairs": [
            {"run_id": r.run_id, "dense_run_id": r.dense_run_id, "mixed": r.mixed}
            for r in mixed.itertuples()
        ],
        "mechanisms": mechanism_effects(comparisons),
        "tasks": paired_tasks(comparisons),
    }


def causal_gap(df: pd.DataFrame) -> dict[str, Any] | None:
    """Causal minus top-k validation loss of the routed runs (median and range): what
    decoding, which cannot see the future, pays against the training-time routing,
    under the table's threshold rule (``rule``: the runs' ``threshold_rule`` where one
    is recorded) and, where the evaluation recorded it, under the other rule, the
    fixed threshold of 1/2 (``half``). None where the table records no causal loss."""
    if "val_loss_causal" not in df.columns:
        return None
    routed = df[(df["stride"] > 1) & (df["capacity"] < 1)]

    def spread(column: str) -> dict[str, Any] | None:
        if column not in routed.columns:
            return None
        gap = pd.to_numeric(routed[column], errors="coerce") - routed["val_loss"]
        gap = gap[np.isfinite(gap)]
        if not len(gap):
            return None
        return {"n": len(gap), "median": float(gap.median()), "min": float(gap.min()),
                "max": float(gap.max())}

    out = spread("val_loss_causal")
    if out is None:
        return None
    rules = sorted(set(routed.get("threshold_rule", pd.Series(dtype=str)).dropna().astype(str)))
    return {**out, "rule": ", ".join(rules) or None, "half": spread("eval_loss_causal_half")}
