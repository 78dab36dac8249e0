"""The run record: one home for what a run reports and for the rules that read it.

Every finished run writes ``summary.json``; ``xmod sweep`` turns summaries into
``results.csv`` rows; the law and the report read those rows. The columns, the
derived block layout, the family a layout belongs to, the rule for "is this run
sparse?", the expansion ratio rho and the mapping of a config plus its counts to
a row are defined here once: the config derives its layout and family here, the
trainer's summary, the results table's row for a failed run and the sweep's plan
all take their columns from :func:`config_row`, and the law, the report and the
FLOP count all take rho from :func:`expansion_ratio`. Plain Python, no torch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the config imports this module: names only, for the annotations
    from xmodlm.config import ModelConfig
    from xmodlm.flops import Counts

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
    "run_id", "val_loss_causal", "routing_agreement", "wall_s",
    "steps", "batch_tokens", "lr", "warmup_steps", "epochs", "layout", "commit", "error",
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
    "stride": 2, "capacity": 0.125, "gating": "logit", "balance_coef": 0.0,
}
XMOD_DEFAULTS: dict[str, Any] = {"gating": "variance_scaled", "balance_coef": 1e-2}
MOE_DEFAULTS: dict[str, Any] = {"n_experts": 8, "moe_top_k": 2}


def moe_expert_dim(ffn_dim: int, top_k: int) -> int:
    """Expert width that keeps an MoE block's active MLP FLOPs those of the dense MLP:
    top_k experts of width ffn / top_k (at least 32)."""
    return max(32, ffn_dim // top_k)


DENSE = "dense"  # the family every other one is FLOP-matched and compared against


def routes(stride: int, capacity: float) -> bool:
    """Whether the derived layout has sparse blocks: an anchor stride above one and a
    capacity below one (otherwise every block is dense)."""
    return stride > 1 and capacity < 1


def derive_layout(n_layers: int, stride: int, capacity: float, mlp: str = "swiglu") -> str:
    """The per-block layout of (depth, stride, capacity, MLP): ``D`` dense/anchor, ``s``
    sparse, ``E`` MoE. Block 0 is always an anchor, so every token sees one full block
    before any routing decision; then every S-th block is an anchor."""
    dense = "E" if mlp == "moe" else "D"
    if not routes(stride, capacity):
        return dense * n_layers
    return "".join(dense if i % stride == 0 else "s" for i in range(n_layers))


def family(layout: str, gating: str, stride: int) -> str:
    """The family name a run records, from its layout: ``moe`` with an MoE block,
    ``dense`` without a sparse one, ``mod`` on the Mixture-of-Depths recipe's stride
    and gate, else ``xmod``. A label for tables, never branched on in the model."""
    if "E" in layout:
        return "moe"
    if "s" not in layout:
        return DENSE
    if gating == MOD_RECIPE["gating"] and stride == MOD_RECIPE["stride"]:
        return "mod"
    return "xmod"


def is_dense(family_name: Any) -> Any:
    """Whether a recorded family is the dense reference (works on a scalar or on a
    pandas column): the report pairs every other family with these runs."""
    return family_name == DENSE


def is_sparse(stride: int, capacity: float, layout: str | None = None) -> bool:
    """A run is sparse when some block routes: its layout has an ``s``; without a
    recorded layout, when its derived layout would have one (:func:`routes`)."""
    if layout:
        return "s" in layout
    return routes(stride, capacity)


def first_anchor_only(layout: str, stride: int) -> bool:
    """The anchors ablation: one anchor, then only sparse blocks (fewer anchors than the
    stride would place)."""
    return layout.startswith("D") and set(layout[1:]) == {"s"} and stride < len(layout)


def active_depth(layout: str, fraction: float) -> float:
    """Active-equivalent depth: anchors (and MoE blocks) count 1, a sparse block the
    ``fraction`` of tokens it processes (k / T as executed: :func:`xmodlm.flops.active_depth`)."""
    n_sparse = layout.count("s")
    return (len(layout) - n_sparse) + fraction * n_sparse


def expansion_ratio(layout: str, fraction: float) -> float:
    """rho = L / L_active of a layout whose sparse blocks process ``fraction`` of the
    tokens. For the derived layout this is S / (1 + c (S - 1)) at any depth that is a
    multiple of S; an explicit layout (the anchors ablation) has its own."""
    return len(layout) / active_depth(layout, fraction)


def config_row(model: ModelConfig, counts: Counts) -> dict[str, Any]:
    """The columns a run's configuration and its analytic counts fill in a results row
    (and in ``summary.json``, the sweep's plan, a failed run's row), in one order."""
    return {
        "family": model.family,
        "width": model.d_model,
        "n_layers": model.n_layers,
        "stride": model.stride,
        "capacity": model.capacity,
        "context": model.context,
        "gating": model.gating,
        "balance_coef": model.balance_coef,
        "layout": model.block_layout,
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
