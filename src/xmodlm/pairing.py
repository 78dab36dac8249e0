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
  same budget; only whole optimiser steps separate them);
* of those, one that ran on the same CPU kind, dtype and compile mode
  (:data:`xmodlm.record.PAIRING_COLUMNS`) where there is one: a long study spans
  machines, and its dense reference rerun on the new machine is the routed run's
  partner there; then the nearest compute.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from xmodlm.record import PAIRING_COLUMNS

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
    machine = [df[c].astype(str).to_numpy(object) for c in PAIRING_COLUMNS if c in df]
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
        candidates, gap = candidates[gap <= MATCH_TOLERANCE], gap[gap <= MATCH_TOLERANCE]
        if not len(candidates):
            continue
        other_machine = np.zeros(len(candidates), dtype=int)
        for col in machine:
            other_machine += col[candidates] != col[i]
        out[i] = candidates[np.lexsort((gap, other_machine))[0]]
    return out
