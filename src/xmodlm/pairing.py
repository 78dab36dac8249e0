"""Which dense run a routed run is compared with: its FLOP-matched dense partner.

The sweeps give every routed run a dense run of the same budget, and every
comparison the project reports (the sweep report's paired differences, the law's
paired baseline) is routed-minus-partner. The rule lives here so that both agree:

* same context length, width (the dense reference a routed model is FLOP-matched
  to has the routed model's width) and seed (so the same data order);
* the same peak learning rate where the table records one and a dense run at
  that rate exists (a learning-rate sweep pairs at equal rates);
* the same optimiser where the table records it (AdamW and Muon runs are other
  models, never each other's reference);
* training compute within ``MATCH_TOLERANCE`` in ln C (the sweep gives both the
  same budget; only whole optimiser steps separate them), the nearest one when
  several qualify.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

MATCH_TOLERANCE = 0.1  # |ln C_run - ln C_dense| for two runs of one budget
NO_PARTNER = -1


def dense_partners(df: pd.DataFrame, dense: np.ndarray | pd.Series) -> np.ndarray:
    """For each row, the position (0-based, in ``df``) of its dense partner.

    ``dense``: a boolean mask of the dense rows, the candidates. Dense rows and
    rows without a partner get ``NO_PARTNER``. ``df`` needs ``context``,
    ``width``, ``seed`` and ``compute`` columns; ``lr`` is used where present.
    """
    is_dense = np.asarray(dense, dtype=bool)
    context = df["context"].to_numpy(float)
    width = df["width"].to_numpy(float)
    seed = df["seed"].to_numpy(float)
    ln_c = np.log(df["compute"].to_numpy(float))
    lr = pd.to_numeric(df["lr"], errors="coerce").to_numpy(float) if "lr" in df else None
    optimizer = df["optimizer"].to_numpy(object) if "optimizer" in df else None
    out = np.full(len(df), NO_PARTNER, dtype=int)
    for i in np.flatnonzero(~is_dense):
        same = is_dense & (context == context[i]) & (width == width[i]) & (seed == seed[i])
        if lr is not None and np.isfinite(lr[i]) and (same & (lr == lr[i])).any():
            same &= lr == lr[i]
        if optimizer is not None and pd.notna(optimizer[i]):
            same &= optimizer == optimizer[i]  # another optimiser is another model
        candidates = np.flatnonzero(same)
        if not len(candidates):
            continue
        gap = np.abs(ln_c[candidates] - ln_c[i])
        if gap.min() <= MATCH_TOLERANCE:
            out[i] = candidates[int(gap.argmin())]
    return out
