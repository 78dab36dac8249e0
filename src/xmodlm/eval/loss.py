"""Validation loss under both routings, bits per byte and routing statistics.

One function serves evaluation inside training (the trainer calls it every
``eval_every`` steps) and ``xmod eval`` after it, so the two can never disagree.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from xmodlm.data.batches import bits_per_byte
from xmodlm.eval.calibrate import calibrate
from xmodlm.hardware import autocast_context
from xmodlm.model import Transformer
from xmodlm.progress import track


@torch.no_grad()
def evaluate(
    model: Transformer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    dtype: str,
    manifest: dict[str, Any] | None = None,
    split: str = "val",
    desc: str | None = None,
    calibration: torch.Tensor | None = None,
    compare_rules: bool = False,
) -> dict[str, Any]:
    """Validation loss under top-k and causal routing, bits per byte, routing stats.

    Causal routing follows the model's threshold rule (``threshold_rule`` in the
    result). ``calibration``: training windows to calibrate the thresholds on
    first (:mod:`xmodlm.eval.calibrate`), for a model whose rule is ``calibrated``.
    ``compare_rules``: also the causal loss and routed fractions under the
    ``half`` rule (``val_loss_causal_half``, ``capacity_causal_half``), beside the
    rule in effect. ``desc``: the stage name of a progress display on stderr, per
    batch (none without it: the trainer's own bar covers evaluation inside training).
    """
    routed = "s" in model.layout
    if calibration is not None and routed and model.cfg.causal_threshold == "calibrated":
        calibrate(model, calibration, device, dtype)
    was_training = model.training
    model.eval()
    # causal routing under the rule in effect ("") and, compared, the half rule;
    # a model without sparse blocks routes causally as it does by top-k
    rules = {"": None, **({"_half": "half"} if compare_rules else {})} if routed else {}
    sums = dict.fromkeys(["topk", "causal", *(f"causal{s}" for s in rules)], 0.0)
    stats_acc: dict[str, list[Any]] = {}
    for x, y in (track(batches, desc, unit="batch") if desc else batches):
        x, y = x.to(device), y.to(device)
        with autocast_context(device, dtype):
            out_t = model(x, y, routing_mode="topk", return_stats=True)
            sums["topk"] += float(out_t.loss)
            if not routed:
                sums["causal"] += float(out_t.loss)
            for suffix, rule in rules.items():
                with model.using_threshold_rule(rule) if rule else contextlib.nullcontext():
                    out_c = model(x, y, routing_mode="causal", return_stats=True)
                sums[f"causal{suffix}"] += float(out_c.loss)
                stats_acc.setdefault(f"capacity_causal{suffix}", []).append(
                    out_c.stats["capacity_used"]
                )
                stats_acc.setdefault(f"stages_causal{suffix}", []).append(out_c.stats["stages"])
        for key, value in out_t.stats.items():
            stats_acc.setdefault(key, []).append(value)
    model.train(was_training)
    n = len(batches)
    result: dict[str, Any] = {
        "val_loss_topk": sums["topk"] / n,
        "val_loss_causal": sums["causal"] / n,
    }
    if routed:
        result["threshold_rule"] = model.threshold_rule()
    if "causal_half" in sums:
        result["val_loss_causal_half"] = sums["causal_half"] / n
    if manifest is not None:
        result["val_bpb"] = bits_per_byte(result["val_loss_topk"], manifest, split)
        result["val_bpb_causal"] = bits_per_byte(result["val_loss_causal"], manifest, split)
    for key, values in stats_acc.items():
        result[key] = _mean_nested(values)
    if "agreement_mean" in result:
        result["routing_agreement"] = result.pop("agreement_mean")
    return result


def _mean_nested(values: list[Any]) -> Any:
    """The mean over batches of numbers, or of lists and dicts of them (None stays None)."""
    first = values[0]
    if isinstance(first, dict):
        return {k: _mean_nested([v[k] for v in values]) for k in first}
    if isinstance(first, list):
        return [_mean_nested([v[i] for v in values]) for i in range(len(first))]
    if first is None:
        return None
    return sum(values) / len(values)
