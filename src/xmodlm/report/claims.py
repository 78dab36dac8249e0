"""The paper's claims, each checked on a sweep of the paper's construction.

A sweep that builds its models as the paper does (K, A, N0 on one backbone, the same
active depth and the same compute at a context) can answer the paper's own
questions, and a reader of the replication wants each answer beside the paper's
figure rather than assembled from the general tables. Each function here takes the
finished runs (:func:`xmodlm.report.analysis.finished_table`) and returns plain
dicts for ``report.json``:

1. :func:`loss_by_k`: the loss at each K per context (dense as K = 1), its argmin
   and whether that is interior: the paper finds a U in K at every context.
2. :func:`best_k_growth`: the continuous K* per context and the slope of ln K*
   against ln L: the paper's K* grows about as L^0.55.
3. :func:`best_vs_dense`: the best K (chosen on seed 0) minus dense, paired by seed,
   on every seed and on the seeds the choice did not see.
4. :func:`ablations`: each single-switch ablation minus the full model.
5. :func:`moe_vs_xmod`: the X-MoD of the MoE's total parameters against it.
6. :func:`routing_by_bias` and 7. :func:`step_times`: from the run records
   (``runs``: run id -> :func:`xmodlm.report.dynamics.run_dynamics`), where the
   sweep directory has them.

The main model is the X-MoD of the paper's recipe (token-choice bias, the
variance-scaled gate, anchors closing every stage, a dense prefix) at A = 1; an
ablation is found by its law variant (:func:`xmodlm.law.table.variants`). Every
paired difference is a run minus its partner under the one pairing rule
(:func:`xmodlm.pairing.dense_partners`, with the reference runs as the candidates):
the same context, width, seed, optimiser and budget, on the same CPU kind, dtype and
compile mode where there is such a run. The wording is
:mod:`xmodlm.report.claims_render`'s, the figure :mod:`xmodlm.report.claims_plots`'s;
the law's own claims (held-out error, a prediction beyond the fitted contexts) are
the law section's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from xmodlm import record
from xmodlm.law.table import variants
from xmodlm.pairing import NO_PARTNER, dense_partners
from xmodlm.report.analysis import mixed_pair, over_seeds
from xmodlm.report.dynamics import mean_se, summarise
from xmodlm.report.isoflop import fit_parabola

MAIN = "xmod"  # the law variant of the full model
MAIN_BALANCE = "token_bias"
MAIN_ANCHOR_STRIDE = 1.0
# the paper's single-switch ablations by law variant: what each takes away
ABLATIONS = {
    "xmod[balance=none]": "no token-choice bias",
    "xmod[anchors=prefix]": "no dense anchors",
    "xmod[gating=sigmoid]": "sigmoid gate",
    "xmod[prefix=0]": "no dense prefix",
}
MOE_PARAMS_TOLERANCE = 0.10  # relative gap in total parameters that still counts as similar
# the paper's figures, as the report quotes them beside ours
PAPER: dict[str, Any] = {
    "u_shape": "U-shaped in K at every context",
    "exponent": 0.55,
    "best_vs_dense": "X-MoD better than dense at every context, e.g. -0.224 / -0.270 nats"
                     " at 556M for A4K8 / A3K16",
    "ablations": {"xmod[balance=none]": 0.181, "xmod[anchors=prefix]": 0.103,
                  "xmod[gating=sigmoid]": 0.016, "xmod[prefix=0]": 0.011},
    "law": "R^2_Delta 0.9853 on 109 runs; held out by context, scale and A, and out of"
           " range (L = 64k, N_act 1.65B) inside a +-0.02-nat band",
}
CELL = ["context", "tier", "width", "optimizer", "lr"]  # one backbone at one budget


def applies(df: pd.DataFrame) -> bool:
    """Whether the table holds runs of the paper's construction: (K, A) recorded for
    X-MoD runs at two or more K, and the dense prefix recorded."""
    if not {"sparsity", "anchor_stride", "dense_prefix"} <= set(df.columns):
        return False
    k = pd.to_numeric(df["sparsity"], errors="coerce")
    a = pd.to_numeric(df["anchor_stride"], errors="coerce")
    xmod = (df["family"] == "xmod") & np.isfinite(k) & np.isfinite(a)
    return int(k[xmod].nunique()) >= 2


def claims(df: pd.DataFrame, runs: Mapping[str, dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """Every claim of the module docstring; None when the table is not of the paper's
    construction (:func:`applies`). ``runs``: run id -> the run's dynamics record,
    for the claims that need the run records (absent without them)."""
    if not applies(df):
        return None
    df = paper_frame(df)
    by_k = loss_by_k(df)
    runs = runs or {}
    return {
        "paper": PAPER,
        "u_shape": by_k,
        "growth": best_k_growth(by_k),
        "best_vs_dense": best_vs_dense(df),
        "ablations": ablations(df),
        "moe": moe_vs_xmod(df),
        "routing_bias": routing_by_bias(df, runs) if runs else None,
        "step_time": step_times(df, runs) if runs else None,
        "plot": None,
    }


def paper_frame(df: pd.DataFrame) -> pd.DataFrame:
    """The finished runs with ``K``, ``A``, the law ``variant``, ``main`` (the full
    model at A = 1) and ``seed`` as an integer."""
    out = df.assign(
        K=pd.to_numeric(df["sparsity"], errors="coerce"),
        A=pd.to_numeric(df["anchor_stride"], errors="coerce"),
        seed=pd.to_numeric(df["seed"]).astype(int),
        stride=pd.to_numeric(df["stride"], errors="coerce").fillna(1).astype(int),
    ).reset_index(drop=True)
    out["is_sparse"] = [record.is_sparse(s, c, lay) for s, c, lay
                        in zip(out["stride"], out["capacity"], out["layout"], strict=True)]
    out["variant"] = variants(out)
    prefix = pd.to_numeric(out["dense_prefix"], errors="coerce")
    out["main"] = ((out["variant"] == MAIN) & (out["balance"] == MAIN_BALANCE)
                   & (out["A"] == MAIN_ANCHOR_STRIDE) & (prefix > 0) & np.isfinite(out["K"]))
    return out


def model_name(row: Mapping[str, Any]) -> str:
    """A run's model as the paper names it: dense, MoD, MoE, or AxKy (with its
    ablation where it is one)."""
    family = str(row["family"])
    if family != "xmod":
        return {"mod": "MoD", "moe": "MoE"}.get(family, family)
    name = f"A{row['A']:g}K{row['K']:g}"
    return name if row["variant"] == MAIN else f"{name} {ABLATIONS.get(row['variant'], row['variant'])}"


def _cells(df: pd.DataFrame) -> list[tuple[dict[str, Any], pd.DataFrame]]:
    """The table per backbone and budget (:data:`CELL`), each with its keys."""
    return [(dict(zip(CELL, key, strict=True)), g)
            for key, g in df.groupby(CELL, dropna=False, sort=True)]


def _where(cell: Mapping[str, Any]) -> dict[str, Any]:
    return {"context": int(cell["context"]), "tier": float(cell["tier"])}


def _seed_means(rows: pd.DataFrame) -> pd.Series:
    """Loss per seed (a run repeated on another machine counts once, averaged)."""
    return rows.groupby("seed")["loss"].mean()


def pairs(df: pd.DataFrame, runs: np.ndarray, refs: np.ndarray) -> list[tuple[int, int]]:
    """(run, partner) positions in ``df``: each of the ``runs`` rows with its partner
    among the ``refs`` rows under the pairing rule (module docstring); runs without
    one are left out."""
    partner = dense_partners(df, refs & ~runs)
    return [(int(i), int(partner[i])) for i in np.flatnonzero(runs) if partner[i] != NO_PARTNER]


def paired_minus(
    df: pd.DataFrame, runs: np.ndarray, refs: np.ndarray, skip_seeds: tuple[int, ...] = (),
) -> dict[str, Any] | None:
    """``runs`` minus their partners among ``refs`` (:func:`pairs`): averaged within a
    seed, then mean +- SE over seeds with the 95% t-interval
    (:func:`~xmodlm.report.analysis.over_seeds`); ``mixed_pairs`` counts pairs that
    ran on other machines, dtypes or compile modes. None without a pair."""
    by_seed: dict[int, list[float]] = {}
    mixed = 0
    for i, j in pairs(df, runs, refs):
        run, ref = df.iloc[i], df.iloc[j]
        if int(run["seed"]) in skip_seeds:
            continue
        by_seed.setdefault(int(run["seed"]), []).append(float(run["loss"]) - float(ref["loss"]))
        mixed += bool(mixed_pair(run, ref))
    if not by_seed:
        return None
    seeds = sorted(by_seed)
    return {**over_seeds(np.array([np.mean(by_seed[s]) for s in seeds])), "seeds": seeds,
            "mixed_pairs": mixed}


def loss_by_k(df: pd.DataFrame) -> list[dict[str, Any]]:
    """Claim 1, per backbone and budget with the main model at some K: the loss at each
    K (dense as K = 1; per seed first, then mean +- SE over seeds, n), the K of the
    lowest loss, and whether it is interior (neither the smallest nor the largest K
    run there; the paper's U has dense, K = 1, at one end).

    The lowest is judged on the seeds every K has (``common_seeds``; each K's mean
    over them is its ``judged`` loss): where K = 16 has three seeds and K = 8 one, a
    three-seed mean beside a one-seed value would rank the two by their seeds' luck
    (as :func:`xmodlm.report.analysis.learning_rates` judges rates). Without a seed
    in common the all-seed means are ranked."""
    out = []
    for cell, g in _cells(df):
        main = g[g["main"]]
        if main.empty:
            continue
        dense = g[record.is_dense(g["family"])]
        groups = [(False, k, h) for k, h in main.groupby("K")]
        if not dense.empty:
            groups.insert(0, (True, 1.0, dense))
        per_k = [(is_dense, k, _seed_means(rows)) for is_dense, k, rows in groups]
        common = set.intersection(*(set(per_seed.index) for _, _, per_seed in per_k))
        by_k = []
        for is_dense, k, per_seed in per_k:
            stat = mean_se(list(per_seed))
            judged = float(per_seed[sorted(common)].mean()) if common else stat["mean"]
            by_k.append({"K": float(k), "dense": is_dense, "n": stat["n"], "mean": stat["mean"],
                         "se": stat["se"], "judged": judged,
                         "seeds": [int(s) for s in per_seed.index]})
        best = min(range(len(by_k)), key=lambda i: by_k[i]["judged"])
        out.append({**_where(cell), "by_k": by_k, "argmin": by_k[best]["K"],
                    "common_seeds": sorted(int(s) for s in common),
                    "has_dense": by_k[0]["dense"],
                    "interior": bool(0 < best < len(by_k) - 1)})
    return out


def k_star(entry: Mapping[str, Any]) -> dict[str, Any]:
    """The continuous best K of one :func:`loss_by_k` entry: the vertex of the parabola
    in ln K through the argmin and its two neighbours (their ``judged`` losses); the
    argmin itself, flagged ``at_edge``, where it is the smallest or largest K run (no
    minimum is bracketed)."""
    by_k, argmin = entry["by_k"], entry["argmin"]
    i = [e["K"] for e in by_k].index(argmin)
    if not entry["interior"]:
        return {"context": entry["context"], "k_star": argmin, "at_edge": True, "through": [argmin]}
    three = by_k[i - 1:i + 2]
    _, ln_k, _ = fit_parabola(np.log([e["K"] for e in three]),
                              np.array([e["judged"] for e in three]), np.ones(3))
    # three equal losses have no vertex: the argmin stands for it
    return {"context": entry["context"], "k_star": float(np.exp(ln_k)) if np.isfinite(ln_k)
            else argmin, "at_edge": False, "through": [e["K"] for e in three]}


def best_k_growth(by_k: list[dict[str, Any]]) -> dict[str, Any]:
    """Claim 2: K* per context (:func:`k_star`) and the least-squares slope of ln K*
    against ln L with its standard error and 95% t-interval (n - 2 degrees of
    freedom), which needs K* at three or more contexts. Contexts whose K* is at the
    edge of the K run enter the fit with that bound, and are listed."""
    from scipy.stats import t as student_t

    stars = [k_star(e) for e in by_k]
    out: dict[str, Any] = {"by_context": stars, "exponent": None, "se": None, "ci95": None,
                           "n": len(stars), "at_edge": [s["context"] for s in stars if s["at_edge"]],
                           "why": None}
    contexts = {s["context"] for s in stars}
    if len(contexts) < 3:
        out["why"] = f"needs K* at 3 or more contexts; this table has {len(contexts)}"
        return out
    x = np.log([s["context"] for s in stars])
    y = np.log([s["k_star"] for s in stars])
    sxx = float(((x - x.mean()) ** 2).sum())
    slope = float(((x - x.mean()) * (y - y.mean())).sum() / sxx)
    resid = y - y.mean() - slope * (x - x.mean())
    dof = len(x) - 2
    se = float(np.sqrt((resid**2).sum() / dof / sxx))
    half = float(student_t.ppf(0.975, dof)) * se
    out.update(exponent=slope, se=se, ci95=[slope - half, slope + half])
    return out


def best_vs_dense(df: pd.DataFrame) -> list[dict[str, Any]]:
    """Claim 3, per backbone and budget: the main model's best K chosen on seed 0 alone
    (lowest seed-0 loss), then that K minus dense paired by seed on every seed, and
    on the seeds other than 0, which the choice did not see (seed 0's difference is
    biased towards the winner by the choosing)."""
    out = []
    dense = record.is_dense(df["family"]).to_numpy()
    for cell, g in _cells(df):
        seed0 = g[g["main"] & (g["seed"] == 0)]
        if seed0.empty or not record.is_dense(g["family"]).any():
            continue
        losses = seed0.groupby("K")["loss"].mean()
        best = float(losses.idxmin())
        runs = (df["main"] & (df["K"] == best) & df.index.isin(g.index)).to_numpy()
        out.append({**_where(cell), "K": best, "model": model_name(seed0[seed0["K"] == best].iloc[0]),
                    "seed0": {f"{k:g}": float(v) for k, v in losses.items()},
                    "all_seeds": paired_minus(df, runs, dense),
                    "other_seeds": paired_minus(df, runs, dense, skip_seeds=(0,))})
    return out


def ablations(df: pd.DataFrame) -> list[dict[str, Any]]:
    """Claim 4: each ablation (:data:`ABLATIONS`) minus the full model of its K and A,
    paired by seed, per backbone and budget; ranked by mean (rank 1: the mechanism
    whose removal costs the most)."""
    out = []
    for cell, g in _cells(df):
        ablated = g[g["variant"].isin(list(ABLATIONS))]
        for (k, a), rows in ablated.groupby(["K", "A"]):
            full = (g["variant"] == MAIN) & (g["balance"] == MAIN_BALANCE) & (g["K"] == k) & (g["A"] == a)
            refs = df.index.isin(g.index[full])
            entries = []
            for variant, h in rows.groupby("variant"):
                stat = paired_minus(df, df.index.isin(h.index), refs)
                if stat is not None:
                    entries.append({"variant": variant, "name": ABLATIONS[variant],
                                    "paper": PAPER["ablations"][variant], **stat})
            entries.sort(key=lambda e: -e["mean"])
            for rank, e in enumerate(entries, 1):
                e["rank"] = rank
            if entries:
                out.append({**_where(cell), "model": f"A{a:g}K{k:g}", "ablations": entries})
    return out


def moe_vs_xmod(df: pd.DataFrame) -> list[dict[str, Any]]:
    """Claim 5, per backbone and budget with an MoE: the main X-MoD whose total
    parameters are nearest the MoE's, if within :data:`MOE_PARAMS_TOLERANCE`, minus
    the MoE paired by seed, and each of the two minus dense."""
    out = []
    if "params_total" not in df.columns:
        return out
    df = df.assign(params_total=pd.to_numeric(df["params_total"], errors="coerce"))
    dense = record.is_dense(df["family"]).to_numpy()
    for cell, g in _cells(df):
        moe = g[g["family"] == "moe"]
        if moe.empty:
            continue
        moe_params = float(moe["params_total"].median())
        sizes = g[g["main"]].groupby(["K", "A"])["params_total"].median().dropna()
        gap = (sizes - moe_params).abs() / moe_params
        entry: dict[str, Any] = {**_where(cell), "moe_params_total": moe_params,
                                 "tolerance": MOE_PARAMS_TOLERANCE, "model": None,
                                 "moe_minus_dense": paired_minus(df, df.index.isin(moe.index), dense)}
        if len(gap) and gap.min() <= MOE_PARAMS_TOLERANCE:
            k, a = gap.idxmin()
            xmod = df.index.isin(g.index[g["main"] & (g["K"] == k) & (g["A"] == a)])
            entry.update(model=f"A{a:g}K{k:g}", xmod_params_total=float(sizes[(k, a)]),
                         xmod_minus_moe=paired_minus(df, xmod, df.index.isin(moe.index)),
                         xmod_minus_dense=paired_minus(df, xmod, dense))
        out.append(entry)
    return out


def routing_by_bias(df: pd.DataFrame, runs: Mapping[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Claim 6, per balance=none ablation: coverage and adjacent-block Jaccard at the
    last evaluation (mean over windows / block pairs, then mean +- SE over runs;
    :func:`~xmodlm.report.dynamics.summarise`) of the full model's runs paired with
    the ablation's, and of the ablation's. Runs without a record are left out."""
    out = []
    for cell, g in _cells(df):
        for (k, a), rows in g[g["variant"] == "xmod[balance=none]"].groupby(["K", "A"]):
            full = g.index[g["main"] & (g["K"] == k) & (g["A"] == a)]
            matched = pairs(df, df.index.isin(rows.index), df.index.isin(full))
            sides = {"with_bias": [j for _, j in matched], "without_bias": [i for i, _ in matched]}
            entry: dict[str, Any] = {**_where(cell), "model": f"A{a:g}K{k:g}"}
            for side, rows_at in sides.items():
                dyns = [runs[r] for r in df.loc[rows_at, "run_id"].astype(str) if r in runs]
                stats = summarise(dyns) if dyns else {}
                entry[side] = {"runs": len(dyns), "coverage": stats.get("coverage_mean"),
                               "jaccard": stats.get("jaccard_mean")}
            out.append(entry)
    return out


def step_times(df: pd.DataFrame, runs: Mapping[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Claim 7, per backbone and budget with an MoE: each model's median seconds per
    optimiser step (:func:`~xmodlm.report.dynamics.median_step_time`, per run), mean
    +- SE over its runs, and its ratio to dense's mean. Ablations are left out."""
    out = []
    for cell, g in _cells(df):
        if not (g["family"] == "moe").any():
            continue
        models = g[g["main"] | g["family"].isin(["dense", "mod", "moe"])]
        entry: dict[str, Any] = {**_where(cell), "models": [],
                                 "cpu_kinds": sorted(set(g["cpu_kind"].dropna().astype(str)))
                                 if "cpu_kind" in g else []}
        order = {"dense": 0, "xmod": 1, "mod": 2, "moe": 3}
        for _, rows in sorted(models.groupby(["family", "K", "A"], dropna=False),
                              key=lambda kv: (order.get(kv[0][0], 9), kv[0][1], kv[0][2])):
            times = [(runs.get(str(r)) or {}).get("step_s") for r in rows["run_id"]]
            stat = mean_se(times)
            if stat is not None:
                entry["models"].append({"model": model_name(rows.iloc[0]), **stat})
        dense = next((m for m in entry["models"] if m["model"] == record.DENSE), None)
        for m in entry["models"]:
            m["ratio_to_dense"] = m["mean"] / dense["mean"] if dense else None
        if entry["models"]:
            out.append(entry)
    return out
