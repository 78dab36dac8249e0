"""Synthetic run tables from a known law, for tests, benchmarks and demos.

Rows look like a real sweep's run records: isoFLOP tiers, several context
lengths, dense models on the width/depth ladder of :func:`dense_config`, and
X-MoD models FLOP-matched to them with :func:`xmodlm.flops.flop_match`, so
parameters, FLOPs and tokens obey the project's own accounting. The loss is the
true dense law at (N_ae, D) plus the true delta, times log-normal noise of
``sigma`` in ln L. val_bpb assumes 4 bytes per token (there is no text).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from xmodlm import depth, flops, record
from xmodlm.config import ModelConfig
from xmodlm.errors import UserError
from xmodlm.law import delta, dense
from xmodlm.law.recommend import dense_config
from xmodlm.law.table import RUN_COLUMNS

TRUE_DENSE = {"E": 1.8, "A": 40.0, "B": 80.0, "alpha": 0.30, "beta": 0.25}
TRUE_DELTA = {"g_cap": 0.03, "g_ctx": 0.01, "g_int": -0.005}  # for the ``base`` form
WIDTHS = (64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
TOKENS_PER_PARAM = (2.0, 500.0)  # the isoFLOP window: D / N_ae of the models a tier trains
BYTES_PER_TOKEN = 4.0


@functools.lru_cache(maxsize=4096)
def _model(
    width: int, context: int, stride: int, capacity: float, vocab: int
) -> tuple[ModelConfig, flops.Counts]:
    """The dense ladder model at ``width``, FLOP-matched to (stride, capacity) when sparse."""
    cfg = dense_config(width, context, vocab)
    if depth.routes(stride, capacity):
        cfg, _ = flops.flop_match(cfg, stride, capacity)
    return cfg, flops.count(cfg)


SYNTHETIC_STEPS = 10_000  # nominal: synthetic runs stand for runs past the law's minimum


def synthetic_runs(
    n: int,
    true_dense: Mapping[str, float] = TRUE_DENSE,
    true_delta_form: str = "base",
    true_delta_params: Mapping[str, float] = TRUE_DELTA,
    sigma: float = 0.01,
    seed: int = 0,
    *,
    contexts: Sequence[int] = (256, 1024),
    computes: Sequence[float] = (1e15, 1e16, 1e17, 1e18),
    dense_fraction: float = 0.4,
    strides: Sequence[int] = (2, 4, 8),
    capacities: Sequence[float] = (0.125, 0.25, 0.5),
    vocab_size: int = 4096,
) -> pd.DataFrame:
    """``n`` run records (run-record schema) drawn from a known dense law and delta form.

    Compute tiers and contexts are assigned round-robin so every tier has every
    context; the first ``dense_fraction`` of rows (in a shuffled order) are dense.
    """
    form = delta.get_form(true_delta_form)
    missing = [
        k for k in (*dense.NAMES, *form.names) if k not in {**true_dense, **true_delta_params}
    ]
    if missing:
        raise UserError(f"synthetic law is missing parameter(s) {', '.join(missing)}")
    if n < 1 or sigma < 0 or not 0 <= dense_fraction <= 1:
        raise UserError("synthetic_runs: need n >= 1, sigma >= 0 and dense_fraction in [0, 1]")
    rng = np.random.default_rng(seed)
    is_dense = rng.permutation(n) < round(dense_fraction * n)
    rows, rhos = [], []
    for i in range(n):
        compute = float(computes[i % len(computes)])
        context = int(contexts[(i // len(computes)) % len(contexts)])
        stride, capacity = (
            (1, 1.0) if is_dense[i] else (int(rng.choice(strides)), float(rng.choice(capacities)))
        )
        fits = []
        for width in WIDTHS:
            cfg, counts = _model(width, context, stride, capacity, vocab_size)
            ratio = compute / counts.flops_train / counts.params_active
            if TOKENS_PER_PARAM[0] <= ratio <= TOKENS_PER_PARAM[1]:
                fits.append((cfg, counts))
        if not fits:
            raise UserError(
                f"synthetic_runs: no ladder model trains at compute {compute:g}; use 1e13..1e19"
            )
        cfg, counts = fits[rng.integers(len(fits))]
        rhos.append(flops.expansion_ratio(cfg))
        rows.append(
            {
                **record.config_row(cfg, counts),
                "tokens": compute / counts.flops_train,
                "compute": compute,
                "seed": seed,
                "steps": SYNTHETIC_STEPS,
                "status": "ok",
            }
        )
    frame = pd.DataFrame(rows)
    x = delta.Features.of(frame.assign(rho=rhos), delta.REFERENCE)
    truth_dense = np.array([true_dense[k] for k in dense.NAMES])
    truth_delta = np.array([true_delta_params[k] for k in form.names])
    ln_loss = (
        dense.log_loss(truth_dense, np.log(frame["params_active"]), np.log(frame["tokens"]))
        + form.predict(truth_delta, x)
        + sigma * rng.standard_normal(n)
    )
    frame["val_loss"] = np.exp(ln_loss)
    frame["val_bpb"] = frame["val_loss"] / np.log(2) / BYTES_PER_TOKEN
    return frame[[*RUN_COLUMNS, "steps"]]
