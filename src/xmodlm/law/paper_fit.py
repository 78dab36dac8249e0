"""The paper's fit of Eq. 14 (its appendix B.5), its bootstrap and grouped held-out tests.

**Two stages.** Stage 1 fits the base law (e, u, w and the exponents etaN, rhoN,
etaL, rhoL) on the A = 1 runs, where the anchor term is 0. Stage 2 holds the
base terms and fits the anchor interaction (z, rhoK, rhoA) with e solved again,
on every run (the A = 1 runs, whose anchor feature is 0, pin e; the A-sweep sets
z). In each stage differential evolution (scipy) searches the exponents, and for
each candidate the linear coefficients are solved by non-negative least squares
(scipy's NNLS) with e free: the columns and the target are centred by their
(weighted) means, which is exactly the least-squares e for any u, w, z, and e is
then the mean residual. Seeded (one seed gives one fit) and reproducible.

**Bootstrap.** Replicates draw configurations with replacement (all seeds of a
configuration come along) and refit both stages from the full fit's exponents;
intervals are 2.5/97.5 percentiles.

**Grouped held-out tests** (B.5): leave one context out and leave one scale out
(whole groups of A = 1 runs, base law refitted on the rest); leave one A out
(the base law on all A = 1 runs, the anchor term on the A-sweep without one A
group; A = 1 is the baseline and never held out); and an out-of-range group
named before fitting (a spec's ``out_of_range``), excluded from every fit and
predicted by the law fitted on everything else. Each is scored on the raw loss
(L_hat = L_dense_hat + Delta_hat; against the same reference, its error is the
Delta error) by RMSE, MAE, the share inside +-0.02 nats and R^2_Delta, each
beside the constant-Delta baseline (the mean Delta of the training runs): a law
earns trust only by beating that on held-out groups.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd
from scipy.optimize import differential_evolution, nnls

from xmodlm.errors import UserError
from xmodlm.law import paper

STAGE1 = ("eta_n", "rho_n", "eta_l", "rho_l")
STAGE2 = ("rho_k", "rho_a")
BOUNDS = {"eta_n": (0.0, 1.5), "rho_n": (0.05, 3.0), "eta_l": (0.0, 2.0), "rho_l": (0.05, 2.0),
          "rho_k": (0.05, 2.0), "rho_a": (0.05, 3.0)}
NEUTRAL = {"rho_k": 1.0, "rho_a": 1.0}  # stage 2 without an A-sweep: z = 0, exponents moot
BAND = 0.02  # nats: the paper's visual band, here a score
PROTOCOLS = ("leave-context-out", "leave-scale-out", "leave-a-out")
COLUMNS = ("params_active", "params_total", "context", "sparsity", "anchor_stride", "delta")
DE_ITER = 300
DE_ITER_BOOT = 60  # replicates start from the full fit's exponents


def point_of(frame: pd.DataFrame) -> paper.Point:
    return paper.Point.of(*(frame[c].to_numpy(float) for c in COLUMNS[:5]))


def _solve(columns: np.ndarray, signs: np.ndarray, y: np.ndarray, w: np.ndarray
           ) -> tuple[float, np.ndarray, float]:
    """e free, coefficients c >= 0 of y ~ e + sum_j signs_j c_j columns_j by weighted
    NNLS on centred data; returns (e, c, weighted mean squared residual)."""
    wn = w / w.sum()
    xm, ym = wn @ columns, wn @ y
    sw = np.sqrt(wn)[:, None]
    design = (columns - xm) * signs * sw
    if not np.all(np.isfinite(design)):
        return float(ym), np.zeros(columns.shape[1]), np.inf
    c, _ = nnls(design, (y - ym) * sw[:, 0], maxiter=50 * columns.shape[1] + 50)
    e = float(ym - (xm * signs) @ c)
    r = y - e - (columns * signs) @ c
    return e, c, float(wn @ r**2)


def _stage1_columns(x: paper.Point, p: Mapping[str, float]) -> np.ndarray:
    f = paper.features(x, {**paper.TABLE8, **p})
    return np.column_stack([f["capacity"], f["context"]])


def _stage2_columns(x: paper.Point, p: Mapping[str, float]) -> np.ndarray:
    return paper.features(x, {**paper.TABLE8, **p})["anchor"][:, None]


def _de(objective: Any, names: tuple[str, ...], seed: int, x0: np.ndarray | None,
        maxiter: int) -> np.ndarray:
    res = differential_evolution(
        objective, [BOUNDS[n] for n in names], seed=seed, maxiter=maxiter, popsize=15,
        tol=1e-10, polish=True, init="sobol" if x0 is None else "latinhypercube", x0=x0,
    )
    return np.asarray(res.x, dtype=float)


def fit_two_stage(x: paper.Point, y: np.ndarray, w: np.ndarray | None = None, seed: int = 0,
                  start: Mapping[str, float] | None = None, maxiter: int = DE_ITER
                  ) -> dict[str, float]:
    """Eq. 14 fitted to Delta ``y`` at ``x`` (weights ``w``: bootstrap counts) in the
    paper's two stages; ``start`` seeds differential evolution with known exponents."""
    w = np.ones(len(y)) if w is None else np.asarray(w, dtype=float)
    base = (x.anchor_stride == 1) & (w > 0)
    if base.sum() < 6:
        seen = ", ".join(f"{a:g}" for a in np.unique(x.anchor_stride[w > 0])[:8])
        raise UserError(
            f"stage 1 of the paper's fit needs at least 6 runs at anchor stride A = 1 (its"
            f" K and L sweeps); got {int(base.sum())} (A values: {seen}); an (S, c) sweep"
            " has A = (S - 1) c, rarely 1: use the ln-ratio forms for it")
    xb, yb, wb = x.subset(base), y[base], w[base]
    signs1 = np.array([-1.0, 1.0])

    def obj1(theta: np.ndarray) -> float:
        return _solve(_stage1_columns(xb, dict(zip(STAGE1, theta, strict=True))), signs1,
                      yb, wb)[2]

    x0 = None if start is None else np.clip([start[n] for n in STAGE1],
                                             *np.array([BOUNDS[n] for n in STAGE1]).T)
    theta1 = _de(obj1, STAGE1, seed, x0, maxiter)
    p = dict(zip(STAGE1, theta1, strict=True))
    e, (u, w_ctx), _ = _solve(_stage1_columns(xb, p), signs1, yb, wb)
    p.update(e=e, u=float(u), w=float(w_ctx))
    base_all = p["e"] - p["u"] * _stage1_columns(x, p)[:, 0] + p["w"] * _stage1_columns(x, p)[:, 1]
    rest = y - (base_all - p["e"])
    swept = (x.anchor_stride != 1) & (w > 0)
    if len(np.unique(x.anchor_stride[swept])) < 1 or swept.sum() < 3:
        p.update(z=0.0, **NEUTRAL)
        return {n: float(p[n]) for n in paper.NAMES}
    keep = w > 0
    x2, y2, w2 = x.subset(keep), rest[keep], w[keep]
    signs2 = np.array([-1.0])

    def obj2(theta: np.ndarray) -> float:
        return _solve(_stage2_columns(x2, dict(zip(STAGE2, theta, strict=True))), signs2,
                      y2, w2)[2]

    x0 = None if start is None else np.clip([start[n] for n in STAGE2],
                                             *np.array([BOUNDS[n] for n in STAGE2]).T)
    theta2 = _de(obj2, STAGE2, seed + 1, x0, maxiter)
    p.update(zip(STAGE2, theta2, strict=True))
    e, (z,), _ = _solve(_stage2_columns(x2, p), signs2, y2, w2)
    p.update(e=e, z=float(z))
    return {n: float(p[n]) for n in paper.NAMES}


def configurations(frame: pd.DataFrame) -> np.ndarray:
    """An id per configuration (seeds of one share it): the bootstrap's unit."""
    keys = [c for c in ("params_active", "params_total", "context", "sparsity", "anchor_stride",
                        "dense_prefix") if c in frame]
    return frame.groupby(keys, sort=True).ngroup().to_numpy()


def bootstrap(frame: pd.DataFrame, value: Mapping[str, float], n_boot: int, seed: int
              ) -> np.ndarray:
    """(n_boot, 10) refits on configurations drawn with replacement."""
    x, y = point_of(frame), frame["delta"].to_numpy(float)
    config = configurations(frame)
    ids = np.unique(config)
    rng = np.random.default_rng(seed)
    out = np.empty((n_boot, len(paper.NAMES)))
    for b in range(n_boot):
        counts = np.bincount(rng.choice(len(ids), len(ids)), minlength=len(ids))
        w = counts[np.searchsorted(ids, config)].astype(float)
        try:
            p = fit_two_stage(x, y, w, seed=seed + 2 * b + 2, start=value, maxiter=DE_ITER_BOOT)
        except UserError:  # a draw with too few A = 1 runs: the full fit stands in
            p = dict(value)
        out[b] = [p[n] for n in paper.NAMES]
    return out


def scores(observed: np.ndarray, predicted: np.ndarray, baseline: np.ndarray) -> dict[str, Any]:
    """Held-out scores of the raw loss (error = the Delta error against the same
    reference) for the law and for the constant-Delta baseline."""
    def one(pred: np.ndarray) -> dict[str, float]:
        err = pred - observed
        return {"rmse": float(np.sqrt(np.mean(err**2))), "mae": float(np.mean(np.abs(err))),
                "within_band": float(np.mean(np.abs(err) <= BAND)),
                "r2_delta": paper.r2(observed, pred)}

    law, const = one(predicted), one(baseline)
    return {"n": int(len(observed)), **law, "baseline": const,
            "beats_baseline": bool(law["rmse"] < const["rmse"])}


def scales(n_act: np.ndarray) -> np.ndarray:
    """Each run's scale: the smallest N_act of its backbone, runs within
    :data:`xmodlm.law.paper.SIZE_RTOL` of one another being one backbone (a sparse
    model's routers add a little to its N_act; a held-out scale is a backbone)."""
    out = np.empty(len(n_act))
    start = -np.inf
    for i in np.argsort(n_act, kind="stable"):
        if n_act[i] > start * (1 + paper.SIZE_RTOL):
            start = n_act[i]
        out[i] = start
    return out


def _groups(frame: pd.DataFrame, protocol: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows that take part, the group label of each row, the key a held-out row must
    share with some training row to be scored) of a protocol."""
    a1 = frame["anchor_stride"].to_numpy(float) == 1
    n_act, ctx = scales(frame["params_active"].to_numpy(float)), frame["context"].to_numpy(float)
    if protocol == "leave-context-out":
        return a1, ctx, n_act
    if protocol == "leave-scale-out":
        return a1, n_act, ctx
    if protocol == "leave-a-out":
        pair = pd.factorize(pd.Series(list(zip(n_act, ctx, strict=True))))[0].astype(float)
        return np.ones(len(frame), dtype=bool), frame["anchor_stride"].to_numpy(float), pair
    raise UserError(f"holdout {protocol!r}: must be one of {', '.join(PROTOCOLS)}")


def heldout(frame: pd.DataFrame, protocol: str, seed: int = 0) -> dict[str, Any]:
    """Each group of ``protocol`` held out in turn and predicted by the law refitted on
    the rest; scores pooled over every held-out prediction.

    A held-out run is scored where its sweep continues in the training runs: a
    held-out context on the sizes that other contexts have, a held-out scale on the
    contexts that other scales have, a held-out A at the (N_act, L) of the other
    A groups. Holding out the one size of the context sweep leaves no context
    variation to fit etaL from, and its runs at other contexts would test a
    parameter no fit could have; they are counted as ``not_scored``."""
    rows, label, key = _groups(frame, protocol)
    values = np.unique(label[rows & ~((protocol == "leave-a-out") & (label == 1))])
    if len(values) < (2 if protocol == "leave-a-out" else 3):
        return {"not_applicable": f"{protocol} needs more groups than {len(values)}"
                f" ({', '.join(f'{v:g}' for v in values)})"}
    x, y = point_of(frame), frame["delta"].to_numpy(float)
    obs, pred, base, where = [], [], [], []
    not_scored = 0
    for i, v in enumerate(values):
        held = rows & (label == v)
        train = rows & ~held
        test = held & np.isin(key, key[train])
        not_scored += int(held.sum() - test.sum())
        if not test.any():
            continue
        p = fit_two_stage(x.subset(train), y[train], seed=seed + 10 * i)
        obs.append(y[test])
        pred.append(paper.delta(x.subset(test), p))
        base.append(np.full(test.sum(), y[train].mean()))
        where += [float(v)] * int(test.sum())
    if not obs:
        return {"not_applicable": f"{protocol}: no held-out run shares a sweep with the rest"}
    observed, predicted = np.concatenate(obs), np.concatenate(pred)
    out = scores(observed, predicted, np.concatenate(base))
    out["groups"] = [float(v) for v in values]
    out["not_scored"] = not_scored
    # every scored run, for the predicted-against-true plot
    out["points"] = {"observed": observed.tolist(), "predicted": predicted.tolist(),
                     "group": where}
    return out


def out_of_range_mask(frame: pd.DataFrame, spec: Mapping[str, float] | None) -> np.ndarray:
    """Rows named out of range by ``spec`` ({column: threshold}: a run at or above any
    threshold is out of range), e.g. {"context": 65536, "params_active": 1.65e9}."""
    mask = np.zeros(len(frame), dtype=bool)
    for column, threshold in (spec or {}).items():
        if column not in frame:
            raise UserError(f"out-of-range group names column {column!r}, which the runs lack")
        mask |= frame[column].to_numpy(float) >= float(threshold) * (1 - 1e-9)
    return mask


def _span(values: pd.Series) -> list[float]:
    return [float(values.min()), float(values.max())]


def fit_paper(frame: pd.DataFrame, n_boot: int = 200, seed: int = 0,
              out_of_range: Mapping[str, float] | None = None,
              protocols: tuple[str, ...] = PROTOCOLS, name: str = "fitted",
              reference: dict[str, Any] | None = None) -> paper.PaperLaw:
    """Eq. 14 fitted to the sparse runs of ``frame`` (columns ``COLUMNS``; ``delta`` is
    each run's loss minus its dense reference, :mod:`xmodlm.law.reference`), with the
    bootstrap and every grouped held-out test. Runs named by ``out_of_range`` are left
    out of every fit and predicted at the end."""
    started = time.perf_counter()
    missing = [c for c in COLUMNS if c not in frame]
    if missing:
        raise UserError(f"the paper's fit needs column(s) {', '.join(missing)}")
    frame = frame.reset_index(drop=True)
    oor = out_of_range_mask(frame, out_of_range)
    fitted = frame[~oor].reset_index(drop=True)
    x, y = point_of(fitted), fitted["delta"].to_numpy(float)
    value = fit_two_stage(x, y, seed=seed)
    pred = paper.delta(x, value)
    metrics: dict[str, Any] = {
        "in_fit": {"n": len(y), "rmse": float(np.sqrt(np.mean((pred - y) ** 2))),
                   "r2_delta": paper.r2(y, pred)},
        "heldout": {p: heldout(fitted, p, seed) for p in protocols},
    }
    if oor.any():
        far = frame[oor]
        metrics["out_of_range"] = {
            "spec": dict(out_of_range or {}),
            **scores(far["delta"].to_numpy(float), paper.delta(point_of(far), value),
                     np.full(len(far), y.mean())),
        }
    samples = bootstrap(fitted, value, n_boot, seed) if n_boot else None
    metrics["fit_seconds"] = time.perf_counter() - started
    sparse = fitted["sparsity"] > 1
    ranges = {"sparsity": _span(fitted.loc[sparse, "sparsity"]),
              "anchor_stride": _span(fitted.loc[sparse, "anchor_stride"]),
              "context": _span(fitted["context"]),
              "params_active": _span(fitted["params_active"])}
    provenance = {
        "fit": "two stages (A = 1 runs, then the anchor term on all runs); exponents by"
               " differential evolution, e free, u, w, z >= 0 by NNLS on centred columns",
        "runs": int(len(fitted)), "configurations": int(len(np.unique(configurations(fitted)))),
        "out_of_range_runs": int(oor.sum()), "seed": seed, "n_boot": n_boot,
        "counts": "N = params_total, N_act = params_active as the runs give them",
    }
    return paper.PaperLaw(name, value, ranges, provenance, samples, metrics, reference)
