"""Calibrated causal routing: each sparse block routes, at inference, the fraction
of tokens it was trained to process.

Top-k in training processes exactly k = round(c T) tokens a sequence; the causal
decision at inference (decision logit above a threshold) processes whatever its
threshold lets through. Under the ``half`` rule (threshold 0, sigmoid(r) > 1/2) a
BCE-trained router lets through more than c, so inference spends more than FLOP
matching budgeted. Calibration sets each block's threshold on training text so
that it routes k / T (``Transformer.calibrate_thresholds_``, block by block under
causal routing).

When it runs: at every evaluation during training (so the causal losses in
``metrics.jsonl`` and the summary are under the calibrated rule, and every
checkpoint carries the thresholds of its last evaluation), and on demand with
``xmod calibrate RUN``, which rewrites the newest checkpoint's weights with fresh
thresholds (the training state is untouched: thresholds are buffers that no
training step reads). The calibration text is :data:`CALIBRATION_TOKENS` tokens of
the *training* split in fixed, stratified windows, never held-out text.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from xmodlm.data.batches import TokenData, load_split, val_batches
from xmodlm.errors import UserError
from xmodlm.fileio import atomic_write_json
from xmodlm.hardware import autocast_context
from xmodlm.model import Transformer
from xmodlm.runs import load_run, rewrite_model_weights

CALIBRATION_TOKENS = 32768
CALIBRATION_FILE = "calibration.json"
_SEED = 4321  # the windows' draw: not the validation windows' (1234)


def calibration_windows(
    train: TokenData, context: int, n_tokens: int = CALIBRATION_TOKENS
) -> torch.Tensor:
    """(N, T) windows of the training split, ``n_tokens`` in all (at least one
    window), stratified over the split and the same on every call."""
    n = max(1, n_tokens // context)
    return torch.cat([x for x, _ in val_batches(train, 1, n, context, seed=_SEED)])


def calibrate(
    model: Transformer, windows_NT: torch.Tensor, device: torch.device, dtype: str
) -> list[float]:
    """Calibrate ``model``'s thresholds on ``windows`` (in ``dtype``, as evaluation
    runs); returns them (empty without sparse blocks)."""
    was_training = model.training
    model.eval()
    with autocast_context(device, dtype):
        thresholds = model.calibrate_thresholds_(windows_NT.to(device))
    model.train(was_training)
    return thresholds



def calibrate_run(
    run_dir: str | Path,
    data_dir: str | Path | None = None,
    n_tokens: int | None = None,
    device: str = "cpu",
    dtype: str = "fp32",
) -> dict[str, Any]:
    """Calibrate the newest checkpoint of ``run_dir`` and store the thresholds in it.

    Rewrites that checkpoint's ``model.safetensors`` (atomically) and writes
    ``RUN_DIR/calibration.json``: the rule before, the thresholds, the calibration
    text (``n_tokens`` tokens, default :data:`CALIBRATION_TOKENS`). A dense or MoE
    run, or one whose rule is ``half``, has nothing to calibrate (a UserError).
    """
    n_tokens = CALIBRATION_TOKENS if n_tokens is None else n_tokens
    if n_tokens < 1:
        raise UserError(f"--tokens must be a positive number of tokens, got {n_tokens}")
    t0 = time.perf_counter()
    cfg, model, ckpt = load_run(run_dir, device=device)
    if not model.routed_blocks():
        raise UserError(f"run {str(run_dir)!r} has no sparse blocks: nothing to calibrate")
    if cfg.model.causal_threshold != "calibrated":
        raise UserError(
            f"run {str(run_dir)!r} routes by the 'half' rule (model.causal_threshold=half):"
            " it keeps no calibrated threshold"
        )
    before = model.threshold_rule()
    data = load_split(data_dir if data_dir is not None else cfg.data.dir, "train")
    windows = calibration_windows(data, cfg.model.context, n_tokens)
    thresholds = calibrate(model, windows, torch.device(device), dtype)
    rewrite_model_weights(ckpt, model)
    record = {
        "checkpoint": str(ckpt),
        "step": int(ckpt.name.split("_")[1]),
        "rule_before": before,
        "rule": model.threshold_rule(),
        "thresholds": thresholds,
        "capacity": cfg.model.depth.capacity,
        "split": "train",
        "tokens": int(windows.numel()),
        "dtype": dtype,
        "wall_s": time.perf_counter() - t0,
    }
    atomic_write_json(Path(run_dir) / CALIBRATION_FILE, record)
    return record
