"""Fit the whole law and choose the delta form.

``fit_law``: validate the runs (the causal-routing loss by default; runs
shorter than ``min_steps`` optimiser steps left out and counted); keep the
sparse runs of one family variant (X-MoD with its own mechanisms by default:
MoD and ablation variants are fitted apart, with ``family``); fit the dense law
per context with bootstrap intervals; fit every delta form on the sparse runs
with bootstrap intervals; refit all of them under a held-out protocol; keep the
simplest form within one standard error of the lowest held-out error of ln L
(never the best training fit; see :func:`one_se_choice`).

The bootstrap is stratified, clustered and paired. Replicate b resamples, with
replacement, the dense *configurations* of each context and the sparse
configurations (all seeds of a drawn configuration come along, so seed noise
widens the intervals), refits the dense laws, recomputes y = ln L_x - ln L_d_hat
with *those* dense laws, and refits each delta form. A delta interval
therefore includes the dense law's uncertainty, and the dense and delta
parameters of replicate b together are one draw of the whole law, which is what
prediction intervals and P(beats dense) are computed from. A replicate whose
refit does not converge (after a retry from more starts) is dropped from every
law at once, so the draws stay paired, and counted. Under the paired baseline
(:func:`paired_baseline`) y is measured against each run's dense partner
instead, and the replicates draw partners as well as configurations.

Identification is checked, not assumed (:func:`identification`): a parameter at
a bound of its box, an interval spanning more than a decade, or a fit that did
not converge is a flag in the JSON and the plain output, and ``recommend``
gives no sparse answer from a flagged law.

Past :func:`fit_law`, every function here is a step of it (protocols, bootstrap
blocks, form selection); which runs are fitted (one learning rate, one variant,
the paired baseline) is :mod:`~xmodlm.law.select`, the law's model
:mod:`~xmodlm.law.lawfit` and prediction :mod:`~xmodlm.law.predict`.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pandas as pd

from xmodlm.errors import UserError
from xmodlm.law import dense
from xmodlm.law.delta import (
    FORMS,
    REFERENCE,
    Features,
    Form,
    bootstrap_delta,
    fit_delta,
    get_form,
)
from xmodlm.law.holdout import (
    DENSE_ONLY,
    PROTOCOLS,
    HeldOut,
    check_protocol,
    default_protocol,
    evaluate,
    folds,
)
from xmodlm.law.lawfit import DeltaLaw, DenseLaw, LawFit, identification

# a saved law (lawfit.py) and prediction with it (predict.py) have their own modules;
# their public names stay importable from here, as scripts of results/ import them
from xmodlm.law.lawfit import load_fit as load_fit
from xmodlm.law.predict import Prediction as Prediction
from xmodlm.law.predict import log_inputs
from xmodlm.law.predict import predict as predict
from xmodlm.law.predict import predict_samples as predict_samples
from xmodlm.law.predict import predicts_losses as predicts_losses
from xmodlm.law.robust import HUBER_DELTA, resample_weights

# run selection has its own module (select.py); the plots import these two from here
from xmodlm.law.select import fitted_runs as fitted_runs
from xmodlm.law.select import one_lr, one_variant
from xmodlm.law.select import paired_baseline as paired_baseline
from xmodlm.law.table import DEFAULT_MIN_STEPS, UNRECORDED_CONTEXT, validate
from xmodlm.pairing import NO_PARTNER, dense_partners
from xmodlm.progress import Progress

MIN_BOOT = 100  # below this the 2.5/97.5 percentiles rest on two or three draws
DEFAULT_FAMILY = "xmod"
BASELINES = ("law", "paired")  # what a sparse run's delta is measured against
BOOT_STEPS = 20  # bootstrap progress is reported in up to this many blocks of replicates
BOOT_BLOCK_MIN = 50  # replicates per block at least (each block starts its worker processes)



def _span(values: pd.Series) -> list[float] | None:
    return [float(values.min()), float(values.max())] if len(values) else None


def fit_law(
    df: pd.DataFrame,
    form: str = "auto",
    holdout: str | None = None,
    n_boot: int = 1000,
    seed: int = 0,
    loss: str = "causal",
    min_steps: int = DEFAULT_MIN_STEPS,
    family: str = DEFAULT_FAMILY,
    baseline: str = "law",
    lr: float | None = None,
) -> LawFit:
    """Fit the dense law per context and the delta law, select a form, validate held out.

    ``form``: ``auto`` fits every registered form and keeps the simplest within one
    standard error of the lowest held-out error; a form name fits only that one.
    ``holdout``: the protocol for selection and the reported held-out metrics;
    None picks leave-cell-out when there are two or more (S, c) cells, else
    top-compute when there are two or more compute tiers, else none. ``loss``:
    ``causal`` (default) or ``topk``. ``min_steps``: shorter runs are left out and
    counted (0 keeps all; the table needs a ``steps`` column otherwise).
    ``family``: the sparse runs the delta law is fitted on: a family (``xmod``,
    ``mod``: its own-mechanism variant, else its largest) or a variant label from
    the table (``xmod[gating=sigmoid]``); every other sparse run is left out and
    counted by variant. ``baseline``: what each sparse run's delta is measured
    against, ``law`` (the dense law at the run's own N_ae and D) or ``paired``
    (the observed loss of its FLOP-matched dense partner, :mod:`xmodlm.pairing`;
    see :func:`paired_baseline`). ``lr``: the peak learning rate whose runs are
    fitted (None: the table's most common one; runs at others are left out and
    counted, since a law pools one training recipe).

    Long on purpose: it is the pipeline in the order the module docstring gives
    (select runs, dense laws, delta forms, paired replicates, held-out selection,
    the record), and each step hands several arrays to the next; cut into pieces,
    they would pass a dozen values back and forth.
    """
    started = time.perf_counter()
    if n_boot < MIN_BOOT:
        raise UserError(
            f"n_boot={n_boot}: need at least {MIN_BOOT} bootstrap replicates (1000 recommended)"
        )
    candidates = list(FORMS.values()) if form == "auto" else [get_form(form)]
    if holdout is not None:
        check_protocol(holdout)
    if baseline not in BASELINES:
        raise UserError(f"baseline={baseline!r}: must be one of {', '.join(BASELINES)}")
    runs = validate(df, loss=loss, min_steps=min_steps)
    frame, lr_used, excluded_lr = one_lr(runs.frame, lr)
    frame, variant, excluded = one_variant(frame, family)
    frame = frame.reset_index(drop=True)
    sparse = frame["is_sparse"].to_numpy()
    context = frame["context"].to_numpy()
    if sparse.all():
        raise UserError(
            "table has no dense runs (stride 1 or capacity 1); the law measures X-MoD"
            " against a dense law fitted to them"
        )
    orphans = sorted(set(context[sparse]) - set(context[~sparse]))
    if orphans:
        raise UserError(
            f"X-MoD runs at context {orphans[0]} have no dense runs at that context;"
            " the dense law is fitted per context"
        )
    ln_paired = paired_baseline(frame) if baseline == "paired" else None
    rng = np.random.default_rng(seed)
    notes = list(runs.notes)
    try:
        dense_fits, dense_laws, dense_ok = _fit_dense_laws(frame, n_boot, rng)
    except UserError as err:
        if ln_paired is not None and sparse.any():
            # the paired delta needs no dense law; only absolute losses would
            dense_fits, dense_laws, dense_ok = {}, {}, np.ones(n_boot, dtype=bool)
            notes.append(f"no dense law: {err}; the paired delta law needs none, but the"
                         " law cannot predict absolute losses")
        else:
            why = ""
            if runs.dropped_short:
                why = (f" ({runs.dropped_short} runs shorter than min_steps={min_steps} were"
                       " left out: early training measures warmup; --min-steps lowers the bar,"
                       " at that cost)")
            elif sparse.any() and "width" in frame and "seed" in frame and (
                    dense_partners(frame, ~sparse)[sparse] != NO_PARTNER).all():
                why = ("; every sparse run has a FLOP-matched dense run of its seed, so the"
                       " delta can be fitted against those instead (--baseline paired)")
            if not why:
                raise
            raise UserError(f"{err}{why}") from None
    deltas, skipped, delta_ok = {}, {}, np.ones(n_boot, dtype=bool)
    if sparse.any():
        deltas, skipped, delta_ok = _fit_deltas(
            frame, candidates, dense_laws, n_boot, rng, explicit=form != "auto",
            ln_paired=ln_paired,
        )
    dropped_replicates = _keep_replicates(dense_laws, deltas, dense_ok & delta_ok)
    protocol = holdout or default_protocol(frame)
    if form == "auto" and len(deltas) > 1 and protocol is None:
        raise UserError(
            "cannot choose a delta form by held-out error: the X-MoD runs are in one"
            " (stride, capacity) cell and one compute tier; pass a form name instead of auto"
        )
    forms = [FORMS[name] for name in deltas]
    results, failed = {}, {}
    if protocol:
        n_folds = len(folds(frame, protocol))
        with Progress(1, f"law fit: held-out {protocol}, {n_folds} folds x"
                      f" {max(1, len(forms))} laws", unit="protocol") as bar:
            results, failed = evaluate(
                frame, protocol, forms, dense_fits, REFERENCE, rng, ln_paired
            )
            bar.update(1)
    selected, selection = _select(form, deltas, results, failed, protocol)
    by_protocol = _other_protocols(frame, protocol, selected, dense_fits, rng, ln_paired)
    if protocol:
        held_sel = results.get(selected or DENSE_ONLY)
        by_protocol[protocol] = held_sel.metrics if held_sel else {
            "failed": failed.get(selected or DENSE_ONLY, "no held-out result")}
    ln_point = _in_fit(frame, dense_laws, deltas.get(selected) if selected else None, ln_paired)
    ln_obs = np.log(frame["val_loss"].to_numpy(float))
    scored = np.isfinite(ln_point) & (sparse if ln_paired is not None else True)
    err = (ln_point - ln_obs)[scored]
    held = results.get(selected or DENSE_ONLY)
    return LawFit(
        dense=dense_laws,
        deltas=deltas,
        selected=selected,
        selection=selection,
        skipped=skipped,
        ranges={
            "compute": _span(frame["compute"]),
            "params_active": _span(frame["params_active"]),
            "tokens": _span(frame["tokens"]),
            "context": sorted(int(t) for t in np.unique(context)),
            "stride": _span(frame.loc[sparse, "stride"]),
            "capacity": _span(frame.loc[sparse, "capacity"]),
            "rho": _span(frame.loc[sparse, "rho"]),
        },
        metrics={
            "in_fit": {
                "n": len(err),
                "rmse": float(np.sqrt(np.mean(err**2))),
                "mae": float(np.mean(np.abs(err))),
            },
            "heldout": held.metrics if held else None,
            "heldout_protocol": protocol,
            "heldout_by_protocol": {k: by_protocol[k] for k in PROTOCOLS if k in by_protocol},
        },
        heldout_points=_points(held, ln_obs) if held else None,
        runs={
            "n": len(frame),
            "dense": int((~sparse).sum()),
            "sparse": int(sparse.sum()),
            "configurations": int(frame["config"].nunique()),
            "variant": variant,
            "dropped_unfinished": runs.dropped_unfinished,
            "dropped_short": runs.dropped_short,
            "min_steps": min_steps,
            "excluded_moe": runs.excluded_moe,
            "excluded_variants": excluded,
            "lr": lr_used,
            "excluded_lr": excluded_lr,
        },
        settings={
            "loss": runs.loss,
            "n_boot": n_boot,
            "replicates_kept": n_boot - dropped_replicates,
            "seed": seed,
            "huber_delta": HUBER_DELTA,
            "reference": dict(REFERENCE),
            "baseline": baseline,
            "bootstrap": "clustered by configuration (seeds of a configuration drawn together)"
            + ("; and by dense partner (a run's weight: its configuration's count times its"
               " partner's)" if baseline == "paired" else ""),
        },
        notes=notes,
        fit_seconds=time.perf_counter() - started,
        identification=identification(dense_fits, dense_laws, deltas, selected,
                                      n_configs=int(frame.loc[sparse, "config"].nunique())),
    )


def _other_protocols(
    frame: pd.DataFrame,
    protocol: str | None,
    selected: str | None,
    dense_fits: dict[int, dense.DenseFit],
    rng: np.random.Generator,
    ln_paired: np.ndarray | None = None,
) -> dict[str, dict[str, Any]]:
    """Held-out scores of the selected law under every protocol but the selecting one.

    Selection uses one protocol; the others test the chosen law on what it was
    not chosen for (a held-out routing cell, the top compute tier, the longest
    context), refitting only that law on each fold, after the bootstrap (so
    the fitted parameters and intervals do not depend on them). A protocol the
    table cannot support (no such folds, or a fold that leaves too few dense runs
    to refit the dense law) is recorded as ``{"not_applicable": why}``: it tests
    the law, and a small design should still be fitted.
    """
    out: dict[str, dict[str, Any]] = {}
    name = selected or DENSE_ONLY
    law = [FORMS[selected]] if selected else []
    runnable = []
    for other in PROTOCOLS:
        if other == protocol:
            continue
        try:
            folds(frame, other)
            runnable.append(other)
        except UserError as err:
            out[other] = {"not_applicable": str(err)}
    if not runnable:
        return out
    with Progress(len(runnable), f"law fit: {name} held out under {', '.join(runnable)}",
                  unit="protocol") as bar:
        for other in runnable:
            try:
                results, failed = evaluate(frame, other, law, dense_fits, REFERENCE, rng,
                                           ln_paired)
            except UserError as err:  # a fold too small to refit the dense law on
                out[other] = {"not_applicable": str(err)}
            else:
                out[other] = results[name].metrics if name in results else {
                    "failed": failed.get(name, "no held-out result")}
            bar.update(1)
    return out


def _keep_replicates(
    dense_laws: dict[int, DenseLaw], deltas: dict[str, DeltaLaw], keep: np.ndarray
) -> int:
    """Drop the replicates that did not converge in some law from every law (they stay
    paired); returns how many were dropped."""
    if keep.all():
        return 0
    if keep.sum() < MIN_BOOT // 2:
        raise UserError(
            f"only {int(keep.sum())} of {len(keep)} bootstrap refits converged; the law is not"
            " identified by these runs (see the optimiser reports)"
        )
    for law in [*dense_laws.values(), *deltas.values()]:
        law.samples = law.samples[keep]
    return int((~keep).sum())


def _fit_dense_laws(
    frame: pd.DataFrame, n_boot: int, rng: np.random.Generator
) -> tuple[dict[int, dense.DenseFit], dict[int, DenseLaw], np.ndarray]:
    """Dense law and bootstrap per context, from the dense runs of that context; and
    which replicates converged in every context."""
    ln_n, ln_d = log_inputs(frame)
    ln_l = np.log(frame["val_loss"].to_numpy(float))
    context, sparse = frame["context"].to_numpy(), frame["is_sparse"].to_numpy()
    configs = frame["config"].to_numpy()
    fits, laws = {}, {}
    ok = np.ones(n_boot, dtype=bool)
    for t in sorted(set(context[~sparse])):
        rows = (context == t) & ~sparse
        where = "dense runs" if t == UNRECORDED_CONTEXT else f"dense runs at context {t}"
        with Progress(1, f"law fit: {where}", unit="fit") as bar:
            fit = dense.fit_dense(ln_n[rows], ln_d[rows], ln_l[rows], rng, where)
            bar.update(1)
        weights = resample_weights(int(rows.sum()), n_boot, rng, clusters=configs[rows])
        samples, converged = _in_blocks(
            lambda idx, fit=fit, rows=rows, weights=weights: dense.bootstrap_dense(
                fit, ln_n[rows], ln_d[rows], ln_l[rows], weights[idx]
            ),
            n_boot, f"law fit: bootstrap of the {where}",
        )
        fits[int(t)] = fit
        ok &= converged
        diagnostics = {**fit.report(), "bootstrap_converged": float(converged.mean())}
        laws[int(t)] = DenseLaw(int(t), fit.params, samples, fit.n_runs, diagnostics)
    return fits, laws, ok


def _fit_deltas(
    frame: pd.DataFrame,
    candidates: list[Form],
    dense_laws: dict[int, DenseLaw],
    n_boot: int,
    rng: np.random.Generator,
    explicit: bool,
    ln_paired: np.ndarray | None = None,
) -> tuple[dict[str, DeltaLaw], dict[str, str], np.ndarray]:
    """Every candidate form on the X-MoD runs, with bootstrap paired to the dense
    replicates; and which replicates converged in every form.

    With ``ln_paired`` (the paired baseline, one entry per row of ``frame``) y is
    each run's ln L minus its dense partner's, the same in every replicate: the
    dense law does not enter, so neither does its uncertainty; the replicates
    then draw configurations and dense partners both."""
    sparse = frame["is_sparse"].to_numpy()
    runs = frame[sparse]
    ln_n, ln_d = log_inputs(runs)
    context = runs["context"].to_numpy()
    ln_l = np.log(runs["val_loss"].to_numpy(float))
    if ln_paired is None:
        y = ln_l - dense.log_loss_at(
            {t: law.value for t, law in dense_laws.items()}, context, ln_n, ln_d
        )
        y_boot = ln_l - dense.log_loss_at(
            {t: law.samples for t, law in dense_laws.items()}, context, ln_n, ln_d
        )
    else:
        y = ln_l - ln_paired[sparse]
        y_boot = np.broadcast_to(y, (n_boot, len(y)))
    x = Features.of(runs, REFERENCE)
    weights = resample_weights(len(runs), n_boot, rng, clusters=runs["config"].to_numpy())
    if ln_paired is not None:
        # one dense run is the partner of every cell at its seed, context and budget, so
        # its luck is shared across configurations: draw partners too (a two-way,
        # "pigeonhole" bootstrap: a run's weight is its configuration's count times its
        # partner's), or a term that varies across those groups (context) is overconfident
        partner = dense_partners(frame, ~sparse)[sparse]
        weights = weights * resample_weights(len(runs), n_boot, rng, clusters=partner)
    deltas, skipped = {}, {}
    ok = np.ones(n_boot, dtype=bool)
    for form in candidates:
        try:
            with Progress(1, f"law fit: delta form {form.name}", unit="fit") as bar:
                fit = fit_delta(form, x, y, rng)
                bar.update(1)
        except UserError as err:
            if explicit:
                raise
            skipped[form.name] = str(err)
            continue
        samples, converged = _in_blocks(
            lambda idx, fit=fit: bootstrap_delta(fit, x, y_boot[idx], weights[idx]),
            n_boot, f"law fit: bootstrap of delta form {form.name}",
        )
        ok &= converged
        diagnostics = {**fit.report(), "bootstrap_converged": float(converged.mean())}
        deltas[form.name] = DeltaLaw(
            form.name, fit.theta, fit.fixed, samples, fit.n_runs, diagnostics
        )
    if not deltas:
        name, why = next(iter(skipped.items()))
        raise UserError(f"no delta form can be fitted to these X-MoD runs ({name}: {why})")
    return deltas, skipped, ok


def _in_blocks(
    refit: Any, n_boot: int, desc: str
) -> tuple[np.ndarray, np.ndarray]:
    """``refit(replicate indices) -> (samples, converged)`` over all ``n_boot``
    replicates, in up to :data:`BOOT_STEPS` blocks so progress (and an ETA) shows
    between them. Each replicate is refitted from the same starts whatever its block, so the
    result equals one call over all of them."""
    n_blocks = max(1, min(BOOT_STEPS, n_boot // BOOT_BLOCK_MIN))
    blocks = np.array_split(np.arange(n_boot), n_blocks)
    samples, converged = [], []
    with Progress(n_boot, desc, unit="replicate") as bar:
        for idx in blocks:
            s, c = refit(idx)
            samples.append(s)
            converged.append(c)
            bar.update(len(idx))
    return np.vstack(samples), np.concatenate(converged)


def one_se_choice(results: dict[str, HeldOut], n_params: dict[str, int]) -> tuple[str, str]:
    """The simplest form whose held-out error is within one standard error of the best.

    Held-out RMSEs of related forms often differ by less than their noise (the
    forms nest: every richer form contains ``base``), and picking the raw minimum
    then ships a form whose extra parameters the data cannot identify. The
    standard error is that of the paired per-run difference in squared error
    against the lowest-RMSE form; among the forms within it, the fewest free
    parameters win, then the lower RMSE. Returns (name, reason).
    """
    rmse = {name: r.metrics["rmse"] for name, r in results.items()}
    best = min(rmse, key=lambda n: (rmse[n], n_params[n]))
    err_best = (results[best].ln_pred - results[best].ln_obs) ** 2
    close, gaps = [], {}
    for name, r in results.items():
        diff = (r.ln_pred - r.ln_obs) ** 2 - err_best
        se = float(np.std(diff, ddof=1) / np.sqrt(len(diff))) if len(diff) > 1 else 0.0
        gaps[name] = (float(diff.mean()), se)
        if diff.mean() <= se:
            close.append(name)
    chosen = min(close, key=lambda n: (n_params[n], rmse[n]))
    listing = ", ".join(f"{n} {rmse[n]:.4g}" for n in sorted(rmse, key=rmse.get))
    if chosen == best:
        return chosen, f"lowest held-out RMSE of ln L: {listing}"
    mean, se = gaps[chosen]
    return chosen, (
        f"fewest parameters ({n_params[chosen]}) within one standard error of the lowest"
        f" held-out RMSE ({best}; MSE gap {mean:.2g} <= SE {se:.2g}): {listing}"
    )


def _select(
    form: str,
    deltas: dict[str, DeltaLaw],
    results: dict[str, HeldOut],
    failed: dict[str, str],
    protocol: str | None,
) -> tuple[str | None, dict[str, Any] | None]:
    """The chosen form and why (:func:`one_se_choice` on the forms that refitted)."""
    if not deltas:
        return None, None
    scored = {name: results[name] for name in deltas if name in results}
    if form != "auto":
        selected, why = form, "chosen by the caller (form given)"
    elif len(deltas) == 1:
        selected, why = next(iter(deltas)), "the only form these runs can fit"
    elif not scored:
        name, reason = next(iter(failed.items()))
        raise UserError(
            f"no delta form could be refitted under holdout {protocol} ({name}: {reason})"
        )
    else:
        n_free = {name: len(deltas[name].spec.params) - len(deltas[name].fixed) for name in scored}
        selected, reason = one_se_choice(scored, n_free)
        why = f"{reason} (holdout {protocol})"
    return selected, {
        "rule": "one standard error: the simplest form within 1 SE of the lowest held-out MSE of ln L",
        "protocol": protocol,
        "why": why,
        "heldout": {name: r.metrics for name, r in results.items()},
        "failed": failed,
    }


def _in_fit(
    frame: pd.DataFrame,
    dense_laws: dict[int, DenseLaw],
    law: DeltaLaw | None,
    ln_paired: np.ndarray | None = None,
) -> np.ndarray:
    """Point predictions of ln L for the fitted runs (sparse runs from their dense
    partner's observed loss under the paired baseline; NaN for dense runs when the
    law has no dense law)."""
    ln_n, ln_d = log_inputs(frame)
    values = {t: d.value for t, d in dense_laws.items()}
    out = np.full(len(frame), np.nan)
    if values:
        out = dense.log_loss_at(values, frame["context"].to_numpy(), ln_n, ln_d)
    sparse = frame["is_sparse"].to_numpy()
    if ln_paired is not None:
        out = np.where(sparse, ln_paired, out)
    if law is not None and sparse.any():
        out[sparse] += law.spec.predict(law.value, Features.of(frame[sparse], REFERENCE))
    return out


def _points(held: HeldOut, ln_obs: np.ndarray) -> dict[str, Any]:
    return {
        "protocol": held.protocol,
        "rows": held.rows.tolist(),
        "observed": np.exp(ln_obs[held.rows]).tolist(),
        "predicted": np.exp(held.ln_pred).tolist(),
    }
