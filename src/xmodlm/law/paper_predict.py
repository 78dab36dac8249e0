"""Predictions of a fitted Eq. 14 for the rows of a table: Delta with its bootstrap
interval, and what each row asks beyond the fitted range.

A registered prediction (a study's out-of-range context, say) must be reproducible
from the committed fit and the committed rows alone, so it reads the same counts
as the fit (:func:`xmodlm.law.reference.eq14_inputs`) and the fit's own bootstrap
draws: the interval is the 2.5-97.5 percentile of Delta over the draws, which
carries the parameters' uncertainty (refits on resampled configurations), not the
scatter of one run about the law.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from xmodlm.law import paper
from xmodlm.law.reference import eq14_inputs
from xmodlm.law.table import validate

INTERVAL = (2.5, 97.5)  # percentiles of the bootstrap draws


def predict_paper(law: paper.PaperLaw, rows: pd.DataFrame) -> pd.DataFrame:
    """One row per input row: its (K, A, L, N_act, N), the predicted Delta (X-MoD minus
    dense of the same N_act and L at the same FLOPs; a dense row gets Eq. 14 at K = 1,
    its constant e), the interval (NaN without draws) and the inputs outside the
    fitted ranges. The rows are counted by the law's own rule (:meth:`PaperLaw.counts`)."""
    frame = validate(rows, need_loss=False).frame
    cols, _, _ = eq14_inputs(frame, law.counts())
    x = paper.Point.of(*(cols[c].to_numpy(float) for c in (
        "params_active", "params_total", "context", "sparsity", "anchor_stride")))
    out = pd.DataFrame({c: v.to_numpy(float) for c, v in cols.items()})
    if "run_id" in frame:  # a planned sweep's rows (xmod sweep --dry-run --plan) keep their ids
        out.insert(0, "run_id", frame["run_id"].to_numpy())
    out["delta"], out["delta_lo"], out["delta_hi"] = with_interval(law, x)
    out["outside"] = ["; ".join(law.outside(r)) for r in out[list(paper.TABLE8_RANGE)].to_dict(
        orient="records")]
    return out


def with_interval(law: paper.PaperLaw, x: paper.Point) -> tuple[np.ndarray, np.ndarray,
                                                                np.ndarray]:
    """Eq. 14's Delta at ``x`` and its :data:`INTERVAL` over the fit's bootstrap draws
    (NaN without draws)."""
    point = paper.delta(x, law.value)
    draws = law.draws()
    if not draws:
        return point, np.full(len(x), np.nan), np.full(len(x), np.nan)
    lo, hi = np.percentile(np.stack([paper.delta(x, p) for p in draws]), INTERVAL, axis=0)
    return point, lo, hi
