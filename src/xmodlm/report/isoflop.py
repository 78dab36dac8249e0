"""IsoFLOP profiles: each family's loss against its size at one compute budget.

The question users ask of a sparse architecture is an isoFLOP one: at equal
compute, each family at its best size, which is better? A comparison at one
dense shape answers it only when that shape is the best dense size for the
budget. Here, for every budget (context and compute tier) and every
configuration run at three or more sizes (active parameters N, varied by depth,
width or both), a parabola in ln N is fitted to the losses:

    L(N) = L* + a (ln N - ln N*)^2,    a > 0,

weighted by how many seeds each size has. Its vertex is the configuration's
isoFLOP minimum (N*, L*).

Uncertainty is a bootstrap over seeds. Each replicate redraws every size's
seeds with replacement (its mean then moves as its seed noise says); a size run
with one seed cannot show its own noise, so it is moved by a draw from the
pooled within-size spread of the sizes that have several seeds (a size alone
with no such pool moves not at all, and the interval says so by being narrow
only where seeds were run). Replicates whose parabola opens downward have no
minimum and count against ``bracketed_share``.

A minimum is *bracketed* when the smallest and the largest size tried are each
worse than the best size by more than two standard errors (of their
difference); otherwise the profile has not shown where the minimum is, and its
vertex is an extrapolation (reported, flagged).

Differences of minima (best X-MoD minus best dense, best MoE minus best dense)
are the differences of the two profiles' replicates, paired by replicate index
(the profiles' runs are independent draws), with a 95% percentile interval.

At *equal active size* a routed size is compared with dense of the same N at the
same budget: its mean loss minus the dense parabola at its ln N (only inside the
dense sizes tried: the parabola is not extrapolated), with the same replicate
pairing. Set against the routed run's tokens per parameter, it says where in the
data regime routing pays, apart from where each family's minimum lies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

N_BOOT = 2000
MIN_SIZES = 3


@dataclass
class Profile:
    """One configuration's runs at one budget: per size, the losses of its seeds."""

    key: dict[str, Any]  # context, tier and config (a dict of the configuration's keys)
    sizes: np.ndarray  # active parameters, ascending
    losses: list[np.ndarray] = field(default_factory=list)  # per size, one loss per seed
    tokens: np.ndarray | None = None  # training tokens per size

    @property
    def means(self) -> np.ndarray:
        return np.array([v.mean() for v in self.losses])

    def pooled_sd(self) -> float | None:
        """Within-size standard deviation pooled over sizes with >= 2 seeds."""
        dev = [v - v.mean() for v in self.losses if len(v) > 1]
        dof = sum(len(d) - 1 for d in dev)
        return float(np.sqrt(sum(float((d**2).sum()) for d in dev) / dof)) if dof else None


def parabola_coefs(ln_n: np.ndarray, loss: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Weighted least squares of loss = c0 + c1 x + c2 x^2 in x = ln N - x0, x0 the
    weighted mean of ln N (centred for conditioning): (x0, c0, c1, c2)."""
    x0 = float(np.average(ln_n, weights=weight))
    x = ln_n - x0
    design = np.stack([np.ones_like(x), x, x**2], axis=1)
    sw = np.sqrt(weight)
    coef, *_ = np.linalg.lstsq(design * sw[:, None], loss * sw, rcond=None)
    return np.array([x0, *coef])


def parabola_at(coefs: np.ndarray, ln_n: float) -> np.ndarray:
    """The parabola(s) of :func:`parabola_coefs` (one row, or one per replicate) at ln N."""
    x0, c0, c1, c2 = np.moveaxis(np.asarray(coefs), -1, 0)
    x = ln_n - x0
    return c0 + c1 * x + c2 * x**2


def fit_parabola(ln_n: np.ndarray, loss: np.ndarray, weight: np.ndarray) -> tuple[float, float, float]:
    """:func:`parabola_coefs`, as (curvature a, ln N*, L*). a <= 0: no minimum (ln N*
    and L* are then NaN)."""
    x0, c0, c1, c2 = (float(c) for c in parabola_coefs(ln_n, loss, weight))
    if c2 <= 0:
        return c2, float("nan"), float("nan")
    return c2, x0 - c1 / (2 * c2), c0 - c1**2 / (4 * c2)


def minimum(profile: Profile, n_boot: int = N_BOOT, seed: int = 0) -> dict[str, Any]:
    """The profile's isoFLOP minimum with bootstrap intervals (module docstring)."""
    ln_n = np.log(profile.sizes)
    counts = np.array([len(v) for v in profile.losses], dtype=float)
    a, x_star, l_star = fit_parabola(ln_n, profile.means, counts)
    rng = np.random.default_rng(seed)
    pooled = profile.pooled_sd()
    draws = np.empty((n_boot, 2))
    mean_draws = np.empty((n_boot, len(profile.sizes)))
    coef_draws = np.empty((n_boot, 4))
    for b in range(n_boot):
        means = np.array([
            rng.choice(v, len(v)).mean() if len(v) > 1
            else v[0] + (rng.normal(0.0, pooled) if pooled is not None else 0.0)
            for v in profile.losses
        ])
        mean_draws[b] = means
        coef_draws[b] = parabola_coefs(ln_n, means, counts)
        _, draws[b, 0], draws[b, 1] = fit_parabola(ln_n, means, counts)
    ok = np.isfinite(draws[:, 1])
    best = int(np.argmin(profile.means))
    se = _size_se(profile, pooled)
    ends = [0, len(profile.sizes) - 1]
    # without any size run at several seeds the SEs are 0 and "worse by 2 SE" says
    # nothing: the bracket is unknown (None), not shown
    bracketed = None if pooled is None else best not in ends and all(
        profile.means[e] - profile.means[best] > 2 * np.hypot(se[e], se[best]) for e in ends
    )
    out: dict[str, Any] = {
        **profile.key,
        "sizes": [float(s) for s in profile.sizes],
        "seeds": [len(v) for v in profile.losses],
        "mean_loss": [float(m) for m in profile.means],
        "best_size": float(profile.sizes[best]),
        "bracketed": bracketed,
        "curvature": a,
        "n_star": float(np.exp(x_star)) if np.isfinite(x_star) else None,
        "loss_star": l_star if np.isfinite(l_star) else None,
        "n_star_ci95": _interval(np.exp(draws[ok, 0])),
        "loss_star_ci95": _interval(draws[ok, 1]),
        "bracketed_share": float(ok.mean()),
        "pooled_seed_sd": pooled,
        "_draws": draws[:, 1],
        "_mean_draws": mean_draws,
        "_coefs": parabola_coefs(ln_n, profile.means, counts),
        "_coef_draws": coef_draws,
    }
    if profile.tokens is not None:
        out["tokens_per_param"] = [float(t / n) for t, n in zip(profile.tokens, profile.sizes, strict=True)]
    return out


def _size_se(profile: Profile, pooled: float | None) -> np.ndarray:
    """Standard error of each size's mean: its own seeds' where it has several,
    else the pooled spread (0 without one)."""
    out = []
    for v in profile.losses:
        sd = float(v.std(ddof=1)) if len(v) > 1 else (pooled or 0.0)
        out.append(sd / np.sqrt(len(v)))
    return np.array(out)


def _interval(x: np.ndarray) -> list[float] | None:
    x = x[np.isfinite(x)]
    return [float(np.percentile(x, 2.5)), float(np.percentile(x, 97.5))] if len(x) else None


def difference(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Minimum loss of ``a`` minus that of ``b`` (:func:`minimum` results), with the
    95% interval of the replicate differences; ``resolved`` when it excludes 0."""
    d = a["_draws"] - b["_draws"]
    ci = _interval(d) if _has_noise(a, b) else None
    point = (a["loss_star"] - b["loss_star"]
             if a["loss_star"] is not None and b["loss_star"] is not None else None)
    return {"minus": point, "ci95": ci,
            "resolved": bool(ci is not None and (ci[0] > 0 or ci[1] < 0)),
            "both_bracketed": bool(a["bracketed"] and b["bracketed"])}


def _has_noise(*minima: dict[str, Any]) -> bool:
    """Whether every profile shows its seed noise (some size with several seeds): a
    profile of single seeds has replicates that never move, so an interval from it
    would be zero-wide and say nothing."""
    return all(m["pooled_seed_sd"] is not None for m in minima)


def equal_size(routed: dict[str, Any], dense: dict[str, Any]) -> list[dict[str, Any]]:
    """Each routed size inside the dense sizes tried: its mean loss minus the dense
    parabola at its ln N, with the 95% interval of the replicate differences (module
    docstring), and its tokens per parameter where recorded."""
    lo, hi = np.log(dense["sizes"][0]), np.log(dense["sizes"][-1])
    out = []
    for i, n in enumerate(routed["sizes"]):
        x = float(np.log(n))
        if not lo <= x <= hi:
            continue
        d = routed["_mean_draws"][:, i] - parabola_at(dense["_coef_draws"], x)
        ci = _interval(d) if _has_noise(routed, dense) else None
        out.append({
            "params_active": float(n),
            "tokens_per_param": (routed.get("tokens_per_param") or [None] * len(routed["sizes"]))[i],
            "seeds": routed["seeds"][i],
            "minus": float(routed["mean_loss"][i] - parabola_at(dense["_coefs"], x)),
            "ci95": ci,
            "resolved": bool(ci is not None and (ci[0] > 0 or ci[1] < 0)),
        })
    return out


def profiles(df: pd.DataFrame, config_keys: tuple[str, ...]) -> list[Profile]:
    """Every configuration run at >= :data:`MIN_SIZES` sizes on one budget.

    ``df``: finished runs with ``context``, ``tier``, ``params_active``, ``loss``
    (the causal loss), ``seed`` and the ``config_keys`` columns; ``tokens`` where
    present."""
    out: list[Profile] = []
    if "params_active" not in df.columns:
        return out
    df = df.assign(params_active=pd.to_numeric(df["params_active"], errors="coerce"))
    df = df[np.isfinite(df["params_active"])]
    keys = ["context", "tier", *config_keys]
    for key, group in df.groupby(keys, dropna=False):
        sizes = np.sort(group["params_active"].astype(float).unique())
        if len(sizes) < MIN_SIZES:
            continue
        losses = [group.loc[group["params_active"] == n, "loss"].to_numpy(float) for n in sizes]
        tokens = None
        if "tokens" in group:
            tokens = np.array([float(group.loc[group["params_active"] == n, "tokens"].iloc[0])
                               for n in sizes])
        where = dict(zip(keys, key, strict=True))
        where = {"context": where.pop("context"), "tier": where.pop("tier"), "config": where}
        out.append(Profile(where, sizes, losses, tokens))
    return out


def isoflop(df: pd.DataFrame, config_keys: tuple[str, ...], n_boot: int = N_BOOT) -> list[dict[str, Any]]:
    """Per budget: each configuration's minimum, and every non-dense minimum minus
    the dense one (:func:`difference`)."""
    found = [minimum(p, n_boot) for p in profiles(df, config_keys)]
    out = []
    for (context, tier), group in pd.DataFrame(
        [{"context": m["context"], "tier": m["tier"], "i": i} for i, m in enumerate(found)]
    ).groupby(["context", "tier"]) if found else []:
        mins = [found[i] for i in group["i"]]
        dense = [m for m in mins if m["config"].get("family") == "dense"]
        entry = {"context": int(context), "tier": float(tier), "minima": mins, "vs_dense": []}
        if dense:
            for m in mins:
                if m is not dense[0]:
                    entry["vs_dense"].append({"config": m["config"], **difference(m, dense[0]),
                                              "equal_size": equal_size(m, dense[0])})
        out.append(entry)
    for entry in out:
        for m in entry["minima"]:
            for key in [k for k in m if k.startswith("_")]:
                m.pop(key)
    return out


# --- rendering ------------------------------------------------------------------------


def profile_name(config: dict[str, Any], config_label: Any) -> str:
    """A profile's configuration as tables and figures name it: ``dense``, or
    ``config_label(tuple of config values)``."""
    return "dense" if config.get("family") == "dense" else config_label(tuple(config.values()))


def isoflop_markdown(entries: list[dict[str, Any]], config_label: Any, plot: str | None = None) -> list[str]:
    """The report section of :func:`isoflop` (empty without a profile);
    ``config_label(tuple of config values)`` names a configuration; ``plot``, the
    profiles' figure beside the report, if drawn."""
    if not entries:
        return []
    lines = ["", "## IsoFLOP profiles", "",
             "Each configuration run at three or more sizes on a budget: a parabola in ln N"
             " (active parameters) through its mean causal losses, weighted by seeds; its"
             " vertex is the isoFLOP minimum, with 95% bootstrap intervals over seeds."
             " Bracketed: the smallest and largest sizes are each worse than the best by"
             " more than 2 SE (else the vertex is an extrapolation).", ""]
    def name(config: dict[str, Any]) -> str:
        return profile_name(config, config_label)

    def ci_text(ci: list[float] | None, fmt: str) -> str:
        return f"[{ci[0]:{fmt}}, {ci[1]:{fmt}}]" if ci else "(no interval: one seed a size)"

    for e in entries:
        lines += [f"**T = {e['context']}, C = {e['tier']:.2g}**", "",
                  "| configuration | sizes (N) | best size | N* [95%] | L* [95%] | bracketed |",
                  "|---|---|---|---|---|---|"]
        for m in e["minima"]:
            noisy = m["pooled_seed_sd"] is not None
            n_ci = m["n_star_ci95"] if noisy else None
            l_ci = m["loss_star_ci95"] if noisy else None
            n_star = _num(m["n_star"], ".3g")
            if m["n_star"] is not None and not m["sizes"][0] <= m["n_star"] <= m["sizes"][-1]:
                n_star += " (outside the sizes run)"
            bracket = {True: "yes", False: "no", None: "unknown (one seed a size)"}[m["bracketed"]]
            lines.append(
                f"| {name(m['config'])} | {len(m['sizes'])}: {m['sizes'][0]:.2g}-{m['sizes'][-1]:.2g} |"
                f" {m['best_size']:.2g} | {n_star} {ci_text(n_ci, '.3g')} |"
                f" {_num(m['loss_star'], '.4f')} {ci_text(l_ci, '.4f')} | {bracket} |")
        for d in e["vs_dense"]:
            routed = name(d["config"])
            lines.append(f"\nBest {routed} minus best dense:"
                         f" {_num(d['minus'], '+.4f')} {ci_text(d['ci95'], '+.4f')}"
                         f"{' (resolved)' if d['resolved'] else ''}"
                         f"{'' if d['both_bracketed'] else ' (a minimum not bracketed)'}")
            if d.get("equal_size"):
                lines += ["", f"{routed} minus dense at equal active size (the dense parabola"
                          " at the same N):", "",
                          "| N | tokens / param | seeds | minus dense [95%] |", "|---|---|---|---|"]
                for q in d["equal_size"]:
                    tpp = "-" if q["tokens_per_param"] is None else f"{q['tokens_per_param']:.0f}"
                    lines.append(f"| {q['params_active']:.3g} | {tpp} | {q['seeds']} |"
                                 f" {q['minus']:+.4f} {ci_text(q['ci95'], '+.4f')}"
                                 f"{' *' if q['resolved'] else ''} |")
        lines.append("")
    if plot:
        lines += [f"![isoFLOP profiles]({plot})", ""]
    return lines



def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)
