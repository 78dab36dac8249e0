"""The recommender (DESIGN 5.4): given compute C, context T and N_ae, what to train.

1. A dense reference with N_ae close to the request. Shape rule: width d a
   multiple of 64 with 64-wide heads and about one layer per 64 units of width
   (d = 256 -> 4 layers, d = 1024 -> 16), the aspect ratio of GPT-2-small-like
   models; the width whose ladder model is closest to N_ae in ln N is taken,
   then the depth at that width is adjusted to land as close as one layer allows.
2. For every (S, c): :func:`xmodlm.flops.flop_match` gives the depth L (a
   multiple of S) whose training FLOPs per token are closest to the reference's;
   each model trains on D = C / F_token tokens, so all spend exactly C.
3. Each candidate's loss is predicted with the law's bootstrap draws. P(beats
   dense) is the share of draws in which the candidate's ln L is below the dense
   reference's (the draws are paired: one draw is one whole law). P(routing
   helps) is the share in which the candidate's delta is negative, i.e. it beats
   the dense law at its *own* N_ae and D.
4. The answer is "train dense" unless some configuration has both P >=
   ``THRESHOLD`` (0.9); then it is the one with the lowest predicted loss among
   those. Both are needed because depth comes in whole multiples of S: a small
   model's candidate can miss the reference's FLOPs by 10-20%, and a candidate
   that wins only because it is smaller (more tokens at the same C) is evidence
   for a smaller dense model, not for routing.
5. No sparse answer comes from a law whose identification is flagged (a
   parameter at a bound, an interval over a decade, a fit that did not
   converge: :func:`xmodlm.law.lawfit.identification`); the reason says which.
   A law fitted with the paired baseline (``LawFit.baseline``) measured each
   delta against the run's FLOP-matched dense partner: its delta applies to the
   dense reference's predicted loss, P(beats dense) is P(delta < 0), and only
   the delta law's flags block (the dense law's are a warning about the
   absolute losses).

6. Every candidate names the inputs at which it lies outside what the law was
   fitted on (:func:`outside_fit`: stride, capacity, rho, context, compute,
   N_ae, D), and the reason repeats them for the configuration it speaks of: an
   answer there is an extrapolation, and the user is told along which axis.

The law predicts the validation loss it was fitted on, the causal-routing loss
by default (what decoding gets); the answer names it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from importlib import resources
from typing import Any

import numpy as np
import pandas as pd

from xmodlm import flops
from xmodlm.config import ModelConfig
from xmodlm.errors import UserError
from xmodlm.law.lawfit import LawFit, load_fit
from xmodlm.law.predict import predict_samples
from xmodlm.law.robust import interval
from xmodlm.law.table import validate

ASPECT = 64  # units of width per layer in the dense reference
HEAD_DIM = 64
MAX_WIDTH = 16384
THRESHOLD = 0.9
EXTRAPOLATION = 10.0  # warn when compute is more than this factor outside the fitted range
DEFAULT_FIT = "default_fit.json"
DEFAULT_FIT_NOTE = (
    "no --law given: using the shipped law, fitted on the 40 runs of the micro-law CPU"
    " sweep with at least 500 optimiser steps (results/micro-law: T=128, one seed; causal"
    " loss; its dense law is flagged as not identified, so it never recommends sparsity);"
    " fit your own sweep"
)


def dense_config(
    width: int, context: int, vocab_size: int, n_layers: int | None = None
) -> ModelConfig:
    """The dense model of the shape rule at ``width`` (depth from the aspect rule unless given)."""
    cfg = ModelConfig(
        vocab_size=vocab_size,
        d_model=width,
        n_layers=n_layers or max(1, round(width / ASPECT)),
        n_heads=max(1, width // HEAD_DIM),
        context=context,
    )
    cfg.validate()
    return cfg


def dense_reference(active_params: float, context: int, vocab_size: int = 4096) -> ModelConfig:
    """The dense model whose N_ae is closest to ``active_params`` under the shape rule."""
    target = math.log(active_params)
    width = min(
        range(HEAD_DIM, MAX_WIDTH + 1, HEAD_DIM),
        key=lambda d: abs(
            math.log(flops.count(dense_config(d, context, vocab_size)).params_active) - target
        ),
    )
    per_layer = flops.block_params(dense_config(width, context, vocab_size), "D")[1]
    n_layers = max(1, round((active_params - width) / per_layer))  # N_ae = L x block + final norm
    return dense_config(width, context, vocab_size, n_layers)


def _default_fit() -> LawFit:
    path = resources.files("xmodlm.law") / DEFAULT_FIT
    if not path.is_file():
        raise UserError(
            "no law given and none ships with this package; pass --law FIT"
            " (a JSON written by `xmod law fit RESULTS --json`)"
        )
    return load_fit(str(path))


def check_question(
    compute: float, context: int, active_params: float, max_total_params: float | None
) -> None:
    """The question every recommender answers (a budget, a context, an active size,
    an optional cap on total parameters), checked the same for every law."""
    if not compute > 0 or not active_params > 0:
        raise UserError(
            f"compute={compute} and active_params={active_params} must both be positive"
        )
    if context < 1 or context != int(context):
        raise UserError(f"context={context}: must be an integer >= 1")
    if max_total_params is not None and not max_total_params > 0:
        raise UserError(f"max_total_params={max_total_params}: must be positive")


def _check(
    compute: float,
    context: int,
    active_params: float,
    max_total_params: float | None,
    strides: Sequence[int],
    capacities: Sequence[float],
) -> None:
    check_question(compute, context, active_params, max_total_params)
    if any(s < 1 or s != int(s) for s in strides):
        raise UserError(f"strides {list(strides)}: each must be an integer >= 1")
    if any(not 0 < c <= 1 for c in capacities):
        raise UserError(f"capacities {list(capacities)}: each must be in (0, 1]")


def recommend(
    compute: float,
    context: int,
    active_params: float,
    law: LawFit | None = None,
    max_total_params: float | None = None,
    strides: Sequence[int] = (1, 2, 4, 8, 16),
    capacities: Sequence[float] = (0.0625, 0.125, 0.25, 0.5),
    *,
    vocab_size: int = 4096,
    threshold: float = THRESHOLD,
    loss: str | None = None,
) -> dict[str, Any]:
    """Rank the (S, c, L) configurations for budget ``compute`` at ``context`` (see module doc).

    ``law`` defaults to the fit shipped as ``xmodlm/law/default_fit.json``, if any.
    ``loss``: the validation loss to optimise; the law must have been fitted on it
    (None: whichever it was fitted on).

    Long on purpose: past the ranking, most of it spells out field by field each
    candidate's entry and the answer's record, which read best beside the numbers
    that fill them.
    """
    _check(compute, context, active_params, max_total_params, strides, capacities)
    if vocab_size < 2:
        raise UserError(f"vocab_size={vocab_size}: must be an integer >= 2")
    fit = law if law is not None else _default_fit()
    if loss is not None and loss != fit.loss:
        raise UserError(
            f"loss={loss}: the law was fitted on the {fit.loss} loss; refit it with"
            f" `xmod law fit --loss {loss}`"
        )
    reference = dense_reference(active_params, int(context), vocab_size)
    ref_total = flops.count(reference).params_total
    if max_total_params is not None and ref_total > max_total_params:
        raise UserError(
            f"the dense reference for active_params={active_params:.3g} already has {ref_total:.3g}"
            f" parameters, above max_total_params={max_total_params:.3g}"
        )
    models: list[tuple[ModelConfig, float]] = [(reference, 0.0)]
    excluded = 0
    if fit.delta is not None:
        for s in sorted({int(s) for s in strides if s > 1}):
            for c in sorted({float(c) for c in capacities if c < 1}):
                cfg, mismatch = flops.flop_match(reference, s, c)
                if (
                    max_total_params is not None
                    and flops.count(cfg).params_total > max_total_params
                ):
                    excluded += 1
                else:
                    models.append((cfg, mismatch))
    counts = [flops.count(cfg) for cfg, _ in models]
    rows = pd.DataFrame(
        {
            "params_active": [k.params_active for k in counts],
            "tokens": [compute / k.flops_train for k in counts],
            "context": int(context),
            "stride": [cfg.stride for cfg, _ in models],
            "capacity": [cfg.capacity for cfg, _ in models],
        }
    )
    frame = validate(rows, need_loss=False).frame
    pred = predict_samples(fit, frame)
    ln_dense, ln_dense_samples = pred.ln_dense, pred.ln_dense_samples
    if fit.baseline == "paired":
        # the delta was measured against the FLOP-matched dense run, so it applies to
        # the reference (row 0), not to the dense law at each candidate's own size
        ln_dense = np.full_like(ln_dense, ln_dense[0])
        ln_dense_samples = np.broadcast_to(ln_dense_samples[:, :1], ln_dense_samples.shape)
    ln_point = ln_dense + (pred.ln_point - pred.ln_dense)
    ln_samples = ln_dense_samples + (pred.ln_samples - pred.ln_dense_samples)
    ci = interval(np.exp(ln_samples), np.exp(ln_point))
    has_loss = bool(fit.dense)  # a paired law without a dense law ranks by delta only
    beats = (ln_samples < ln_samples[:, :1]).mean(axis=0)
    helps = (ln_samples < ln_dense_samples).mean(axis=0)
    entries = []
    for i, ((cfg, mismatch), k) in enumerate(zip(models, counts, strict=True)):
        entries.append(
            {
                "stride": cfg.stride,
                "capacity": cfg.capacity,
                "n_layers": cfg.n_layers,
                "width": cfg.d_model,
                "n_heads": cfg.n_heads,
                "params_total": k.params_total,
                "params_active": k.params_active,
                "flops_per_token": k.flops_train,
                "tokens": float(frame["tokens"].iloc[i]),
                "flop_mismatch": mismatch,
                "rho": float(frame["rho"].iloc[i]),
                "loss": float(np.exp(ln_point[i])) if has_loss else None,
                "ci": [float(ci[i, 0]), float(ci[i, 1])] if has_loss else None,
                "delta": float(ln_point[i] - ln_dense[i]),
                "terms": {name: float(t[i]) for name, t in pred.terms.items()},
                "vs_dense": float(ln_point[i] - ln_point[0]),
                "p_beats_dense": float(beats[i]) if i else None,
                "p_routing_helps": float(helps[i]) if i else None,
                "outside": outside_fit(fit.ranges, {
                    "stride": cfg.stride, "capacity": cfg.capacity,
                    "rho": float(frame["rho"].iloc[i]), "context": int(context),
                    "compute": compute, "params_active": k.params_active,
                    "tokens": float(frame["tokens"].iloc[i]),
                }),
            }
        )
        entries[-1]["extrapolated"] = bool(entries[-1]["outside"]) or not bool(pred.in_range[i])
    dense_entry, candidates = entries[0], sorted(entries[1:], key=lambda e: e["vs_dense"])
    winners = [
        e
        for e in candidates
        if e["p_beats_dense"] >= threshold and e["p_routing_helps"] >= threshold
    ]
    identified = not fit.blocking_flags()
    best = winners[0] if winners and identified else None
    reason = _reason(fit, best, dense_entry, candidates, threshold)
    if winners and not identified:
        flags = _flag_text(fit.blocking_flags())
        reason = (
            f"the law is not identified ({flags}), so it gives no sparse answer although"
            f" stride {winners[0]['stride']} capacity {winners[0]['capacity']:g} would win by it"
        )
    return {
        "answer": _answer(best),
        "reason": reason,
        "loss": fit.loss,
        "threshold": threshold,
        "best": best,
        "dense": dense_entry,
        "candidates": candidates,
        "excluded_by_max_total_params": excluded,
        "law": {
            "kind": "ln-ratio",
            "name": "shipped (results/micro-law)" if law is None else "fitted",
            "form": fit.selected,
            "loss": fit.loss,
            "identified": identified,
            "baseline": fit.baseline,
            "flags": fit.identification.get("flags", []),
            "contexts": sorted(fit.dense),
            "law_context": int(pred.law_context[0]),
        },
        "inputs": {
            "compute": compute,
            "context": int(context),
            "active_params": active_params,
            "max_total_params": max_total_params,
        },
        "warnings": ([DEFAULT_FIT_NOTE] if law is None else [])
        + _warnings(fit, compute, int(context), active_params, entries),
    }


# the inputs checked against the fitted ranges: (key in LawFit.ranges, name, format)
RANGE_AXES = (
    ("stride", "stride", "g"), ("capacity", "capacity", "g"), ("rho", "rho", ".3g"),
    ("context", "context", "d"), ("compute", "compute", ".3g"),
    ("params_active", "N_ae", ".3g"), ("tokens", "D", ".3g"),
)
SPARSE_AXES = {"stride", "capacity", "rho"}  # ranges of the sparse runs only
STEP_RTOL = {"compute": 0.01, "tokens": 0.01}
"""Relative slack on the axes a run reaches only to a whole optimiser step: a run
stops at the last step inside its budget, so a sweep at 6e13 FLOPs fits compute up
to 5.99999e13, and asking at 6e13 is asking inside it. One step is under 1% of any
run of 100 steps or more, and 1% is far below the factor between budgets."""


def outside_fit(ranges: dict[str, Any], point: dict[str, float]) -> list[str]:
    """Each input of ``point`` outside the law's fitted ``ranges``, as "capacity 0.0625
    outside [0.125, 0.5]". Contexts are a set (a context between two fitted ones is
    outside too: the nearest one's dense law answers); stride, capacity and rho are
    checked only for a sparse point (stride > 1 and capacity < 1)."""
    sparse = point.get("stride", 1) > 1 and point.get("capacity", 1.0) < 1
    out = []
    for key, name, fmt in RANGE_AXES:
        if key in SPARSE_AXES and not sparse:
            continue
        span, value = ranges.get(key), point.get(key)
        if span is None or value is None:
            if key in SPARSE_AXES:
                out.append(f"{name} {format(value, fmt)}: no sparse runs fitted")
            continue
        tol = STEP_RTOL.get(key, 1e-9)
        if key == "context":
            if int(value) not in span:
                out.append(f"context {int(value)} not among the fitted {list(span)}")
        elif not span[0] * (1 - tol) <= value <= span[1] * (1 + tol):
            out.append(f"{name} {format(value, fmt)} outside [{format(span[0], fmt)},"
                       f" {format(span[1], fmt)}]")
    return out


def _answer(best: dict[str, Any] | None) -> str:
    if best is None:
        return "train dense"
    return (
        f"train X-MoD: stride {best['stride']}, capacity {best['capacity']:g},"
        f" {best['n_layers']} layers of width {best['width']}"
    )


def _reason(
    fit: LawFit,
    best: dict[str, Any] | None,
    dense: dict[str, Any],
    candidates: list[dict[str, Any]],
    threshold: float,
) -> str:
    if fit.blocking_flags() and fit.delta is not None:
        return (f"the law is not identified ({_flag_text(fit.blocking_flags())}), so it"
                " supports no sparse answer")
    if fit.delta is None:
        return "the law was fitted on dense runs only, so it says nothing in favour of sparsity"
    if not candidates:
        return "no sparse configuration fits within max_total_params"
    if best is None:
        top = max(candidates, key=lambda e: min(e["p_beats_dense"], e["p_routing_helps"]))
        why = (
            f"no configuration beats dense with P >= {threshold:g}; the most likely,"
            f" stride {top['stride']} capacity {top['capacity']:g}, does with"
            f" P = {min(top['p_beats_dense'], top['p_routing_helps']):.2f}"
            + (f" (an extrapolation: {'; '.join(top['outside'])})" if top["outside"] else "")
        )
        smaller = [e for e in candidates if e["p_beats_dense"] >= threshold]
        if smaller:
            e = smaller[0]
            why += (
                f"; stride {e['stride']} capacity {e['capacity']:g} beats the reference"
                f" (P = {e['p_beats_dense']:.2f}) only through its {e['flop_mismatch']:+.0%} FLOP"
                f" mismatch, its routing helps with P = {e['p_routing_helps']:.2f}: a dense model"
                " of its size is the better bet"
            )
        return why
    caveat = (f" (an extrapolation: {'; '.join(best['outside'])})" if best["outside"] else
              " (outside the fitted ranges: an extrapolation)" if best["extrapolated"] else "")
    by = (f"predicted loss {best['loss']:.4g} vs {dense['loss']:.4g} for dense"
          if best["loss"] is not None else f"predicted {best['vs_dense']:+.4f} in ln L against dense")
    return (
        f"beats dense with P = {best['p_beats_dense']:.2f} >= {threshold:g} (routing helps with"
        f" P = {best['p_routing_helps']:.2f}): {by}{caveat}"
    )


def _flag_text(flags: list[dict[str, str]]) -> str:
    return "; ".join(f"{f['law']} {f['param']} {f['problem']}" for f in flags)


def _warnings(
    fit: LawFit, compute: float, context: int, active_params: float, entries: list[dict[str, Any]]
) -> list[str]:
    """Say when the question lies outside what the law was fitted on."""
    out = []
    unblocking = [f for f in fit.identification.get("flags", []) if f not in fit.blocking_flags()]
    if unblocking:
        out.append(
            f"the predicted losses rest on a dense law that is not identified"
            f" ({_flag_text(unblocking)}); the comparison with dense does not: the delta"
            " was measured against each run's FLOP-matched dense partner (baseline paired)"
        )
    ranges = fit.ranges
    lo, hi = ranges["compute"]
    if compute > EXTRAPOLATION * hi or compute < lo / EXTRAPOLATION:
        factor = compute / hi if compute > hi else lo / compute
        out.append(
            f"compute {compute:.3g} is {factor:.3g}x outside the fitted range [{lo:.3g}, {hi:.3g}]:"
            " the prediction extrapolates"
        )
    fitted = ranges["context"]
    if context not in fitted:
        where = "outside" if not fitted[0] <= context <= fitted[-1] else "between"
        out.append(
            f"context {context} is {where} the fitted contexts {fitted}: the nearest one's dense law is used"
        )
    lo, hi = ranges["params_active"]
    if not lo <= active_params <= hi:
        out.append(
            f"active_params {active_params:.3g} is outside the fitted N_ae range [{lo:.3g}, {hi:.3g}]"
        )
    outside = sum(e["extrapolated"] for e in entries)
    if outside:
        axes: dict[str, int] = {}
        for e in entries:
            for what in e["outside"]:
                name = what.split(" ", 1)[0]
                axes[name] = axes.get(name, 0) + 1
        by_axis = ", ".join(f"{name} ({n})" for name, n in axes.items())
        out.append(
            f"{outside} of {len(entries)} configurations lie outside the fitted ranges"
            + (f", by input: {by_axis}" if by_axis else "") + " (each marked extrapolated,"
            " with its inputs outside in 'outside')"
        )
    return out
