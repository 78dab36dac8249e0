"""The calibrated study's headline, from results.csv and the committed cpu-study.

    python results/cpu-study-calibrated/headline.py

Each X-MoD run minus the dense run of its seed, context and budget (FLOP-matched),
mean +- standard error over seeds, with a 95% interval (t, n - 1 degrees of
freedom): the causal loss under the calibrated threshold and under the half rule
(both on the test split, the same checkpoints), the top-k loss, and the
validation causal loss beside the committed cpu-study's (half rule, another
CPU). Also each sparse block's routed fraction against c, forward FLOPs over the
budget and KV bytes over the ideal, from each run's eval.json.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
from scipy import stats

from xmodlm.pairing import NO_PARTNER, dense_partners

HERE = Path(__file__).resolve().parent
COMMITTED = HERE.parent / "cpu-study"


def _paired(df: pd.DataFrame, column: str, dense_column: str | None = None) -> pd.DataFrame:
    """X-MoD rows with ``delta``: their ``column`` minus the ``dense_column`` (default
    the same) of their dense partner (xmodlm.pairing: same context, width, seed,
    matched budget)."""
    df = df.reset_index(drop=True)
    partners = dense_partners(df, df["family"] == "dense")
    sparse = df[(df.family == "xmod") & (partners != NO_PARTNER)].copy()
    ref = df.loc[partners[sparse.index], dense_column or column].to_numpy(float)
    sparse["delta"] = sparse[column].to_numpy(float) - ref
    return sparse


def _summary(deltas: pd.Series) -> str:
    d = deltas.dropna()
    n = len(d)
    if n < 2:
        return f"{d.mean():+.3f} (n = {n})"
    se = d.std(ddof=1) / math.sqrt(n)
    half = stats.t.ppf(0.975, n - 1) * se
    mark = "*" if abs(d.mean()) > half else ""
    return f"{d.mean():+.3f} +- {se:.3f} [{d.mean() - half:+.3f}, {d.mean() + half:+.3f}]{mark} (n = {n})"


def main() -> None:
    df = pd.read_csv(HERE / "results.csv")
    df = df[df.status == "ok"]
    old = pd.read_csv(COMMITTED / "results.csv")
    old = old[(old.status == "ok") & (old.context == 512) & (old.lr == 0.004)]
    cells = df[df.family == "xmod"][["compute", "stride", "capacity"]].drop_duplicates()
    print("X-MoD minus FLOP-matched dense, T = 512, mean +- SE [95% CI] (* excludes 0)\n")
    for cell in cells.sort_values(["compute", "stride", "capacity"]).itertuples():
        def pick(frame: pd.DataFrame, c: object = cell) -> pd.DataFrame:
            keep = (frame.family == "dense") | ((frame.stride == c.stride)
                                                 & (frame.capacity == c.capacity))
            same_budget = (frame.compute / c.compute - 1).abs() < 0.15
            return frame[same_budget & keep]
        here, there = pick(df), pick(old)
        print(f"C = {cell.compute:.1e}, S = {cell.stride}, c = {cell.capacity:g}")
        rows = {
            "test causal, calibrated": _paired(here, "eval_loss_causal"),
            "test causal, half rule": _paired(here, "eval_loss_causal_half", "eval_loss_causal"),
            "test top-k": _paired(here, "eval_loss_topk"),
            "val causal, calibrated": _paired(here, "val_loss_causal"),
            "val causal, committed (half rule, AMX Xeon)": _paired(there, "val_loss_causal"),
        }
        for name, frame in rows.items():
            print(f"  {name:45s} {_summary(frame.delta)}")
        for run in here[(here.family == "xmod") & here.eval_loss_causal.notna()].itertuples():
            check = HERE / "runs" / run.run_id / "routing-check.json"  # more test text, if run
            ev = json.loads((check if check.is_file() else HERE / "runs" / run.run_id / "eval.json").read_text())
            fr = ev["capacity_causal"]
            half = ev["capacity_causal_half"]
            off = max(abs(f / cell.capacity - 1) for f in fr)
            fl = ev["flops_per_token"]
            print(f"  seed {run.seed} ({ev['eval_tokens']} test tokens): routed {min(fr):.3f}-{max(fr):.3f} (max {off:.1%} from c),"
                  f" FLOPs {fl['causal_over_budget']:.3f}x budget, KV {ev['kv_over_ideal']:.3f}x"
                  f" ideal; half rule: routed {min(half):.3f}-{max(half):.3f},"
                  f" FLOPs {fl['causal_half_over_budget']:.3f}x")
        print()


if __name__ == "__main__":
    main()
