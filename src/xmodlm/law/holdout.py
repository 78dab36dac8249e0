"""Held-out validation, built in (DESIGN 5.3): refit without some runs, predict them.

Protocols (each refits the dense law and every delta form on the runs it keeps):

* ``leave-cell-out``: each (S, c) cell of X-MoD runs is left out in turn; the
  dense runs always stay, so this tests the delta law on unseen routing configs;
* ``top-compute``: every run (dense and X-MoD) in the top compute tier of its
  context is left out (of each context with two tiers or more: budgets differ by
  context), so the whole law extrapolates in scale;
* ``longest-context``: the X-MoD runs at the longest context are left out; the
  dense runs there stay (the dense law is per context, and the question is
  whether the sparse-context correction extrapolates).

Scores on the pooled held-out runs: RMSE and MAE of ln L, the ratio of held-out
to in-fit RMSE (in-fit: the same refits on the runs they kept), and two ranking
scores computed *within a choice*: the configurations that compete for the
same dense reference (width), budget (compute tier) and context, which is the
choice the recommender makes. Kendall tau between predicted and observed loss
of those configurations (seeds averaged; pair-weighted over groups), and the
regret of choosing the predicted-best configuration in each group: its observed
ln L minus the best observed, averaged over groups. The same scores pooled over
widths (``*_pooled``) are kept for reference: they mostly measure that wider
models are better, which any law gets right.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy.stats import kendalltau

from xmodlm.errors import UserError
from xmodlm.law.delta import Features, Form, fit_delta
from xmodlm.law.dense import DenseFit, fit_dense, log_loss_at

PROTOCOLS = {
    "leave-cell-out": "each (stride, capacity) cell of X-MoD runs left out in turn",
    "top-compute": "all runs in the top compute tier of each context left out",
    "longest-context": "X-MoD runs at the longest context left out",
}
DENSE_ONLY = "dense"  # the name of the law when the table has no X-MoD runs
_CONFIG = ["tier", "context", "params_active", "tokens", "stride", "capacity"]
CHOICE = ["tier", "context", "width"]  # one choice: dense reference, budget, context
POOLED = ["tier", "context"]


@dataclass(frozen=True)
class Fold:
    label: str
    test: np.ndarray  # bool over the frame's rows: the runs this fold holds out


def check_protocol(protocol: str) -> str:
    if protocol not in PROTOCOLS:
        raise UserError(f"unknown holdout protocol {protocol!r}; known: {', '.join(PROTOCOLS)}")
    return protocol


def _cells(frame: pd.DataFrame) -> list[tuple[int, float]]:
    sparse = frame[frame["is_sparse"]]
    return sorted(set(zip(sparse["stride"], sparse["capacity"], strict=True)))


def default_protocol(frame: pd.DataFrame) -> str | None:
    """leave-cell-out when there are two or more cells, else top-compute, else none."""
    if len(_cells(frame)) >= 2:
        return "leave-cell-out"
    if frame.groupby("context")["tier"].nunique().max() >= 2:
        return "top-compute"
    return None


def folds(frame: pd.DataFrame, protocol: str) -> list[Fold]:
    """The folds of ``protocol`` on validated runs; UserError when it does not apply."""
    check_protocol(protocol)
    sparse = frame["is_sparse"].to_numpy()
    if protocol == "leave-cell-out":
        cells = _cells(frame)
        if len(cells) < 2:
            raise UserError(
                f"holdout leave-cell-out needs X-MoD runs in at least 2 (stride, capacity) cells;"
                f" the table has {len(cells)}"
            )
        stride, capacity = frame["stride"].to_numpy(), frame["capacity"].to_numpy()
        return [Fold(f"S={s} c={c:g}", sparse & (stride == s) & (capacity == c)) for s, c in cells]
    if protocol == "top-compute":
        # per context: FLOP-matching at another context gives other budgets, so the
        # top tier overall could be one context's alone
        tier, context = frame["tier"].to_numpy(), frame["context"].to_numpy()
        test, tops = np.zeros(len(frame), dtype=bool), []
        for t in np.unique(context):
            tiers = np.unique(tier[context == t])
            if len(tiers) >= 2:
                test |= (context == t) & (tier == tiers[-1])
                tops.append(f"~1e{tiers[-1]:g}" + (f" at T={t}" if t else ""))
        if not tops:
            raise UserError(
                "holdout top-compute needs runs in at least 2 compute tiers (factor ~1.8 apart)"
                " at some context"
            )
        return [Fold(f"compute {', '.join(tops)}", test)]
    contexts = np.unique(frame.loc[frame["is_sparse"], "context"])
    if len(contexts) < 2:
        raise UserError("holdout longest-context needs X-MoD runs at 2 or more context lengths")
    return [Fold(f"context {contexts[-1]}", sparse & (frame["context"].to_numpy() == contexts[-1]))]


@dataclass(frozen=True)
class HeldOut:
    """One law's pooled held-out predictions under a protocol, and their scores."""

    protocol: str
    rows: np.ndarray  # positions of the held-out runs in the frame
    ln_pred: np.ndarray
    ln_obs: np.ndarray
    metrics: dict[str, float | int | None]


def score(test: pd.DataFrame, ln_obs: np.ndarray, ln_pred: np.ndarray, in_fit_rmse: float) -> dict:
    """Held-out metrics of predictions for the runs in ``test`` (see the module doc)."""
    err = ln_pred - ln_obs
    rmse = float(np.sqrt(np.mean(err**2)))
    choice = CHOICE if "width" in test else POOLED
    keys = _CONFIG + (["width"] if "width" in test else [])
    configs = test[keys].assign(obs=ln_obs, pred=ln_pred).groupby(keys, as_index=False).mean()
    within, pooled = _ranking(configs, choice), _ranking(configs, POOLED)
    return {
        "n": len(ln_obs),
        "rmse": rmse,
        "mae": float(np.mean(np.abs(err))),
        "in_fit_rmse": in_fit_rmse,
        "ratio": rmse / in_fit_rmse if in_fit_rmse > 0 else None,
        "kendall_tau": within["tau"],
        "regret": within["regret"],
        "ranked_groups": within["groups"],
        "choice": "+".join(choice),
        "kendall_tau_pooled": pooled["tau"],
        "regret_pooled": pooled["regret"],
    }


def _ranking(configs: pd.DataFrame, by: list[str]) -> dict[str, float | int | None]:
    """Kendall tau (pair-weighted mean) and regret (mean) over the groups ``by``."""
    taus, pairs, regrets = [], [], []
    for _, group in configs.groupby(by):
        if len(group) < 2:
            continue
        obs, pred = group["obs"].to_numpy(), group["pred"].to_numpy()
        regrets.append(float(obs[np.argmin(pred)] - obs.min()))
        tau = kendalltau(pred, obs).statistic
        if np.isfinite(tau):
            taus.append(tau)
            pairs.append(len(group) * (len(group) - 1) / 2)
    return {
        "tau": float(np.average(taus, weights=pairs)) if taus else None,
        "regret": float(np.mean(regrets)) if regrets else None,
        "groups": len(regrets),
    }


def evaluate(
    frame: pd.DataFrame,
    protocol: str,
    forms: Sequence[Form],
    dense_fits: Mapping[int, DenseFit],
    reference: Mapping[str, float],
    rng: np.random.Generator,
    ln_paired: np.ndarray | None = None,
) -> tuple[dict[str, HeldOut], dict[str, str]]:
    """Held-out results per law (each form, or ``DENSE_ONLY``) and forms that could not be refitted.

    The dense law of a context is refitted only when the fold holds out some of
    its dense runs; otherwise the full-data fit is the same refit and is reused.
    ``ln_paired``: under the paired baseline, each sparse run's dense partner's
    ln L (one entry per row): a sparse run is then predicted as its partner's
    observed loss plus the delta refitted without it, so the protocols test the
    delta law given the dense reference, which is what that baseline claims; only
    sparse runs are scored then, and the dense law (if any) is not refitted.
    """
    fold_list = folds(frame, protocol)
    ln_n = np.log(frame["params_active"].to_numpy(float))
    ln_d = np.log(frame["tokens"].to_numpy(float))
    ln_l = np.log(frame["val_loss"].to_numpy(float))
    context = frame["context"].to_numpy()
    sparse = frame["is_sparse"].to_numpy()
    x = Features.of(frame[sparse], reference) if sparse.any() else None
    laws: list[Form | None] = list(forms) or [None]
    names = [f.name if f else DENSE_ONLY for f in laws]
    pred = {name: np.full(len(frame), np.nan) for name in names}
    in_fit = {name: [] for name in names}
    failed: dict[str, str] = {}
    scored = sparse if ln_paired is not None else np.ones(len(frame), dtype=bool)
    for fold in fold_list:
        train = ~fold.test
        params = {}
        for t, fit in dense_fits.items():
            rows = (context == t) & ~sparse
            if ln_paired is None and (rows & fold.test).any():
                keep = rows & train
                where = f"holdout {protocol}: dense runs at context {t} kept by fold {fold.label}"
                params[t] = fit_dense(ln_n[keep], ln_d[keep], ln_l[keep], rng, where).params
            else:
                params[t] = fit.params
        ln_dense = log_loss_at(params, context, ln_n, ln_d) if params else np.full(len(frame), np.nan)
        if ln_paired is not None:
            ln_dense = np.where(sparse, ln_paired, ln_dense)
        y = (ln_l - ln_dense)[sparse]
        for form, name in zip(laws, names, strict=True):
            if name in failed:
                continue
            ln_law = ln_dense.copy()
            if form is not None:
                assert x is not None
                kept = train[sparse]
                try:
                    fit = fit_delta(form, x.subset(kept), y[kept], rng)
                except UserError as err:
                    failed[name] = f"fold {fold.label}: {err}"
                    continue
                ln_law[sparse] += form.predict(fit.theta, x)
            pred[name][fold.test] = ln_law[fold.test]
            in_fit[name].append((ln_law - ln_l)[train & scored])
    held = np.flatnonzero(np.any([f.test for f in fold_list], axis=0) & scored)
    results = {}
    for name in names:
        if name in failed:
            continue
        rmse_fit = float(np.sqrt(np.mean(np.concatenate(in_fit[name]) ** 2)))
        metrics = score(frame.iloc[held], ln_l[held], pred[name][held], rmse_fit)
        results[name] = HeldOut(protocol, held, pred[name][held], ln_l[held], metrics)
    return results, failed
