"""``xmod report``: sweep figures recomputed from the results table."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from xmodlm.cli import main
from xmodlm.report.sweep_report import match_to_dense, sweep_report

REPO = Path(__file__).resolve().parents[1]


def _row(family: str, width: int, compute: float, loss: float, **kw: object) -> dict:
    row = {
        "family": family, "width": width, "context": 128, "stride": 1, "capacity": 1.0,
        "gating": "-", "balance_coef": 0.0, "seed": 0, "compute": compute,
        "val_loss": loss, "status": "ok",
    }
    return {**row, **kw}


def _table() -> pd.DataFrame:
    """Two widths x two budgets; X-MoD loses at 1e12 and wins once at 1e13."""
    x = {"stride": 2, "capacity": 0.25, "gating": "variance_scaled", "balance_coef": 0.01}
    rows = [
        _row("dense", 64, 1.00e12, 6.0),
        _row("dense", 96, 0.99e12, 6.2),
        _row("dense", 64, 1.01e13, 5.0),
        _row("dense", 96, 1.00e13, 4.9),
        _row("xmod", 64, 0.98e12, 6.1, **x),  # +0.1
        _row("xmod", 96, 1.02e12, 6.4, **x),  # +0.2
        _row("xmod", 64, 0.97e13, 5.05, **x),  # +0.05
        _row("xmod", 96, 1.00e13, 4.8, **x),  # -0.1
        _row("moe", 64, 1.00e12, 5.9),  # -0.1
        _row("xmod", 128, 1.00e12, 6.0, **x),  # no dense at width 128
        _row("xmod", 64, 1.00e12, float("nan"), status="failed", **x),
    ]
    return pd.DataFrame(rows)


def test_matching_and_figures(tmp_path: Path) -> None:
    path = tmp_path / "results.csv"
    _table().to_csv(path, index=False)
    rep = sweep_report(path, tmp_path / "out")
    assert rep["runs"] == {
        "finished": 10, "left_out": 1, "by_family": {"dense": 4, "moe": 1, "xmod": 5},
    }
    assert rep["tiers"] == [1e12, 1e13] and rep["unmatched"] == 1
    xmod = rep["vs_dense"]["xmod"]
    assert xmod["n"] == 4 and xmod["lose"] == 3
    assert xmod["median"] == pytest.approx(0.075) and xmod["best"] == pytest.approx(-0.1)
    assert rep["vs_dense"]["moe"]["lose"] == 0
    assert rep["vs_dense_by_tier"]["1e+12"]["n"] == 3  # two X-MoD and the MoE run
    ladder = {d["tier"]: d for d in rep["dense_ladder"]}
    assert ladder[1e12]["best_width"] == 64 and ladder[1e13]["best_width"] == 96
    assert all(d["at_edge"] for d in ladder.values())  # with two widths, any best is an edge
    comparisons = pd.read_csv(tmp_path / "out" / "comparisons.csv")
    assert len(comparisons) == 5
    assert json.loads((tmp_path / "out" / "report.json").read_text()) == rep
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| xmod | 4 | 3 | +0.075 | -0.100 | +0.200 |" in md
    assert "1 non-dense runs have no dense reference" in md


def test_reference_needs_the_same_budget() -> None:
    df = pd.DataFrame([_row("dense", 64, 1e12, 6.0), _row("xmod", 64, 1.3e12, 5.9, stride=2)])
    df["tier"] = [1e12, 1.3e12]
    comparisons, unmatched = match_to_dense(df)
    assert comparisons.empty and unmatched == 1


def test_the_committed_micro_law_report(tmp_path: Path) -> None:
    """The figures quoted in results/micro-law/README.md come out of this command."""
    out = tmp_path / "rep"
    fit = REPO / "src/xmodlm/law/default_fit.json"
    rep = sweep_report(REPO / "results/micro-law/results.csv", out, law=fit)
    lose = sum(s["lose"] for s in rep["vs_dense"].values())
    n = sum(s["n"] for s in rep["vs_dense"].values())
    assert (lose, n) == (90, 100)  # causal loss
    assert rep["law"]["selected"] == "base" and "g_cap" in rep["law"]["params"]
    assert rep["law"]["runs"]["dropped_short"] == 72 and rep["law"]["runs"]["min_steps"] == 500
    assert all((out / p).is_file() for p in rep["law"]["plots"])


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    _table().to_csv(sweep / "results.csv", index=False)
    assert main(["report", str(sweep), "--out", str(tmp_path / "o")]) == 0
    assert capsys.readouterr().out.startswith("# Sweep report")
    _table().drop(columns=["width"]).to_csv(sweep / "results.csv", index=False)
    assert main(["report", str(sweep), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "lacks column(s) width" in err and len(err.splitlines()) == 1


def test_paired_seeds_causal_loss_and_learning_rates(tmp_path: Path) -> None:
    """Three seeds: X-MoD's causal loss is worse than dense by 0.03, 0.05, 0.04 (top-k
    better by 0.01 each): mean +0.04, SE 0.00577, t(2) interval [+0.015, +0.065],
    resolved. A one-seed config is reported but never resolved. Dense at two peak
    learning rates: the sweep section names the better one, pairs at equal lr."""
    x = {"stride": 4, "capacity": 0.125, "gating": "variance_scaled", "balance_coef": 0.01}
    rows = []
    for seed, (d, gap) in enumerate([(5.0, 0.03), (5.1, 0.05), (4.9, 0.04)]):
        rows += [
            _row("dense", 128, 1e13, d, seed=seed, val_loss_causal=d, lr=3e-3),
            _row("dense", 128, 1e13, d + 0.2, seed=seed, val_loss_causal=d + 0.2, lr=6e-3),
            _row("xmod", 128, 1e13, d + gap - 0.01, seed=seed, val_loss_causal=d + gap,
                 lr=3e-3, **x),
        ]
    rows.append(_row("xmod", 128, 1e13, 4.0, seed=0, val_loss_causal=4.0, lr=6e-3,
                     **{**x, "stride": 8}))
    rep = sweep_report_table(pd.DataFrame(rows), tmp_path)
    p = {(r["config"].split()[1], r["n"]): r for r in rep["paired"]}
    s4 = p[("S=4", 3)]
    assert s4["mean"] == pytest.approx(0.04) and s4["se"] == pytest.approx(0.01 / 3**0.5)
    assert s4["ci95"][0] == pytest.approx(0.04 - 4.3027 * 0.01 / 3**0.5, abs=1e-4)
    assert s4["resolved"] and s4["mean_topk"] == pytest.approx(0.03)
    s8 = p[("S=8", 1)]
    assert s8["se"] is None and not s8["resolved"]
    assert s8["mean"] == pytest.approx(4.0 - 5.2)  # paired with the dense run at lr 6e-3
    dense_lr = next(m for m in rep["learning_rates"] if m["model"].startswith("dense"))
    assert dense_lr["best_lr"] == 3e-3 and dense_lr["best_at_edge"]
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| 1e+13 | 128 | 128 | xmod S=4 c=0.125 variance_scaled bal=0.01 lr=0.003 | 3 |" in md


def sweep_report_table(df: pd.DataFrame, tmp_path: Path) -> dict:
    path = tmp_path / "results.csv"
    df.to_csv(path, index=False)
    return sweep_report(path, tmp_path / "out")
