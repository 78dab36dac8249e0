"""``xmod demo``: the main job on the embedded defaults, end to end in a few minutes.

Prepares the default corpus, then trains ``dense-tiny`` and the FLOP-matched
``xmod-tiny`` on the *same compute budget* C (each gets D = C / F_token tokens)
and prints their validation losses side by side. Rerunning resumes or skips
finished runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from xmodlm import flops
from xmodlm.config import load_config
from xmodlm.data.prepare import prepare
from xmodlm.errors import UserError
from xmodlm.train.trainer import train

DEMO_PRESETS = ("dense-tiny", "xmod-tiny")
DEMO_COMPUTE = 1.6e13  # training FLOPs per model: about two minutes each on 2 CPU cores


def run_demo(
    data_dir: str | Path = "data/corpus",
    out_dir: str | Path = "runs/demo",
    compute: float = DEMO_COMPUTE,
    presets: tuple[str, ...] = DEMO_PRESETS,
) -> list[dict[str, Any]]:
    """Train each preset on ``compute`` FLOPs; return one row per model."""
    prepare(data_dir)
    rows = []
    for name in presets:
        cfg = load_config(
            name, [f"data.dir={data_dir}", f"train.compute={compute}", "train.eval_every=50"]
        )
        print(f"== {name}: layout {cfg.model.block_layout}, C = {compute:.3g} FLOPs", flush=True)
        summary = train(cfg, Path(out_dir) / name)
        if summary["status"] != "ok":
            raise UserError(
                f"{name} ended with status {summary['status']!r}: rerun `xmod demo` to resume"
            )
        counts = flops.count(cfg.model)
        rows.append(
            {
                "model": name,
                "layout": cfg.model.block_layout,
                "params_total": counts.params_total,
                "params_active": counts.params_active,
                "flops_per_token": counts.flops_train,
                "tokens": summary["tokens"],
                "val_loss_topk": summary["final_val_loss"],
                "val_loss_causal": summary["final_val_loss_causal"],
                "val_bpb": summary["val_bpb"],
                "wall_s": summary["wall_s"],
            }
        )
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'model':<12}{'layout':<14}{'params':>11}{'active':>11}{'F/token':>11}"
        f"{'tokens':>10}{'loss top-k':>12}{'loss causal':>12}{'bpb':>8}{'wall s':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['model']:<12}{r['layout']:<14}{r['params_total'] / 1e6:>10.2f}M"
            f"{r['params_active'] / 1e6:>10.2f}M{r['flops_per_token'] / 1e6:>10.1f}M"
            f"{r['tokens']:>10,}{r['val_loss_topk']:>12.4f}{r['val_loss_causal']:>12.4f}"
            f"{r['val_bpb']:>8.4f}{r['wall_s']:>8.0f}"
        )
    return "\n".join(lines)
