"""``xmod recommend --law paper``: which (K, A, N0) to train, by Eq. 14.

Given compute C, context L and the active-equivalent size N_act:

1. the backbone of that size (:func:`xmodlm.law.backbone.backbone_for`: the
   paper's Table 4 row, or one of its shape);
2. every (K, A, N0) the paper's construction builds at the backbone's active
   depth (:func:`xmodlm.depth.construct`): K whole, A in steps of 0.5 with A K
   whole, N0 as given (4, the paper's, by default). By default K and A stay
   inside the range the law was fitted on (Table 8: K 3-16, A 0.5-5): outside it
   Eq. 14 keeps rewarding K without bound, because its anchor term grows as
   K^rhoK (0.80) against the context penalty's K^rhoL (0.48). ``extrapolate``
   widens K to 2-64 and flags every candidate outside the fitted range;
3. each candidate's predicted Delta (nats against the dense model of the same
   N_act and L at the same C) with its three terms, its parameters and FLOPs
   per token (the paper's Table 6 convention) and the tokens C buys it;
4. ranked, best (lowest Delta) first, with K_hat beside the grid optimum: the
   continuous minimiser of Eq. 14 at A = 1 (what Eq. 16 approximates) and the
   best grid K at A = 1.

Eq. 14 has no C term: the ranking is the same at every budget, and C only sets
the tokens each candidate trains on. N fed to the law is the candidate's total
with embeddings scaled by N_act over the backbone's dense total, so N / N_act is
the ratio of the two models' totals (exactly 1 for dense) and N_act is the size
asked for (docs/law.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from xmodlm import depth
from xmodlm.errors import UserError
from xmodlm.law import backbone as bb
from xmodlm.law import paper
from xmodlm.law.recommend import check_question

EXTRAPOLATED_MAX_K = 64
A_STEP = 0.5


def _grid(law: paper.PaperLaw, extrapolate: bool) -> tuple[list[int], list[float]]:
    k_lo, k_hi = law.ranges.get("sparsity") or [2, EXTRAPOLATED_MAX_K]
    a_lo, a_hi = law.ranges.get("anchor_stride") or [A_STEP, 5.0]
    if extrapolate:
        k_lo, k_hi = 2, max(EXTRAPOLATED_MAX_K, k_hi)
    ks = list(range(max(2, int(np.ceil(k_lo))), int(np.floor(k_hi)) + 1))
    a_values = np.arange(A_STEP, a_hi + 1e-9, A_STEP)
    return ks, [float(a) for a in a_values if a >= a_lo - 1e-9]


def recommend_paper(
    compute: float,
    context: int,
    active_params: float,
    law: paper.PaperLaw | None = None,
    max_total_params: float | None = None,
    extrapolate: bool = False,
    dense_prefixes: Sequence[int] = (bb.DENSE_PREFIX,),
    active_layers: int = bb.ACTIVE_LAYERS,
    top: int | None = None,
    backbone: bb.Backbone | None = None,
) -> dict[str, Any]:
    """Rank the (K, A, N0) models of N_act ``active_params`` at ``context`` and budget
    ``compute`` by Eq. 14 (see the module doc). ``top`` keeps the best ``top``
    candidates in the answer (all are ranked). ``backbone``: the one to build on
    (:func:`xmodlm.law.backbone.backbone_of` a preset) instead of the paper's shape of
    that size; its dense total is then N_act, and its depth the active depth."""
    if backbone is not None:
        active_params, active_layers = float(backbone.dense_total), backbone.active_layers
    check_question(compute, context, active_params, max_total_params)
    if any(n < 0 or n != int(n) for n in dense_prefixes):
        raise UserError(f"dense prefixes {list(dense_prefixes)}: each must be an integer >= 0")
    law = law or paper.table8()
    if law.counts() == paper.COUNTS_EQS_4_5:
        raise UserError(
            f"the law {law.name!r} was fitted on counts without embeddings ({law.counts()});"
            " its candidates here are counted with them: refit it on a results table with"
            " params_non_embedding (`xmod results SWEEP_DIR` rewrites a sweep's table with it)")
    backbone = backbone or bb.backbone_for(active_params, active_layers)
    scale = active_params / backbone.dense_total  # N fed to the law: totals' ratio times N_act
    dense_model = bb.build(backbone, 1, 0, 0)
    f_dense = dense_model.flops_forward(int(context))
    models, excluded = _candidates(backbone, *_grid(law, extrapolate), dense_prefixes,
                                   max_total_params)
    if not models:
        raise UserError(
            "no (K, A, N0) candidate: " + ("every one is above max_total_params"
                                           f" {max_total_params:.3g}" if excluded else
                                           "the construction builds none at this active depth")
        )
    x = paper.Point.of(active_params, [m.params_total * scale for m in models], int(context),
                       [m.sparsity for m in models], [m.anchor_stride for m in models])
    pred = paper.delta(x, law.value)
    parts = paper.terms(x, law.value)
    draws = law.draws()
    boot = np.array([paper.delta(x, d) for d in draws]) if draws else None
    question = {"context": float(context), "params_active": float(active_params)}
    entries = []
    for i, m in enumerate(models):
        outside = law.outside({**question, "sparsity": m.sparsity,
                               "anchor_stride": m.anchor_stride})
        f = m.flops_forward(int(context))
        entries.append({
            "sparsity": m.sparsity,
            "anchor_stride": m.anchor_stride,
            "dense_prefix": m.dense_prefix,
            "blocks": m.blocks,
            "stages": list(depth.construct(m.sparsity, m.anchor_stride, m.dense_prefix,
                                           active_layers).stage_sparse),
            "params_total": m.params_total,
            "params_active": m.params_active,
            "flops_per_token": f,
            "flops_ratio": f / f_dense,
            "tokens": compute / (3 * f),
            "delta": float(pred[i]),
            "delta_ci": (None if boot is None else
                         [float(v) for v in np.percentile(boot[:, i], [2.5, 97.5])]),
            "p_beats_dense": None if boot is None else float((boot[:, i] < 0).mean()),
            "terms": {name: float(parts[name][i]) for name in paper.TERMS},
            "outside": outside,
            "outside_range": bool(outside),
        })
    entries.sort(key=lambda e: (e["delta"], e["params_total"]))
    best = entries[0]
    optimum = _k_optimum(law, backbone, active_params, int(context), scale, entries)
    answer = ("train dense: no candidate is predicted below the dense reference"
              if best["delta"] >= 0 else
              f"train X-MoD A{best['anchor_stride']:g}K{best['sparsity']:g}"
              f" (N0 = {best['dense_prefix']}, {best['blocks']} blocks,"
              f" {best['params_total'] / 1e9:.3g}B total): predicted Delta {best['delta']:+.3f}"
              " nats against dense")
    warnings = []
    if law.outside(question):
        warnings.append("the question lies outside the law's fitted range ("
                        + "; ".join(law.outside(question)) + "): every answer extrapolates")
    if best["outside_range"] and extrapolate:
        warnings.append("the best candidate lies outside the fitted range (--extrapolate):"
                        " Eq. 14 rewards K without bound there at A > 1")
    return {
        "answer": answer,
        "law": {"kind": "paper", "name": law.name, "form": "Eq. 14 on the additive Delta",
                "params": law.value, "ranges": law.ranges, "provenance": law.provenance},
        "inputs": {"compute": compute, "context": int(context), "active_params": active_params,
                   "max_total_params": max_total_params, "extrapolate": extrapolate,
                   "dense_prefixes": sorted({int(n) for n in dense_prefixes}),
                   "active_layers": active_layers},
        "backbone": {"label": backbone.label, "d_model": backbone.d_model,
                     "head_dim": backbone.head_dim, "ffn_dim": backbone.ffn_dim,
                     "n_heads": backbone.n_heads, "n_kv_heads": backbone.n_kv_heads,
                     "vocab_size": backbone.vocab_size, "layer_params": backbone.layer_params,
                     "dense_total": backbone.dense_total,
                     "dense_flops_per_token": f_dense, "dense_tokens": compute / (3 * f_dense)},
        "best": best,
        "optimum": optimum,
        "candidates": entries[:top] if top else entries,
        "n_candidates": len(entries),
        "excluded_by_max_total_params": excluded,
        "notes": ["Eq. 14 has no compute term: the ranking is the same at every budget; C sets"
                  " the tokens each candidate trains on",
                  "delta is in nats against the dense model of the same N_act and L at the same"
                  " training FLOPs; the dense reference itself has delta 0"],
        "warnings": warnings,
    }


def _candidates(backbone: bb.Backbone, ks: list[int], a_values: list[float],
                dense_prefixes: Sequence[int], max_total_params: float | None
                ) -> tuple[list[bb.Model], int]:
    """Every (K, A, N0) model the construction builds, and how many were above
    ``max_total_params``."""
    models, excluded = [], 0
    for n0 in sorted({int(n) for n in dense_prefixes}):
        for k in ks:
            for a in a_values:
                try:
                    m = bb.build(backbone, k, a, n0)
                except depth.DepthError:
                    continue  # A K not whole, or the active depth not buildable
                if max_total_params is not None and m.params_total > max_total_params:
                    excluded += 1
                else:
                    models.append(m)
    return models, excluded


def _k_optimum(law: paper.PaperLaw, backbone: bb.Backbone, active_params: float, context: int,
               scale: float, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """K_hat (the continuous minimiser of Eq. 14 at A = 1, N0 = 4) beside the best grid
    K at A = 1 and the Eq. 16 exponents."""
    n_stages = (backbone.active_layers - bb.DENSE_PREFIX) / 2  # A = 1: two active layers a stage

    def total_at(k: float) -> float:
        blocks = bb.DENSE_PREFIX + n_stages * (1 + k)
        return (backbone.layer_params * blocks + backbone.embedding_params) * scale

    k_max = float(EXTRAPOLATED_MAX_K) * 16
    khat = paper.k_hat(law.value, active_params, context, total_at, (1.0, k_max))
    at_one = [e for e in entries if e["anchor_stride"] == 1.0]
    grid = min(at_one, key=lambda e: e["delta"]) if at_one else None
    return {
        "k_hat": khat if khat < k_max * 0.999 else None,
        "k_hat_note": ("continuous minimiser of Eq. 14 over K at A = 1, N0 = 4 (Eq. 16 is a"
                       " proportionality; this is the number it approximates)"
                       if khat < k_max * 0.999 else
                       "Eq. 14 has no interior minimum in K at A = 1 here"),
        "k_hat_outside_range": bool(law.outside({"sparsity": khat})),
        "grid_best_at_a1": None if grid is None else {
            "sparsity": grid["sparsity"], "delta": grid["delta"]},
        "grid_best": {"sparsity": entries[0]["sparsity"],
                      "anchor_stride": entries[0]["anchor_stride"],
                      "delta": entries[0]["delta"]},
        "eq16_exponents": paper.eq16_exponents(law.value),
    }
