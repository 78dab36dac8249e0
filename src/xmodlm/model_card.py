"""The model card of an export (``README.md``), written from the run's own record.

Everything in it is read, not typed: the architecture and routing from the model
config and the weights (the calibrated thresholds), the training data from the
corpus manifest, losses from ``summary.json`` and evaluation from ``eval.json``
(:data:`xmodlm.record.EVAL_FILE`). What a run did not record is said to be
missing, never guessed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from xmodlm.config import Config
from xmodlm.record import EVAL_FILE


def _read_json(path: Path) -> dict[str, Any]:
    """A record file of the run, or {} when it is missing or unreadable."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _num(value: Any, digits: int = 4) -> str:
    if isinstance(value, bool) or value is None:
        return "not recorded"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e5 else f"{value:.3e}"
    return str(value)


def _table(rows: list[tuple[str, Any]]) -> list[str]:
    return ["| | |", "|---|---|", *(f"| {k} | {_num(v) if not isinstance(v, str) else v} |"
                                   for k, v in rows)]


def model_card(run: Path, cfg: Config, model: Any, config: dict[str, Any]) -> str:
    """Markdown for an export of ``run`` (``model``: its loaded Transformer;
    ``config``: the export's config.json)."""
    m = cfg.model
    summary = _read_json(run / "summary.json")
    evaluation = _read_json(run / EVAL_FILE)
    env = _read_json(run / "env.json")
    source = config["source"]
    family = m.family
    lines = [
        "---",
        "library_name: transformers",
        "tags: [xmod-lm, mixture-of-depths, sparse-depth]",
        "---",
        "",
        f"# {source['run']}",
        "",
        f"A {family} language model trained with xmod-lm (checkpoint step {source['step']}).",
        "It loads with `transformers` alone (`torch` and `transformers`, no xmod-lm):",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        'model = AutoModelForCausalLM.from_pretrained("PATH", trust_remote_code=True)',
        'tok = AutoTokenizer.from_pretrained("PATH", padding_side="left", trust_remote_code=True)',
        'batch = tok(["The whale"], return_tensors="pt", padding=True)',
        "print(tok.decode(model.generate(**batch, max_new_tokens=30, do_sample=False)[0]))",
        "```",
        "",
        "## Architecture",
        "",
        *_table([
            ("layout (D dense, s sparse, E MoE)", f"`{m.block_layout}`"),
            ("blocks", m.num_blocks), ("width", m.d_model),
            ("heads", f"{m.n_heads} query / {m.attn_kv_heads} key-value of {m.attn_head_dim}"
                      + (", QK-norm" if m.qk_norm else "")),
            ("MLP width", m.ffn_dim if "E" not in m.block_layout else
             f"{m.n_experts} experts of {m.expert_dim}, top {m.moe_top_k}"),
            ("context", m.context), ("vocabulary", f"{m.vocab_size} (tokenizer"
                                                   f" {config['tokenizer_vocab_size']})"),
            ("parameters", summary.get("params_total", model.num_params())),
            ("active parameters", summary.get("params_active")),
            ("training FLOPs per token", summary.get("flops_per_token")),
            ("weights dtype", config["dtype"]),
        ]),
        "",
        "Pre-norm decoder: RMSNorm, rotary positions, causal attention, SwiGLU.",
        "",
        *_routing(model, cfg),
        "## Training data",
        "",
        *_data(cfg, summary),
        "## Losses",
        "",
        *_losses(summary),
        "## Evaluation",
        "",
        *_evaluation(evaluation),
        "## Provenance",
        "",
        *_table([
            ("run", f"`{source['run']}` (config `{source['config_name']}`)"),
            ("checkpoint", source["checkpoint"]),
            ("xmod-lm", config["xmodlm_version"]),
            ("commit", str(summary.get("commit") or env.get("git_commit") or "not recorded")),
            ("run config sha256", f"`{source['run_config_sha256'][:16]}...`"),
        ]),
        "",
    ]
    return "\n".join(lines)


def _routing(model: Any, cfg: Config) -> list[str]:
    m = cfg.model
    routed = model.routed_blocks()
    if not routed:
        return ["## Routing", "", "None: every block processes every token (dense).", ""]
    thresholds = ", ".join(f"{float(b.router.threshold):.4g}" for b in routed)
    rule = model.threshold_rule()
    return [
        "## Routing",
        "",
        f"Sparsity K = {m.depth.sparsity:g}, anchor stride A = {m.depth.anchor_stride:g},"
        f" dense prefix N0 = {m.depth.dense_prefix}: each sparse (`s`) block processes a",
        f"fraction 1/K = {m.depth.capacity:g} of the tokens in training (expert-choice top-k over",
        "the sequence). Top-k reads future tokens, so at inference each token is routed",
        "by a causal decision from that token alone: its decision logit"
        f" (`{m.causal_router}`) above the block's threshold.",
        "",
        *_table([
            ("gate", f"`{m.gating}` (scales a routed token's block output)"),
            ("causal decision", f"`{m.causal_router}`"),
            ("threshold rule", f"`{rule}`"),
            ("thresholds (per sparse block)", thresholds),
            ("depth-wise balancing weight", m.balance_coef),
        ]),
        "",
    ]


def _data(cfg: Config, summary: dict[str, Any]) -> list[str]:
    manifest = _read_json(Path(cfg.data.dir) / "manifest.json")
    rows: list[tuple[str, Any]] = [
        ("tokens trained", summary.get("tokens")), ("steps", summary.get("steps")),
        ("epochs", summary.get("epochs")), ("tokens per step", summary.get("batch_tokens")),
    ]
    if manifest:
        sources = manifest.get("sources") or []
        names = [s.get("name") or s.get("kind") or json.dumps(s) if isinstance(s, dict)
                 else str(s) for s in sources]
        rows.insert(0, ("sources", "; ".join(names) or "not recorded"))
        for split, entry in (manifest.get("splits") or {}).items():
            if isinstance(entry, dict) and "tokens" in entry:
                rows.append((f"{split} split tokens", entry["tokens"]))
    else:
        rows.insert(0, ("corpus", f"`{Path(cfg.data.dir).name}` (manifest not found here)"))
    return [*_table(rows), ""]


def _losses(summary: dict[str, Any]) -> list[str]:
    if not summary:
        return ["Not recorded: the run has no summary.json (unfinished or interrupted).", ""]
    return [
        "Held-out next-token loss (nats) at the end of training, under training-time",
        "(top-k) routing and under the causal routing this model runs:",
        "",
        *_table([
            ("status", summary.get("status", "not recorded")),
            ("validation loss, top-k", summary.get("final_val_loss")),
            ("validation loss, causal", summary.get("final_val_loss_causal")),
            ("bits per byte, top-k", summary.get("val_bpb")),
            ("bits per byte, causal", summary.get("val_bpb_causal")),
            ("top-k / causal agreement", summary.get("routing_agreement")),
        ]),
        "",
    ]


def _evaluation(evaluation: dict[str, Any]) -> list[str]:
    if not evaluation:
        return ["Not recorded: run `xmod eval RUN --json > RUN/eval.json` before exporting.", ""]
    rows: list[tuple[str, Any]] = [
        ("split", evaluation.get("split", "not recorded")),
        ("loss, top-k", evaluation.get("val_loss_topk")),
        ("loss, causal", evaluation.get("val_loss_causal")),
        ("threshold rule", evaluation.get("threshold_rule", "not recorded")),
        ("KV bytes per token of context", evaluation.get("kv_bytes_per_token")),
    ]
    for name, task in (evaluation.get("tasks") or {}).items():
        if isinstance(task, dict):
            rows.append((f"{name} accuracy", task.get("accuracy")))
    return [*_table(rows), ""]
