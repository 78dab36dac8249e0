"""The learning-rate check of the isoflop study as a table: validation loss (causal
routing) per family, end of the profile and peak rate, from the runs of
``results/isoflop`` (the rule's) and ``results/isoflop/lr-check`` (around it).

    python results/isoflop/lr_table.py
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENDS = {(64, 2): "width 64 x 2 (smallest)", (128, 3): "width 128 x 3 (largest)"}


def main() -> None:
    cells: dict[tuple[str, str], dict[float, float]] = {}
    for summary in sorted([*HERE.glob("runs/*/summary.json"), *HERE.glob("lr-check/runs/*/summary.json")]):
        s = json.loads(summary.read_text())
        if s.get("status") != "ok":
            continue
        flops = float(s["flops"])
        if abs(flops / 2.0e13 - 1) > 0.02:  # the check is at the 2e13 budget only
            continue
        ref = (s["width"], s["n_layers"]) if s["family"] == "dense" else None
        if s["family"] == "xmod":  # name X-MoD by the dense end it is FLOP-matched to
            ref = {(64, 8): (64, 2), (128, 8): (128, 3)}.get((s["width"], s["n_layers"]))
        if ref not in ENDS:
            continue
        cells.setdefault((ENDS[ref], s["family"]), {})[float(s["lr"])] = float(s["final_val_loss"])
    rates = sorted({lr for v in cells.values() for lr in v})
    print("| end | family | " + " | ".join(f"{lr:g}" for lr in rates) + " |")
    print("|---|---|" + "---|" * len(rates))
    for (end, family), by_lr in sorted(cells.items()):
        best = min(by_lr.values())
        row = [f"{by_lr[lr]:.4f}{' *' if by_lr[lr] == best else ''}" if lr in by_lr else "-"
               for lr in rates]
        print(f"| {end} | {family} | " + " | ".join(row) + " |")
    print("\n* the best rate of the row")


if __name__ == "__main__":
    main()
