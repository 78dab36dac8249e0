"""The token-choice bias sweep: tau in {0, 0.1, 0.3, 1, 3} on an A1K8 X-MoD of the
cpu-d64 backbone (8 active layers, dense prefix 2: 29 blocks) at L = 256.

Each run trains with `xmod train` (fp32, eager, one seed) and is summarised from its
last evaluation: validation loss under top-k and causal routing, and per stage the
coverage and adjacent-block Jaccard of the top-k selections, beside the identical-
subset and independent-random references. tau = 0 is the model without the bias.

    python results/token-bias/run.py            # runs what is missing, then the table
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TAUS = (0.0, 0.1, 0.3, 1.0, 3.0)
SETS = ["model.sparsity=8", "model.anchor_stride=1", "model.context=256", "train.batch_size=8",
        "train.max_steps=300", "train.warmup_steps=30", "train.eval_every=150",
        "train.ckpt_every=150", "train.dtype=fp32", "train.compile=off", "data.val_batches=8"]


def run(tau: float) -> Path:
    out = HERE / "runs" / f"tau{tau:g}"
    if not (out / "summary.json").is_file():
        cmd = [sys.executable, "-m", "xmodlm", "train", "cpu-d64", "--out", str(out), "--quiet",
               *[a for s in [*SETS, f"model.token_bias_tau={tau}"] for a in ("--set", s)]]
        subprocess.run(cmd, check=True)
    return out


def row(tau: float, out: Path) -> dict:
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [e for e in evals if e.get("kind") == "eval"][-1]
    stages = last["stages"]
    mean = lambda key: statistics.fmean(s[key] for s in stages)  # noqa: E731
    return {
        "tau": tau, "step": last["step"],
        "val_loss_topk": last["val_loss_topk"], "val_loss_causal": last["val_loss_causal"],
        "coverage": mean("coverage"), "jaccard": mean("jaccard"),
        "coverage_random": statistics.fmean(s["random"]["coverage"] for s in stages),
        "jaccard_random": statistics.fmean(s["random"]["jaccard"] for s in stages),
        "coverage_identical": statistics.fmean(s["identical"]["coverage"] for s in stages),
        "agreement": last.get("routing_agreement"),
    }


def main() -> None:
    rows = [row(tau, run(tau)) for tau in TAUS]
    (HERE / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    head = ("| tau | val loss top-k | causal | coverage | Jaccard | random coverage / Jaccard"
            " | identical coverage | top-k/causal agreement |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['tau']:g} | {r['val_loss_topk']:.4f} | {r['val_loss_causal']:.4f} |"
            f" {r['coverage']:.3f} | {r['jaccard']:.3f} | {r['coverage_random']:.3f} /"
            f" {r['jaccard_random']:.3f} | {r['coverage_identical']:.3f} |"
            f" {r['agreement'] if r['agreement'] is None else format(r['agreement'], '.3f')} |")
    (HERE / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
