"""Synthetic sweeps drawn from Eq. 14, for the recovery test and demos.

The design follows the paper's appendix B.4: a K and L sweep at N_act 556M, A = 1
(L 2k-32k, K = 3 added at 2k); a scale sweep at L = 32k, A = 1 (N_act 165M-936M);
an anchor-stride sweep at N_act 165M, L = 32k (A 0.5-5, K 4-16); and the
out-of-range groups named before fitting (L = 64k at K 16-24, N_act 1.65B at K
14-20). Every model is built by the paper's construction on its backbone
(:mod:`xmodlm.law.backbone`), N_act and N are its dense and its own totals with
embeddings (the counts :func:`xmodlm.law.reference.law_frame` reads from run
records), and Delta is Eq. 14 at the given parameters plus Gaussian noise of
``noise`` nats on the observed loss. :func:`results_table` writes the same runs
as run records beside their dense references, for the whole pipeline.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

from xmodlm import record
from xmodlm.law import backbone as bb
from xmodlm.law import paper

K_SWEEP = (2, 4, 8, 12, 16, 24, 32)
CONTEXTS = (2048, 4096, 8192, 16384, 32768)
SCALES = (165e6, 298e6, 556e6, 936e6)
SCALE_K = (4, 8, 12, 16, 20, 24)
A_SWEEP = (0.5, 1.0, 2.0, 3.0, 4.0, 5.0)
A_K = (4, 8, 12, 16)
DENSE_LOSS = 2.8  # the reference's loss, only for the raw losses of the table
OUT_OF_RANGE = {"context": 65536, "params_active": 1.5e9}  # 1.65B: dense total 1.62B


def design() -> list[tuple[float, int, float, float]]:
    """(N_act, L, K, A) of every synthetic run, in-range sweeps then out-of-range groups."""
    rows = [(556e6, L, float(k), 1.0) for L in CONTEXTS for k in K_SWEEP]
    rows.append((556e6, 2048, 3.0, 1.0))
    rows += [(n, 32768, float(k), 1.0) for n in SCALES for k in SCALE_K]
    rows += [(165e6, 32768, float(k), a) for a in A_SWEEP for k in A_K if a != 1.0]
    rows += [(556e6, 65536, float(k), 1.0) for k in (16, 18, 20, 22, 24)]
    rows += [(1.65e9, 32768, float(k), 1.0) for k in (14, 16, 18, 20)]
    return list(dict.fromkeys(rows))


def table(params: Mapping[str, float] | None = None, noise: float = 0.005, seed: int = 0
          ) -> pd.DataFrame:
    """One row per run: its (N_act, N, L, K, A, N0), the dense reference's loss, its
    observed loss and Delta (loss minus reference)."""
    params = dict(params or paper.TABLE8)
    rng = np.random.default_rng(seed)
    out = []
    for n_act, context, k, a in design():
        b = bb.backbone_for(n_act)
        m = bb.build(b, k, a)
        out.append({"params_active": float(b.dense_total), "label": n_act,
                    "params_total": float(m.params_total),
                    "context": context, "sparsity": k, "anchor_stride": a,
                    "dense_prefix": m.dense_prefix, "blocks": m.blocks})
    frame = pd.DataFrame(out)
    truth = paper.delta(paper.Point.of(*(frame[c].to_numpy(float) for c in (
        "params_active", "params_total", "context", "sparsity", "anchor_stride"))), params)
    frame["delta_true"] = truth
    frame["delta"] = truth + rng.normal(0.0, noise, len(frame))
    frame["reference_loss"] = DENSE_LOSS
    frame["val_loss"] = DENSE_LOSS + frame["delta"]
    frame["reference"] = "synthetic"
    return frame


COMPUTE = 1e20


def results_table(params: Mapping[str, float] | None = None, noise: float = 0.005,
                  seed: int = 0) -> pd.DataFrame:
    """The runs of :func:`table` as results-table rows (the run-record columns the law
    reads), each (N_act, L) with its dense run at the same compute, whose final
    point is every sparse run's reference."""
    runs = table(params, noise, seed)
    rows = []
    for (label, context), group in runs.groupby(["label", "context"], sort=True):
        b = bb.backbone_for(label)
        for m, loss, rid in [(bb.build(b, 1, 0, 0), DENSE_LOSS, f"dense-{label:.3g}-{context}")] + [
                (bb.build(b, r.sparsity, r.anchor_stride), r.val_loss,
                 f"xmod-{label:.3g}-{context}-A{r.anchor_stride:g}K{r.sparsity:g}")
                for r in group.itertuples()]:
            counts = bb.paper_counts(m, int(context))
            rows.append({
                **record.config_row(bb.model_config(m, int(context)), counts),
                "run_id": rid, "status": "ok", "tokens": COMPUTE / counts.flops_train,
                "compute": COMPUTE, "seed": 0, "val_loss": loss, "val_loss_causal": loss,
                "steps": 40_000,
            })
    return pd.DataFrame(rows)
