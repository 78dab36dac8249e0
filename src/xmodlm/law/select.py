"""Which runs a law is fitted on: one learning rate, one sparse variant, and the
dense partner of each sparse run under the paired baseline.

Steps of :func:`xmodlm.law.fit.fit_law` that choose rows before anything is
fitted, kept apart from the fitting; the law plots reuse two of them
(:func:`fitted_runs`, :func:`paired_baseline`) to show what was fitted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from xmodlm.errors import UserError
from xmodlm.law.table import validate
from xmodlm.pairing import NO_PARTNER, dense_partners

if TYPE_CHECKING:
    from xmodlm.law.lawfit import LawFit


def fitted_runs(fit: LawFit, df: pd.DataFrame) -> pd.DataFrame:
    """The rows of the table ``df`` that ``fit`` was fitted on (its loss, minimum
    length, learning rate and sparse variant), validated, in table order."""
    frame = validate(df, loss=fit.loss, min_steps=int(fit.runs.get("min_steps", 0))).frame
    frame, _, _ = one_lr(frame, fit.runs.get("lr"))
    variant = fit.runs.get("variant")
    if variant:
        frame = frame[~frame["is_sparse"] | (frame["variant"] == variant)]
    return frame.reset_index(drop=True)


def paired_baseline(frame: pd.DataFrame) -> np.ndarray:
    """ln L of each sparse run's FLOP-matched dense partner (NaN on dense rows).

    The paired baseline suits a study that gives every routed run a dense run of
    the same seed, context, width and budget but trains dense at one width per
    context: its dense law cannot be identified in N, so a delta measured
    against it would carry that law's whole uncertainty, while the paired
    difference cancels the seed's data order and needs no dense law at all.
    What it measures differs slightly: routed minus the dense reference at the
    same compute, the reference's size included (the dense-law baseline takes
    the dense law at the routed run's own N_ae and D). Every sparse run must have
    a partner; the first that has none is named.
    """
    missing = [c for c in ("width", "seed") if c not in frame]
    if missing:
        raise UserError(
            f"baseline paired needs column(s) {', '.join(missing)} to find each run's dense"
            " partner; use baseline law"
        )
    sparse = frame["is_sparse"].to_numpy()
    partners = dense_partners(frame, ~sparse)
    lonely = np.flatnonzero(sparse & (partners == NO_PARTNER))
    if len(lonely):
        row = frame.iloc[lonely[0]]
        raise UserError(
            f"baseline paired: {len(lonely)} sparse run(s) have no FLOP-matched dense run of the"
            f" same context, width, seed and budget (first: context {int(row['context'])},"
            f" width {row['width']:g}, seed {row['seed']:g}, compute {row['compute']:.3g});"
            " train their dense partners or use baseline law"
        )
    ln_l = np.log(frame["val_loss"].to_numpy(float))
    return np.where(sparse, ln_l[np.maximum(partners, 0)], np.nan)


def one_lr(frame: pd.DataFrame, lr: float | None) -> tuple[pd.DataFrame, float | None, int]:
    """The runs at one peak learning rate (``lr``, else the most common), the rate,
    and how many runs at other rates were left out; tables without ``lr`` pass."""
    if "lr" not in frame:
        if lr is not None:
            raise UserError(f"lr={lr:g}: the table has no lr column to select runs by")
        return frame, None, 0
    rates = pd.to_numeric(frame["lr"], errors="coerce")
    counts = rates.value_counts()
    if counts.empty:
        if lr is not None:
            raise UserError(f"lr={lr:g}: the table records no learning rate")
        return frame, None, 0
    if lr is None:
        top = counts[counts == counts.max()]
        if len(top) > 1:
            raise UserError(
                f"runs at {len(counts)} peak learning rates, {len(top)} of them equally common"
                f" ({', '.join(f'{r:g}' for r in sorted(top.index))}); a law pools one recipe:"
                " pass the one to fit (--lr)"
            )
        lr = float(top.index[0])
    elif not np.isclose(counts.index.to_numpy(float), lr, rtol=1e-9, atol=0).any():
        raise UserError(
            f"lr={lr:g}: no runs at that peak learning rate; the table has"
            f" {', '.join(f'{r:g}' for r in sorted(counts.index))}"
        )
    keep = np.isclose(rates.to_numpy(float), lr, rtol=1e-9, atol=0) | rates.isna().to_numpy()
    return frame[keep], float(lr), int((~keep).sum())


def one_variant(frame: pd.DataFrame, family: str) -> tuple[pd.DataFrame, str | None, dict]:
    """Dense runs plus the sparse runs of one variant; the others counted by variant."""
    sparse = frame["is_sparse"]
    variants = frame.loc[sparse, "variant"].value_counts()
    if variants.empty:
        return frame, None, {}
    if family in variants.index:
        chosen = family
    else:
        own = [v for v in variants.index if v.split("[")[0] == family]
        if not own:
            raise UserError(
                f"family {family!r} has no sparse runs in the table; it has:"
                f" {', '.join(sorted(variants.index))}"
            )
        chosen = family if family in own else max(own, key=lambda v: (variants[v], v))
    excluded = {str(v): int(n) for v, n in variants.items() if v != chosen}
    return frame[~sparse | (frame["variant"] == chosen)], str(chosen), excluded


