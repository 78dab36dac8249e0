"""``evaluate_run``: everything ``xmod eval RUN_DIR`` reports about a trained run.

Held-out loss under top-k and causal routing (:func:`xmodlm.eval.loss.evaluate` on fixed,
stratified windows of the chosen split), bits per byte, top-k/causal agreement,
per-sparse-block capacity actually used under causal routing, and accuracy on the
offline downstream tasks of :mod:`xmodlm.eval.tasks`.

Causal routing is reported under the run's threshold rule and under the ``half``
rule beside it (:mod:`xmodlm.eval.calibrate`), with what each spends: forward
FLOPs per token at the fractions actually routed, against the budget training
counted (every sparse block at k / T), and KV-cache bytes against the ideal.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from xmodlm import flops
from xmodlm.data.batches import check_tokenizer, load_manifest, load_split, val_batches
from xmodlm.data.tokenizer import Tokenizer
from xmodlm.errors import UserError
from xmodlm.eval import tasks as task_mod
from xmodlm.eval.calibrate import calibration_windows
from xmodlm.eval.loss import evaluate
from xmodlm.fileio import cache_dir
from xmodlm.flops import kv_bytes_formula
from xmodlm.runs import load_run, tokenizer_path


def evaluate_run(
    run_dir: str | Path,
    data_dir: str | Path | None = None,
    split: str = "test",
    tasks: Sequence[str] = task_mod.TASKS,
    max_batches: int = 8,
    batch_size: int | None = None,
    device: str = "cpu",
    dtype: str = "fp32",
    max_items: int = 200,
    seed: int = 0,
    items_dir: str | Path | None = None,
    step: int | None = None,
) -> dict[str, Any]:
    """Evaluate the newest loadable checkpoint of ``run_dir`` (or ``step``) on ``split``.

    ``data_dir`` defaults to the run config's ``data.dir``; ``items_dir`` (task
    items, built once and reused) to ``RUN_DIR/eval_items``. Returns a JSON-able
    dict: ``val_loss_topk``, ``val_loss_causal``, ``val_bpb``, ``val_bpb_causal``
    (the losses on ``split`` whatever it is; for a split other than ``val`` also under
    its own name: ``test_loss_topk``, ``test_loss_causal``, ``test_bpb``, ``test_bpb_causal``),
    ``routing_agreement`` (None without sparse blocks), ``capacity_causal`` (one
    fraction per sparse block; empty without), ``kv_bytes_per_token`` and
    ``kv_fraction`` (:func:`kv_cache_per_token`, on the first batch of windows),
    with MoE blocks ``expert_load_max_over_mean`` (per MoE layer, the busiest
    expert's assignments over the mean, averaged over the batches: 1 is even),
    and with sparse blocks: ``threshold_rule`` and ``threshold_source``
    (``checkpoint``, or calibrated here in memory for a run that never stored its
    thresholds), ``val_loss_causal_half`` and ``capacity_causal_half`` (the half
    rule), ``flops_per_token`` {``budget``, ``causal``, ``causal_half``, and each
    over the budget} and ``kv_bytes_ideal`` / ``kv_over_ideal``,
    ``tasks`` = {name: {accuracy, items, chance}} and bookkeeping (``checkpoint``,
    ``step``, ``split``, ``eval_tokens``).

    Long on purpose: one loaded model and one set of windows give every figure of
    the record above, in the order listed; each step adds its keys to ``result``,
    and split apart the steps would pass the model, batches and thresholds along.
    """
    names = task_mod.check_tasks(tasks)
    if max_batches < 1:
        raise UserError(f"max_batches must be at least 1, got {max_batches}")
    t0 = time.perf_counter()
    cfg, model, ckpt = load_run(run_dir, device=device, step=step)
    data_dir = Path(data_dir if data_dir is not None else cfg.data.dir)
    manifest = load_manifest(data_dir)
    if manifest["vocab_size"] > cfg.model.vocab_size:
        raise UserError(
            f"data directory {data_dir} has vocabulary {manifest['vocab_size']}, more than the"
            f" model's {cfg.model.vocab_size}: evaluate on the data the run was trained on"
        )
    check_tokenizer(Path(run_dir) / "tokenizer.json", manifest, data_dir)
    data = load_split(data_dir, split)
    context = cfg.model.context
    if len(data) < context + 1:
        raise UserError(
            f"split {split!r} of {data_dir} has {len(data)} tokens, fewer than context + 1 ="
            f" {context + 1}: prepare more held-out data"
        )
    bs = batch_size or cfg.train.batch_size
    # no more windows than the split holds without overlap (at least one)
    n_batches = max(1, min(max_batches, (len(data) - 1) // (context * bs)))
    batches = val_batches(data, n_batches, bs, context)
    source, calibration = None, None
    if model.routed_blocks():
        source = "checkpoint"
        if model.threshold_rule() == "half (not calibrated)":
            source = "calibrated here, not stored (xmod calibrate RUN stores it)"
            train = load_split(data_dir, "train")
            calibration = calibration_windows(train, context)
    ev = evaluate(model, batches, torch.device(device), dtype, manifest, split,
                  desc=f"eval {split} loss", calibration=calibration, compare_rules=True)
    result: dict[str, Any] = {
        "run_dir": str(run_dir),
        "checkpoint": str(ckpt),
        "step": int(ckpt.name.split("_")[1]),
        "split": split,
        "eval_tokens": n_batches * bs * context,
        "val_loss_topk": ev["val_loss_topk"],
        "val_loss_causal": ev["val_loss_causal"],
        "val_bpb": ev["val_bpb"],
        "val_bpb_causal": ev["val_bpb_causal"],
        "routing_agreement": ev.get("routing_agreement"),
        "capacity_causal": ev.get("capacity_causal", []),
        "capacity_target": cfg.model.depth.capacity if "s" in model.layout else None,
    }
    if split != "val":  # the val_* keys are kept for readers of earlier results
        for key in ("loss_topk", "loss_causal", "bpb", "bpb_causal"):
            result[f"{split}_{key}"] = result[f"val_{key}"]
    for key in ("coverage", "depth_hist", "jaccard", "stages", "stages_causal",
                "expert_load_max_over_mean"):
        if key in ev:
            result[key] = ev[key]
    result.update(kv_cache_per_token(model, batches[0][0].to(device)))
    if source is not None:
        budget = flops.count(cfg.model).flops_forward
        spent = {rule: flops.inference_flops(cfg.model, ev[f"capacity_causal{suffix}"])
                 for rule, suffix in (("causal", ""), ("causal_half", "_half"))}
        ideal = kv_bytes_formula(cfg.model, 1, dtype_bytes=model.embed.weight.element_size())
        result.update(
            threshold_rule=ev["threshold_rule"],
            threshold_source=source,
            val_loss_causal_half=ev["val_loss_causal_half"],
            capacity_causal_half=ev["capacity_causal_half"],
            flops_per_token={"budget": budget, **spent,
                             **{f"{k}_over_budget": v / budget for k, v in spent.items()}},
            kv_bytes_ideal=ideal,
            kv_over_ideal=result["kv_bytes_per_token"] / ideal,
        )
        if split != "val":
            result[f"{split}_loss_causal_half"] = ev["val_loss_causal_half"]
    result["tasks"] = {}
    if names:
        tok_file = _tokenizer_file(run_dir, data_dir)
        tok = Tokenizer.load(tok_file)
        where = (Path(items_dir) if items_dir is not None
                 else cache_dir(Path(run_dir) / "eval_items", "task items"))
        for name in names:
            items = task_mod.load_or_build_items(name, data_dir, where, split, seed, max_items)
            result["tasks"][name] = task_mod.score_task(name, items, model, tok, device)
    result["wall_s"] = time.perf_counter() - t0
    return result


@torch.no_grad()
def kv_cache_per_token(model: torch.nn.Module, tokens_BT: torch.Tensor) -> dict[str, Any]:
    """KV-cache bytes per token after prefilling real text under causal routing.

    What decoding keeps in memory per token of context: dense blocks cache every
    token, a sparse block only those its causal decision routes. Deterministic
    (no timing), so it is a fair per-run figure wherever the run is evaluated:
    ``kv_bytes_per_token`` over the windows ``tokens_BT`` (the cache's dtype),
    and ``kv_fraction``, that over the bytes if every block cached every token.
    """
    from xmodlm.model.generate import Decoder

    B, T = tokens_BT.shape
    decoder = Decoder(model, B, T, sparse_alloc="worst_case")
    decoder.prefill(tokens_BT.tolist())
    per_block = decoder.cache.blocks[0].token_bytes()  # the same for every block
    used = decoder.cache.bytes_used() / (B * T)
    return {"kv_bytes_per_token": used, "kv_fraction": used / (per_block * len(model.blocks))}


def _tokenizer_file(run_dir: str | Path, data_dir: Path) -> Path:
    try:
        return tokenizer_path(run_dir)
    except UserError:
        return data_dir / "tokenizer.json"  # Tokenizer.load names it if it is missing too
