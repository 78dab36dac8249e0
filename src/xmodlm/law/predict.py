"""Prediction with a fitted law: ln L for rows of a run table, with the bootstrap
draws of the whole law (dense and delta paired) behind every interval.

The fitting (:mod:`xmodlm.law.fit`) scores its held-out folds and its in-fit error
with the same inputs (:func:`log_inputs`); the readers of a saved law
(``xmod law predict``, recommend, the plots) call :func:`predict_samples` or
:func:`predict`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from xmodlm.errors import UserError
from xmodlm.law import dense
from xmodlm.law.delta import TERMS, Features
from xmodlm.law.lawfit import LawFit
from xmodlm.law.robust import interval
from xmodlm.law.table import UNRECORDED_CONTEXT, validate


def log_inputs(frame: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """ln N_ae and ln D of validated rows: the inputs of the dense law."""
    return np.log(frame["params_active"].to_numpy(float)), np.log(frame["tokens"].to_numpy(float))


@dataclass(frozen=True)
class Prediction:
    """ln L for each row: point estimate, bootstrap draws, and its parts."""

    law_context: np.ndarray  # the fitted context whose dense law each row used
    ln_dense: np.ndarray  # (n,)
    terms: dict[str, np.ndarray]  # the delta's named terms, each (n,); zero for dense rows
    ln_point: np.ndarray  # (n,)
    ln_samples: np.ndarray  # (n_boot, n)
    ln_dense_samples: np.ndarray  # (n_boot, n): the same draws without the delta
    in_range: np.ndarray  # every input inside the fitted ranges


def _law_contexts(fit: LawFit, context: np.ndarray) -> np.ndarray:
    """The fitted context used for each row: its own, else the nearest in ln T."""
    fitted = np.array(sorted(fit.dense))
    if len(fitted) == 1:
        return np.full(len(context), fitted[0])
    if (context == UNRECORDED_CONTEXT).any():
        raise UserError(
            f"rows need a context column: the law has dense fits at contexts {fitted.tolist()}"
        )
    nearest = np.abs(np.log(context)[:, None] - np.log(fitted)[None, :]).argmin(axis=1)
    return fitted[nearest]


def _inside(values: np.ndarray, span: list[float] | None) -> np.ndarray:
    if span is None:
        return np.zeros(len(values), dtype=bool)
    return (values >= span[0]) & (values <= span[1])


def predict_samples(fit: LawFit, frame: pd.DataFrame) -> Prediction:
    """Predict validated rows (``table.validate(rows, need_loss=False).frame``).

    A paired-baseline law fitted without a dense law (its dense runs were of one
    size) predicts deltas only: ``ln_dense`` is then 0, so ``ln_point`` is the
    delta; callers check ``fit.dense`` before calling it a loss.
    """
    ln_n, ln_d = log_inputs(frame)
    context = frame["context"].to_numpy()
    if fit.dense:
        used = _law_contexts(fit, context)
        ln_dense = dense.log_loss_at({t: d.value for t, d in fit.dense.items()}, used, ln_n, ln_d)
        ln_dense_samples = dense.log_loss_at(
            {t: d.samples for t, d in fit.dense.items()}, used, ln_n, ln_d
        )
    else:
        if fit.delta is None:
            raise UserError("the law has neither a dense law nor a delta law to predict with")
        used = context
        ln_dense = np.zeros(len(frame))
        ln_dense_samples = np.zeros((len(fit.delta.samples), len(frame)))
    ln_samples = ln_dense_samples.copy()
    terms = {name: np.zeros(len(frame)) for name in TERMS}
    sparse = frame["is_sparse"].to_numpy()
    ranges = fit.ranges
    in_range = _inside(frame["params_active"].to_numpy(), ranges["params_active"])
    in_range &= _inside(frame["tokens"].to_numpy(), ranges["tokens"]) & (used == context)
    if sparse.any():
        law = fit.delta
        if law is None:
            raise UserError(
                "the law was fitted on dense runs only; it cannot predict X-MoD rows (stride > 1, capacity < 1)"
            )
        x = Features.of(frame[sparse], fit.reference)
        for name, term in law.spec.terms(law.value, x).items():
            terms[name][sparse] = term
        ln_samples[:, sparse] += law.spec.predict(law.samples, x)
        in_range[sparse] &= _inside(frame.loc[sparse, "stride"].to_numpy(), ranges["stride"])
        in_range[sparse] &= _inside(frame.loc[sparse, "capacity"].to_numpy(), ranges["capacity"])
    ln_point = ln_dense + sum(terms.values())
    return Prediction(used, ln_dense, terms, ln_point, ln_samples, ln_dense_samples, in_range)


def predicts_losses(fit: LawFit) -> bool:
    """Whether ``fit`` predicts losses (it has a dense law) or only differences from
    dense: a paired-baseline law fitted on dense runs of one size measures each
    routed run against its partner's observed loss, so it knows ln L(routed) -
    ln L(dense) at a configuration but not L itself."""
    return bool(fit.dense)


def predict(fit: LawFit, rows: pd.DataFrame) -> pd.DataFrame:
    """One prediction per row: loss with 95% interval, dense loss, delta and its three terms.

    Rows need ``params_active`` and ``tokens``; ``stride``/``capacity`` default to
    dense and ``context`` to the law's only context. The interval is the 2.5-97.5
    percentile of the bootstrap draws of the whole law (dense and delta paired).
    A law without a dense law (:func:`predicts_losses` false) predicts the
    difference instead: ``delta`` = ln L(routed) - ln L(FLOP-matched dense) with
    its interval ``delta_lo``/``delta_hi`` (0 on dense rows), and no loss columns.
    """
    frame = validate(rows, need_loss=False).frame
    p = predict_samples(fit, frame)
    out = frame[["params_active", "tokens", "context", "stride", "capacity", "rho"]].copy()
    out["law_context"] = p.law_context
    delta = p.ln_point - p.ln_dense
    if predicts_losses(fit):
        ci = interval(np.exp(p.ln_samples), np.exp(p.ln_point))
        out["pred_loss"] = np.exp(p.ln_point)
        out["lo"], out["hi"] = ci[:, 0], ci[:, 1]
        out["dense_loss"] = np.exp(p.ln_dense)
        out["delta"] = delta
    else:
        ci = interval(p.ln_samples - p.ln_dense_samples, delta)
        out["delta"] = delta
        out["delta_lo"], out["delta_hi"] = ci[:, 0], ci[:, 1]
    for name in TERMS:
        out[f"{name}_term"] = p.terms[name]
    out["in_range"] = p.in_range
    return out
