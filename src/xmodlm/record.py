"""The run record: one home for what a run reports and for the rules that read it.

Every finished run writes ``summary.json``; ``xmod sweep`` turns summaries into
``results.csv`` rows; the law and the report read those rows. The columns, the
family a layout belongs to, the rule for "is this run sparse?" and the mapping of
a config plus its counts to a row are defined here once: the config derives its
family here, and the trainer's summary, the results table's row for a failed run
and the sweep's plan all take their columns from :func:`config_row`. The layout
itself, active depth and rho come from :mod:`xmodlm.depth`. Plain Python, no torch.
"""

from __future__ import annotations

import math
from typing import Any

from xmodlm import depth

# What the law needs of every run (DESIGN 5), in this order.
RUN_COLUMNS = (
    "family", "width", "n_layers", "stride", "capacity", "context", "gating", "balance_coef",
    "params_total", "params_active", "flops_per_token", "tokens", "compute", "seed",
    "val_loss", "val_bpb", "status",
)
# What a reader needs to check a row: the causal loss, how long the run trained and
# on what, which code it ran, and why it failed if it did.
# What a compared pair must share besides seed, data and budget: the same run on
# another CPU kind, dtype or compile mode is another draw (0.037 nats apart, measured).
PAIRING_COLUMNS = ("cpu_kind", "dtype", "compile")
EXTRA_COLUMNS = (
    "params_non_embedding", "sparsity", "anchor_stride", "dense_prefix", "balance", "token_bias_tau",
    "run_id", "val_loss_causal", "routing_agreement", "wall_s",
    "steps", "batch_tokens", "optimizer", "lr", "warmup_steps", "epochs", "layout", "commit", "error",
    *PAIRING_COLUMNS,
)
# From ``eval.json``, where the sweep evaluated the final checkpoint (spec ``eval``):
# the held-out loss on the evaluation split under both routings, the KV-cache
# bytes per token of context under causal routing; for sparse models the causal
# threshold rule, the causal loss under the half rule beside it, and what causal
# routing spends (forward FLOPs over the training budget, KV bytes over the ideal
# for c); and one ``task_<name>`` accuracy column per downstream task (added as
# they appear).
EVAL_COLUMNS = ("eval_split", "eval_loss_topk", "eval_loss_causal", "kv_bytes_per_token",
                "threshold_rule", "eval_loss_causal_half", "flops_causal_over_budget",
                "kv_over_ideal")
EVAL_FILE = "eval.json"  # in a run directory: ``xmod eval --json`` of its final checkpoint
COLUMNS = RUN_COLUMNS + EXTRA_COLUMNS + EVAL_COLUMNS


def evaluated_losses(df: Any) -> tuple[Any, str | None]:
    """The finished runs of a table with each loss taken from its final checkpoint's
    evaluation on a whole held-out split, where every run has one, and that split's
    name; else the table as given and None.

    Why: the in-training validation loss reads ``data.val_batches`` batches (16k
    tokens in the paper-cpu studies), the sweep's evaluation the whole split (262k):
    the same model at the same step, measured with a sixteenth of the sampling noise.
    ``val_loss`` / ``val_loss_causal`` become the evaluated top-k / causal losses, the
    in-training ones kept as ``train_val_loss`` / ``train_val_loss_causal``. All or
    nothing: a table mixing the two would compare losses of two measurements.
    """
    import pandas as pd

    cols = ("eval_loss_topk", "eval_loss_causal", "eval_split")
    if df.empty or not all(c in df.columns for c in cols):
        return df, None
    topk = pd.to_numeric(df["eval_loss_topk"], errors="coerce")
    causal = pd.to_numeric(df["eval_loss_causal"], errors="coerce")
    splits = set(df["eval_split"].astype(str))
    if not (topk.gt(0).all() and causal.gt(0).all()) or len(splits) != 1:
        return df, None
    out = df.copy()
    out["train_val_loss"] = out["val_loss"]
    out["train_val_loss_causal"] = out["val_loss_causal"] if "val_loss_causal" in out else None
    out["val_loss"], out["val_loss_causal"] = topk, causal
    return out, splits.pop()


def eval_columns(result: dict[str, Any]) -> dict[str, Any]:
    """Results-table columns from an ``xmod eval --json`` result."""
    row = {
        "eval_split": result.get("split"),
        "eval_loss_topk": result.get("val_loss_topk"),
        "eval_loss_causal": result.get("val_loss_causal"),
        "kv_bytes_per_token": result.get("kv_bytes_per_token"),
        "threshold_rule": result.get("threshold_rule"),
        "eval_loss_causal_half": result.get("val_loss_causal_half"),
        "flops_causal_over_budget": (result.get("flops_per_token") or {}).get("causal_over_budget"),
        "kv_over_ideal": result.get("kv_over_ideal"),
    }
    for name, task in (result.get("tasks") or {}).items():
        row[f"task_{name}"] = task.get("accuracy")
    return row

# The original Mixture-of-Depths recipe (DESIGN 6): one routed block per pair,
# 12.5% capacity, the raw router logit as the gate, no depth-wise balancing.
MOD_RECIPE: dict[str, Any] = {
    "stride": 2, "capacity": 0.125, "gating": "logit", "balance": "none", "balance_coef": 0.0,
}
# the X-MoD of the (S, c) sweeps: the squared-CV balancing loss, not the token bias
XMOD_DEFAULTS: dict[str, Any] = {"gating": "variance_scaled", "balance": "cv",
                                 "balance_coef": 1e-2}
MOE_DEFAULTS: dict[str, Any] = {"n_experts": 8, "moe_top_k": 2}


def moe_expert_dim(ffn_dim: int, top_k: int) -> int:
    """Expert width that keeps an MoE block's active MLP FLOPs those of the dense MLP:
    top_k experts of width ffn / top_k (at least 32)."""
    return max(32, ffn_dim // top_k)


DENSE = "dense"  # the family every other one is FLOP-matched and compared against


def family(layout: str, gating: str, stride: int, gate_scope: str = "block") -> str:
    """The family name a run records, from its layout: ``moe`` with an MoE block,
    ``dense`` without a sparse one, ``mod`` with one sparse block per stage (S = 2,
    A K = 1) under a Mixture-of-Depths gate (the raw logit on the whole block, or the
    paper's Eq. 6 gate on the FFN only), else ``xmod``. A label for tables, never
    branched on in the model."""
    if "E" in layout:
        return "moe"
    if "s" not in layout:
        return DENSE
    if stride == MOD_RECIPE["stride"] and (gating == MOD_RECIPE["gating"] or gate_scope == "ffn"):
        return "mod"
    return "xmod"


def is_dense(family_name: Any) -> Any:
    """Whether a recorded family is the dense reference (works on a scalar or on a
    pandas column): the report pairs every other family with these runs."""
    return family_name == DENSE


def is_sparse(stride: int, capacity: float, layout: str | None = None) -> bool:
    """A run is sparse when some block routes: its layout has an ``s``; without a
    recorded layout, when its derived layout would have one (:func:`depth.routes`)."""
    if layout:
        return "s" in layout
    return depth.routes(stride, capacity)


def prefix_only(layout: str, stride: int) -> bool:
    """The anchors ablation: every dense block before the first sparse one (a dense
    prefix, then only sparse blocks), in a stack longer than the stride, where the
    construction would have placed anchors. Both ablations are this: the (S, c)
    stack's first block only, and the paper's stages without their closing anchors."""
    first = layout.find("s")
    return first > 0 and "D" not in layout[first:] and stride < len(layout)


def no_prefix(layout: str) -> bool:
    """The dense-prefix ablation: the stack begins with a sparse block."""
    return layout.startswith("s")


DEFAULT_OPTIMIZER = "adamw"  # the only optimiser before Muon; labels leave it unnamed


def recorded_mechanism(balance: Any, coef: Any, optimizer: Any) -> dict[str, Any]:
    """A row's balancing kind, coefficient and optimiser, with what a table from before
    they were recorded meant: the CV loss where it had a coefficient (as such a config
    loads), and AdamW."""
    import pandas as pd

    coef = 0.0 if pd.isna(coef) else float(coef)
    return {"balance": ("cv" if coef > 0 else "none") if pd.isna(balance) else str(balance),
            "balance_coef": coef,
            "optimizer": DEFAULT_OPTIMIZER if pd.isna(optimizer) else str(optimizer)}


def config_row(model: Any, counts: Any) -> dict[str, Any]:
    """The columns a run's configuration (a ``ModelConfig``) and its analytic counts
    (``flops.Counts``) fill in a results row (and in ``summary.json``, the sweep's
    plan, a failed run's row), in one order. Both descriptions of the sparse depth
    are recorded, resolved: (K, A, N0) and (S, c)."""
    d = model.depth
    return {
        "family": model.family,
        "width": model.d_model,
        "n_layers": len(d.layout),
        "stride": d.stride,
        "capacity": d.capacity,
        "sparsity": d.sparsity,
        "anchor_stride": d.anchor_stride,
        "dense_prefix": d.dense_prefix,
        "context": model.context,
        "gating": model.gating,
        "balance": model.balance if "s" in d.layout else "none",
        "balance_coef": model.balance_coef,
        "token_bias_tau": model.token_bias,
        "layout": d.layout,
        "params_total": counts.params_total,
        "params_non_embedding": counts.params_non_embedding,
        "params_active": counts.params_active,
        "flops_per_token": counts.flops_train,
    }


def row_from_summary(summary: dict[str, Any], run_id: str) -> dict[str, Any]:
    """A results-table row (``COLUMNS``) from a run's ``summary.json``."""
    s = summary
    loss = s.get("final_val_loss")
    row = {k: s.get(k) for k in COLUMNS}
    row.update({
        "compute": s["flops_per_token"] * s["tokens"],
        "val_loss": loss,
        "run_id": run_id,
        "val_loss_causal": s.get("final_val_loss_causal"),
        "error": None,
    })
    if s.get("status") == "diverged":
        row["error"] = f"diverged: {s.get('skipped_steps')} non-finite step(s) by step {s.get('steps')}"
    elif isinstance(loss, (int, float)) and not math.isfinite(loss):
        row["status"] = "diverged"
        row["error"] = f"diverged: validation loss {loss}"
    return row
