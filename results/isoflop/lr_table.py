"""The learning-rate check of the isoflop study: validation loss (causal routing)
per end of the profile, family and peak rate, from the runs of ``results/isoflop``
and ``results/isoflop/lr-check``; then the rule the README fixed before the third
round's runs: per end and family a parabola in ln(lr) through its three best
rates (its best rate, and what any other rate costs it); per end the rate that
minimises the worse family's cost; the rule a power of the width through the two
ends' rates; each end and family's cost at the rule.

    python results/isoflop/lr_table.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

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
    rule(cells)


def _parabola(by_lr: dict[float, float]) -> tuple[np.ndarray | None, str]:
    """loss = c0 + c1 x + c2 x^2 in x = ln lr through the three best rates, as fixed
    before the runs; where those three are not a bracketing upward parabola (seed-level
    noise can put the worst of them in the middle), least squares through every rate
    run (a stated fallback). None when neither brackets a minimum."""
    rates = sorted(by_lr, key=by_lr.get)
    for how, use in (("three best", rates[:3]), ("least squares, all rates", rates)):
        if len(use) < 3:
            continue
        x = np.log(use)
        coef = np.polyfit(x, [by_lr[lr] for lr in use], 2)
        if coef[0] > 0 and x.min() <= -coef[1] / (2 * coef[0]) <= x.max():
            return coef, how
    return None, "not bracketed"


def rule(cells: dict[tuple[str, str], dict[float, float]]) -> None:
    fitted = {cell: _parabola(by_lr) for cell, by_lr in cells.items()}
    fits = {cell: coef for cell, (coef, _) in fitted.items()}
    grid = np.exp(np.linspace(np.log(1e-3), np.log(1.6e-2), 4001))
    print("\n| end | family | parabola | best rate | loss there |\n|---|---|---|---|---|")
    for (end, family), (coef, how) in sorted(fitted.items()):
        if coef is None:
            print(f"| {end} | {family} | {how} | - | - |")
            continue
        x_star = -coef[1] / (2 * coef[0])
        print(f"| {end} | {family} | {how} | {np.exp(x_star):.3g} |"
              f" {np.polyval(coef, x_star):.4f} |")
    chosen = {}
    for end in sorted({e for e, _ in fits}):
        both = [fits.get((end, f)) for f in ("dense", "xmod")]
        if any(c is None for c in both):
            print(f"\n{end}: a family's best rate is not bracketed yet; no rule")
            return
        cost = np.max([np.polyval(c, np.log(grid)) - np.polyval(c, -c[1] / (2 * c[0])) for c in both],
                      axis=0)
        chosen[end] = float(grid[int(np.argmin(cost))])
        print(f"\n{end}: the minimax rate is {chosen[end]:.3g} (worse family's cost"
              f" {cost.min():.4f} nats)")
    (small, lr_small), (large, lr_large) = sorted(chosen.items(), key=lambda kv: "128" in kv[0])
    power = -np.log(lr_large / lr_small) / np.log(128 / 64)
    print(f"\nrule: lr = {lr_large:.3g} x (width / 128) ** {-power:+.3f}"
          f" ({lr_small:.3g} at width 64, {lr_large:.3g} at 128)")
    rates_run = sorted({lr for v in cells.values() for lr in v})
    print("\n| end | family | cost at the rule (nats) | "
          + " | ".join(f"at {lr:g}" for lr in rates_run) + " |\n|---|---|---|"
          + "---|" * len(rates_run))
    for (end, family), coef in sorted(fits.items()):
        def cost(lr: float, coef=coef) -> float:
            return float(np.polyval(coef, np.log(lr)) - np.polyval(coef, -coef[1] / (2 * coef[0])))
        print(f"| {end} | {family} | {cost(chosen[end]):.4f} | "
              + " | ".join(f"{cost(lr):.4f}" for lr in rates_run) + " |")


if __name__ == "__main__":
    main()
