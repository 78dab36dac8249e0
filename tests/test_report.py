"""``xmod report``: sweep figures recomputed from the results table."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import tiny_model_cfg
from xmodlm.cli import main
from xmodlm.config import load_config
from xmodlm.report.analysis import match_to_dense
from xmodlm.report.dynamics import SPIKE_THRESHOLD, count_spikes, grad_norm_peaks, run_dynamics
from xmodlm.report.sweep_report import sweep_report

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
    assert "| 1e+13 | 128 | 128 | xmod S=4 c=0.125 variance_scaled bal=cv:0.01 lr=0.003 | 3 |" in md


def test_optimisers_are_other_models(tmp_path: Path) -> None:
    """AdamW and Muon runs of one seed are two models, never two seeds of one: the
    learning-rate section names each optimiser's best rate on its own runs, and a Muon
    X-MoD pairs with the Muon dense run, not the AdamW one of the same rate."""
    x = {"stride": 4, "capacity": 0.125, "gating": "variance_scaled", "balance": "token_bias"}
    rows = [
        _row("dense", 128, 1e13, 5.0, lr=1e-3, optimizer="adamw"),
        _row("dense", 128, 1e13, 5.2, lr=2e-3, optimizer="adamw"),
        _row("dense", 128, 1e13, 4.9, lr=1e-3, optimizer="muon"),
        _row("dense", 128, 1e13, 4.7, lr=2e-3, optimizer="muon"),
        _row("xmod", 128, 1e13, 4.6, lr=2e-3, optimizer="muon", **x),
    ]
    rep = sweep_report_table(pd.DataFrame(rows), tmp_path)
    best = {m["model"]: m["best_lr"] for m in rep["learning_rates"]}
    assert best == {"dense": 1e-3, "dense muon": 2e-3}
    (pair,) = rep["paired"]
    assert pair["mean"] == pytest.approx(4.6 - 4.7)
    assert pair["config"] == "xmod S=4 c=0.125 variance_scaled bal=token_bias muon lr=0.002"


def test_a_dense_reference_rerun_on_another_machine_is_its_partner_there() -> None:
    """A study that spans machines reruns its dense reference on the new CPU kind:
    each routed run pairs with the dense run of its own kind, not the nearer budget
    on another kind (another draw: 0.037 nats apart was measured)."""
    x = {"stride": 4, "capacity": 0.125, "gating": "variance_scaled", "balance_coef": 0.01}
    rows = [
        _row("dense", 128, 1.000e13, 5.00, cpu_kind="A", dtype="fp32", compile="off"),
        _row("dense", 128, 1.020e13, 5.04, cpu_kind="B", dtype="fp32", compile="off"),
        _row("xmod", 128, 1.000e13, 4.90, cpu_kind="B", dtype="fp32", compile="off", **x),
        _row("xmod", 128, 1.020e13, 4.95, cpu_kind="A", dtype="fp32", compile="off", **x),
    ]
    from xmodlm.report.analysis import finished_table

    df, _ = finished_table(pd.DataFrame(rows), "t.csv")
    comparisons, unmatched = match_to_dense(df)
    assert unmatched == 0 and list(comparisons["delta"]) == pytest.approx([4.90 - 5.04, 4.95 - 5.00])
    assert not any(comparisons["mixed"])


def test_losses_are_the_evaluated_ones_where_every_run_has_them(tmp_path: Path) -> None:
    """The sweep's evaluation of each final checkpoint on the whole split replaces the
    in-training validation loss (16x the tokens) when every run has it, in the report
    and in the law's table alike; one run without it keeps the in-training losses
    for all, never a mix of the two measurements."""
    from xmodlm.law.table import validate

    x = {"stride": 4, "capacity": 0.125, "gating": "variance_scaled", "balance_coef": 0.01,
         "params_active": 1e6, "tokens": 1e7}
    ev = {"eval_split": "test"}
    rows = [
        _row("dense", 128, 1e13, 5.0, val_loss_causal=5.0, eval_loss_topk=4.8,
             eval_loss_causal=4.8, params_active=1e6, tokens=1e7, **ev),
        _row("xmod", 128, 1e13, 5.1, val_loss_causal=5.2, eval_loss_topk=4.6,
             eval_loss_causal=4.7, **x, **ev),
    ]
    rep = sweep_report_table(pd.DataFrame(rows), tmp_path)
    assert rep["paired"][0]["mean"] == pytest.approx(4.7 - 4.8)
    assert rep["loss_source"] == "test"
    runs = validate(pd.DataFrame(rows))
    assert list(runs.frame["val_loss"]) == pytest.approx([4.8, 4.7])
    assert any("test split" in n for n in runs.notes)
    rows[0]["eval_loss_causal"] = float("nan")
    rep = sweep_report_table(pd.DataFrame(rows), tmp_path)
    assert rep["paired"][0]["mean"] == pytest.approx(5.2 - 5.0) and rep["loss_source"] is None
    assert list(validate(pd.DataFrame(rows)).frame["val_loss"]) == pytest.approx([5.0, 5.2])


def test_budgets_are_tiered_per_context(tmp_path: Path) -> None:
    """FLOP-matching at T = 512 gives 2.8e13 where T = 128 gives 2.2e13: two budgets,
    not one tier labelled by whichever context has more runs."""
    x = {"stride": 8, "capacity": 0.125, "gating": "variance_scaled", "balance_coef": 0.01}
    rows = []
    for context, compute in ((128, 2.2e13), (512, 2.8e13)):
        for seed in range(3 if context == 128 else 1):
            rows += [_row("dense", 128, compute, 4.6, seed=seed, context=context),
                     _row("xmod", 128, compute * 1.01, 4.61, seed=seed, context=context, **x)]
    rep = sweep_report_table(pd.DataFrame(rows), tmp_path)
    assert {(r["context"], r["tier"]) for r in rep["headline"]} == {(128, 2.2e13), (512, 2.8e13)}


def test_learning_rates_are_compared_on_shared_seeds(tmp_path: Path) -> None:
    """A check at lr 6e-3 on seed 0 only (4.55) sits below the three-seed mean at 3e-3
    (4.60) but above seed 0 there (4.50): the study's design; 3e-3 is the better rate.
    A model tried at one rate is not listed."""
    rows = [_row("dense", 128, 1e13, loss, seed=seed, val_loss_causal=loss, lr=3e-3)
            for seed, loss in enumerate([4.50, 4.65, 4.65])]
    rows.append(_row("dense", 128, 1e13, 4.55, seed=0, val_loss_causal=4.55, lr=6e-3))
    rows.append(_row("dense", 256, 1e13, 4.40, seed=0, val_loss_causal=4.40, lr=3e-3))
    rep = sweep_report_table(pd.DataFrame(rows), tmp_path)
    (m,) = rep["learning_rates"]
    assert m["width"] == 128 and m["common_seeds"] == [0] and m["best_lr"] == 3e-3
    md = (tmp_path / "out" / "report.md").read_text()
    assert "seed 0: **0.003: 4.5000**, 0.006: 4.5500; all seeds: 0.003: 4.6000" in md


def test_dense_ladder_compares_depths_paired_on_shared_seeds(tmp_path: Path) -> None:
    """Dense at 3, 4 and 5 blocks on one budget. 5 blocks was run on seed 0 only (4.45):
    below 4 blocks' three-seed mean (4.533) but above 4 blocks on seed 0 (4.40), so
    judged on the shared seed 4 blocks is best (not at the edge). 3 blocks is behind
    it by 0.05 +- 0.006, paired over its three seeds (resolved)."""
    rows = []
    for seed, (loss, extra) in enumerate([(4.40, 0.05), (4.60, 0.06), (4.60, 0.04)]):
        rows += [_row("dense", 128, 1e13, loss, seed=seed, n_layers=4, lr=4e-3),
                 _row("dense", 128, 1e13, loss + extra, seed=seed, n_layers=3, lr=4e-3)]
    rows.append(_row("dense", 128, 1e13, 4.45, seed=0, n_layers=5, lr=4e-3))
    rep = sweep_report_table(pd.DataFrame(rows), tmp_path)
    (d,) = rep["dense_ladder"]
    assert d["common_seeds"] == [0]
    assert d["best_n_layers"] == 4 and not d["at_edge"]
    by_depth = {e["n_layers"]: e for e in d["shapes"]}
    three = by_depth[3]["minus_best"]
    assert three["mean"] == pytest.approx(0.05) and three["n"] == 3 and three["resolved"]
    assert by_depth[5]["minus_best"]["mean"] == pytest.approx(0.05)
    assert by_depth[5]["minus_best"]["n"] == 1 and "minus_best" not in by_depth[4]
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| 128 | 1e+13 | 128 | 4 | 0.004 | - | 4.5333 +- 0.0667 (3) | best |" in md
    assert "| 128 | 1e+13 | 128 | 3 | 0.004 | - | 4.5833 +- 0.0669 (3) | +0.050 +- 0.006 (3)* |" in md


def test_equal_size_interpolates_dense_in_ln_n_and_controls_stay_out_of_pairing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The study has dense at 4 blocks (0.8M) and X-MoD at 0.98M = sqrt(0.8 * 1.2)M, so
    halfway in ln N between the control's dense at 4 and 6 blocks. Per seed the 6-block
    model is 0.10 behind the 4-block one and X-MoD 0.07 (plus 0.00 / 0.01 / 0.02), so
    against dense of its size X-MoD is +0.03 on average. The control's 3-block model is
    best (0.04 ahead of 4 blocks). The 6-block run has X-MoD's exact compute while the
    4-block partner is 2% off: were the control in the pairing, it would win it. A
    second X-MoD at 2M is outside the dense sizes tried and gets no difference."""
    x = {"stride": 8, "capacity": 0.125, "gating": "variance_scaled", "balance_coef": 0.01,
         "lr": 4e-3}
    study, control = [], []
    for seed in range(3):
        base = 4.6 + 0.1 * seed  # seed luck the pairing cancels
        study += [
            _row("dense", 128, 1.02e13, base, seed=seed, n_layers=4, lr=4e-3,
                 params_active=0.8e6, run_id=f"d4-{seed}"),
            _row("xmod", 128, 1e13, base + 0.07 + 0.01 * seed, seed=seed, n_layers=16,
                 params_active=(0.8e6 * 1.2e6) ** 0.5, **x),
            _row("xmod", 128, 1e13, base + 0.2, seed=seed, n_layers=32, params_active=2e6,
                 **{**x, "stride": 4}),
        ]
        control += [
            _row("dense", 128, 1e13, base + 0.1, seed=seed, n_layers=6, lr=4e-3,
                 params_active=1.2e6),
            _row("dense", 128, 1e13, base - 0.04, seed=seed, n_layers=3, lr=4e-3,
                 params_active=0.6e6),
            _row("dense", 128, 1.02e13, base, seed=seed, n_layers=4, lr=4e-3,
                 params_active=0.8e6, run_id=f"d4-{seed}"),  # the study's own, again
            _row("xmod", 128, 1e13, 0.0, seed=seed, n_layers=16, params_active=1e6, **x),
        ]
    (tmp_path / "study").mkdir()
    (tmp_path / "control").mkdir()
    pd.DataFrame(study).to_csv(tmp_path / "study" / "results.csv", index=False)
    pd.DataFrame(control).to_csv(tmp_path / "control" / "results.csv", index=False)
    out = tmp_path / "out"
    assert main(["report", str(tmp_path / "study"), "--dense-control", str(tmp_path / "control"),
                 "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    rep = json.loads((out / "report.json").read_text())
    assert rep["runs"]["finished"] == 9 and rep["dense_controls"][0]["dense_runs"] == 6
    comparisons = pd.read_csv(out / "comparisons.csv")
    s8 = comparisons[comparisons["stride"] == 8]
    assert s8["dense_run_id"].tolist() == ["d4-0", "d4-1", "d4-2"]  # the study's partner
    assert s8["delta"].to_numpy() == pytest.approx([0.07, 0.08, 0.09])
    (ladder,) = rep["dense_ladder"]
    assert ladder["best_n_layers"] == 3 and len(ladder["shapes"]) == 3  # d4 counted once
    inside, outside = sorted(rep["equal_size"], key=lambda r: r["params_active"])
    assert inside["weight"] == pytest.approx(0.5)
    assert [b["n_layers"] for b in inside["bracket"]] == [4, 6]
    at_size = inside["minus_dense_at_size"]
    assert at_size["mean"] == pytest.approx(0.03) and at_size["n"] == 3
    assert at_size["se"] == pytest.approx(0.01 / 3**0.5) and at_size["resolved"]
    assert inside["minus_best_dense"]["mean"] == pytest.approx(0.12)
    assert outside["minus_dense_at_size"] is None
    assert outside["dense_sizes"] == [0.6e6, 1.2e6]
    md = (out / "report.md").read_text()
    assert "## At equal active size" in md and "outside 0.60M-1.20M" in md
    assert "| 0.98M | 0.80M and 1.20M | +0.030 +- 0.006 (3)* |" in md


def test_headline_is_the_most_seeded_configuration_per_cell(tmp_path: Path) -> None:
    """At T = 128 X-MoD S = 8 has three seeds (+0.01, +0.02, +0.03 against dense) and
    S = 4 one lucky seed (-0.5): the headline is S = 8, not the best mean. MoD has
    three seeds at -0.02 each (resolved). At T = 512 two X-MoD configurations have one
    seed each: no headline there."""
    s8 = {"stride": 8, "capacity": 0.125, "gating": "variance_scaled", "balance_coef": 0.01}
    mod = {"stride": 2, "capacity": 0.125, "gating": "logit", "balance_coef": 0.0}
    rows = []
    for seed, gap in enumerate([0.01, 0.02, 0.03]):
        rows += [
            _row("dense", 128, 1e13, 5.0 + seed, seed=seed, val_loss_causal=5.0 + seed),
            _row("xmod", 128, 1e13, 0, seed=seed, val_loss_causal=5.0 + seed + gap, **s8),
            _row("mod", 128, 1e13, 0, seed=seed, val_loss_causal=4.98 + seed, **mod),
        ]
    rows += [
        _row("xmod", 128, 1e13, 0, seed=0, val_loss_causal=4.5, **{**s8, "stride": 4}),
        _row("dense", 128, 3e13, 4.0, context=512, val_loss_causal=4.0),
        _row("xmod", 128, 3e13, 0, context=512, val_loss_causal=4.1, **s8),
        _row("xmod", 128, 3e13, 0, context=512, val_loss_causal=4.2, **{**s8, "stride": 4}),
    ]
    rep = sweep_report_table(pd.DataFrame(rows), tmp_path)
    (t128, t512) = rep["headline"]
    assert (t128["context"], t512["context"]) == (128, 512)
    x = t128["families"]["xmod"]
    assert x["config"].startswith("xmod S=8") and x["n"] == 3
    assert x["mean"] == pytest.approx(0.02) and x["se"] == pytest.approx(0.01 / 3**0.5)
    m = t128["families"]["mod"]
    assert m["mean"] == pytest.approx(-0.02) and m["resolved"]
    assert "moe" not in t128["families"] and "law" not in t128
    assert t512["families"]["xmod"] == {"tied": 2, "n": 1}
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| T | C | width | X-MoD | MoD |" in md
    assert "| 128 | 1e+13 | 128 | +0.020 +- 0.006 (3) | -0.020 +- 0.000 (3)* |" in md
    assert "| 512 | 3e+13 | 128 | - (2 configurations with 1 seed) | - |" in md


def test_headline_tie_goes_to_the_configuration_run_at_more_budgets(tmp_path: Path) -> None:
    """Lower tier: X-MoD S = 8 (the study's headline) and S = 4 (a law cell) have three
    seeds each; S = 8 also runs on the upper tier. The lower tier's headline is S = 8,
    not "no headline", even though S = 4 has the better mean there."""
    s8 = {"stride": 8, "capacity": 0.125, "gating": "variance_scaled", "balance_coef": 0.01}
    rows = []
    for seed in range(3):
        for C in (1e13, 3e13):
            rows.append(_row("dense", 128, C, 5.0 + seed, seed=seed, val_loss_causal=5.0 + seed))
            rows.append(_row("xmod", 128, C, 0, seed=seed, val_loss_causal=5.05 + seed, **s8))
        rows.append(_row("xmod", 128, 1e13, 0, seed=seed, val_loss_causal=4.9 + seed,
                         **{**s8, "stride": 4}))
    rep = sweep_report_table(pd.DataFrame(rows), tmp_path)
    lower, upper = rep["headline"]
    for cell in (lower, upper):
        x = cell["families"]["xmod"]
        assert x["config"].startswith("xmod S=8") and x["mean"] == pytest.approx(0.05)


def test_mechanism_effects_are_paired_within_seed(tmp_path: Path) -> None:
    """Gating {variance_scaled, sigmoid} x balancing {on, off}, three seeds, no lr
    column: sigmoid is worse by 0.019, 0.020, 0.021 (seed 0-2) whatever the balancing,
    switching balancing off is better by 0.010 exactly; anchors never vary."""
    base = {"stride": 8, "capacity": 0.125}
    rows = []
    for seed in range(3):
        rows.append(_row("dense", 128, 1e13, 5.0 + seed, seed=seed))
        for gating, g_gap in (("variance_scaled", 0.0), ("sigmoid", 0.019 + 0.001 * seed)):
            for bal, b_gap in ((0.01, 0.0), (0.0, -0.01)):
                loss = 5.0 + seed + 0.01 + g_gap + b_gap
                rows.append(_row("xmod", 128, 1e13, loss, seed=seed, gating=gating,
                                 balance_coef=bal, **base))
    rep = sweep_report_table(pd.DataFrame(rows), tmp_path)
    eff = {(m["factor"], m["level"]): m for m in rep["mechanisms"] if m["within"] is None}
    assert set(eff) == {("gating", "sigmoid"), ("balancing", "off")}
    sig = eff[("gating", "sigmoid")]
    assert sig["reference"] == "variance_scaled" and (sig["pairs"], sig["seeds"]) == (6, 3)
    assert sig["mean"] == pytest.approx(0.020) and sig["se"] == pytest.approx(0.001 / 3**0.5)
    assert sig["resolved"]
    off = eff[("balancing", "off")]
    assert off["mean"] == pytest.approx(-0.010) and off["pairs"] == 6
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| gating | sigmoid | variance_scaled | all | 6 | 3 | +0.020 +- 0.001 |" in md


def test_mechanism_effects_within_a_level_of_another_factor(tmp_path: Path) -> None:
    """An interaction: the logit gate costs 0.01 with anchors at every S-th block and
    1.0 with the first block only. The main effect mixes the two; within each anchors
    level the effect is the level's own, and anchors within a gating level likewise."""
    rows = []
    for seed in range(3):
        rows.append(_row("dense", 128, 1e13, 5.0, seed=seed))
        for gating in ("variance_scaled", "logit"):
            for first in (False, True):
                gap = (1.0 if first else 0.01) if gating == "logit" else 0.0
                loss = 5.0 + 0.02 * seed + (0.1 if first else 0.0) + gap
                layout = "D" + "s" * 27 if first else ("D" + "s" * 7) * 2
                rows.append(_row("xmod", 128, 1e13, loss, seed=seed, gating=gating,
                                 balance_coef=0.01, stride=8, capacity=0.125, layout=layout))
    rep = sweep_report_table(pd.DataFrame(rows), tmp_path)
    eff = {(m["factor"], m["level"], tuple((m["within"] or {}).items())): m
           for m in rep["mechanisms"]}
    assert eff[("gating", "logit", ())]["mean"] == pytest.approx(0.505)
    assert eff[("gating", "logit", (("anchors", "every S-th block"),))]["mean"] == pytest.approx(0.01)
    first = eff[("gating", "logit", (("anchors", "prefix only"),))]
    assert first["mean"] == pytest.approx(1.0) and first["pairs"] == 3 and first["seeds"] == 3
    anchors = eff[("anchors", "prefix only", (("gating", "variance_scaled"),))]
    assert anchors["mean"] == pytest.approx(0.1)
    assert eff[("anchors", "prefix only", (("gating", "logit"),))]["mean"] == pytest.approx(1.09)
    assert not any(m["within"] and "balancing" in m["within"] for m in rep["mechanisms"])
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| gating | logit | variance_scaled | anchors prefix only | 3 | 3 |" in md


def test_downstream_tasks_are_paired_with_dense(tmp_path: Path) -> None:
    """Cloze accuracy of X-MoD minus its dense run: +0.02, +0.04, +0.03 over three seeds;
    a run without the task (never evaluated) adds nothing."""
    x = {"stride": 8, "capacity": 0.125, "gating": "variance_scaled", "balance_coef": 0.01}
    rows = []
    for seed, gain in enumerate([0.02, 0.04, 0.03]):
        rows += [_row("dense", 128, 1e13, 5.0, seed=seed, task_cloze=0.5),
                 _row("xmod", 128, 1e13, 5.0, seed=seed, task_cloze=0.5 + gain, **x)]
    rows.append(_row("mod", 128, 1e13, 5.0, seed=0, stride=2, capacity=0.125, gating="logit"))
    rep = sweep_report_table(pd.DataFrame(rows), tmp_path)
    (cloze,) = rep["tasks"]
    assert cloze["task"] == "cloze" and cloze["n"] == 3 and cloze["config"].startswith("xmod S=8")
    assert cloze["mean"] == pytest.approx(0.03) and cloze["se"] == pytest.approx(0.01 / 3**0.5)
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| cloze | 3 | +0.030 +- 0.006 |" in md


def sweep_report_table(df: pd.DataFrame, tmp_path: Path) -> dict:
    path = tmp_path / "results.csv"
    df.to_csv(path, index=False)
    return sweep_report(path, tmp_path / "out")


# training dynamics ---------------------------------------------------------------


def _train(step: int, loss: float, grad_norm: float = 0.5) -> dict:
    return {"step": step, "loss": loss, "grad_norm": grad_norm}


def _smooth(n: int = 120, every: int = 10) -> list[dict]:
    """A loss falling from 5 toward 4 with +-0.05 wiggle: no spike anywhere."""
    return [_train(every * i, 4 + 0.995**i + 0.05 * (-1) ** i) for i in range(1, n + 1)]


def test_spikes_are_counted_after_warmup_only() -> None:
    rows = _smooth()
    assert count_spikes(rows, warmup=100) == 0
    spiked = [dict(r) for r in rows]
    spiked[60]["loss"] += 1.0  # step 610
    spiked[80]["loss"] = float("nan")  # a skipped step: always a spike
    assert count_spikes(spiked, warmup=100) == 2
    early = [dict(r) for r in rows]
    early[5]["loss"] += 3.0  # step 60: inside warmup
    assert count_spikes(early, warmup=100) == 0
    assert count_spikes(early, warmup=0) == 1
    # the reference is the median of the window before, not the previous value
    plateau = [_train(10 * i, 4.0) for i in range(1, 80)]
    plateau[40]["loss"] = 4.0 + SPIKE_THRESHOLD - 0.01  # just under: not a spike
    assert count_spikes(plateau, warmup=100) == 0
    plateau[40]["loss"] = 9.0  # one outlier does not lift the median for the next step
    plateau[41]["loss"] = 4.0 + SPIKE_THRESHOLD + 0.01
    assert count_spikes(plateau, warmup=100) == 2


def test_paired_spikes_see_a_jump_the_batch_noise_hides() -> None:
    """A dense run whose logged loss swings +-0.3 nats with the batch, and a routed run
    on the same batches, 0.02 worse, with one 0.35-nat jump after warmup: against
    its own running median the jump hides in the swings (no spike at 0.5 nats); against
    the dense run at the same step it is one spike, and none without the jump."""
    from xmodlm.report.dynamics import count_paired_spikes

    swing = [0.3 * ((7 * i) % 5 - 2) / 2 for i in range(200)]  # the batch's difficulty
    dense = [_train(10 * i, 5 - 0.004 * i + swing[i]) for i in range(200)]
    routed = [_train(r["step"], r["loss"] + 0.02) for r in dense]
    assert count_paired_spikes(routed, dense, warmup=100) == 0
    routed[150]["loss"] += 0.35
    assert count_spikes(routed, warmup=100) == 0
    assert count_paired_spikes(routed, dense, warmup=100) == 1
    assert count_paired_spikes(routed, dense[:0], warmup=100) is None


def test_grad_norm_peaks_leave_out_warmup_and_non_finite() -> None:
    rows = [_train(10 * i, 5.0, grad_norm=0.1 * i) for i in range(1, 101)]  # 0.1 .. 10
    rows[2]["grad_norm"] = 99.0  # step 30, warmup
    rows[50]["grad_norm"] = float("inf")
    top, p99 = grad_norm_peaks(rows, warmup=100)
    assert top == pytest.approx(10.0)
    finite = [0.1 * i for i in range(11, 101) if i != 51]
    assert p99 == pytest.approx(float(np.percentile(finite, 99)))
    assert grad_norm_peaks(rows[:5], warmup=100) == (None, None)


def _write_run(root: Path, run_id: str, rows: list[dict], end: dict) -> None:
    run = root / "runs" / run_id
    run.mkdir(parents=True)
    lines = [json.dumps(r) for r in [*rows, {"step": rows[-1]["step"], "kind": "eval", **end}]]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_dynamics_mean_and_se_over_seeds_per_configuration(tmp_path: Path) -> None:
    """Three X-MoD seeds with 0, 1 and 2 spikes (mean 1, SE 1/sqrt 3), coverage means
    0.4, 0.5, 0.6; a dense reference; one run without metrics.jsonl, skipped."""
    x = {"stride": 4, "capacity": 0.125, "gating": "sigmoid", "balance_coef": 0.0}
    table, rows = [], _smooth()
    for seed, spikes in enumerate([0, 1, 2]):
        mine = [dict(r) for r in rows]
        for k in range(spikes):
            mine[40 + 30 * k]["loss"] += 1.0
        cover = 0.4 + 0.1 * seed
        end = {"residual_rms": [1.0, 2.0 + seed], "coverage": [cover - 0.05, cover + 0.05],
               "depth_hist": [0.5, 0.5], "jaccard": [0.1 * seed]}
        _write_run(tmp_path, f"x{seed}", mine, end)
        _write_run(tmp_path, f"d{seed}", rows, {"residual_rms": [1.0, 1.5]})
        table += [
            _row("xmod", 64, 1e12, 5.0, seed=seed, run_id=f"x{seed}", warmup_steps=100, **x),
            _row("dense", 64, 1e12, 5.0, seed=seed, run_id=f"d{seed}", warmup_steps=100),
        ]
    table.append(_row("xmod", 64, 1e12, 5.0, seed=3, run_id="gone", **{**x, "stride": 8}))
    rep = sweep_report_table(pd.DataFrame(table), tmp_path)
    dyn = rep["dynamics"]
    assert dyn["runs"] == 6 and dyn["skipped_no_metrics"] == 1
    cfg = {c["config"]: c for c in dyn["configs"]}
    assert set(cfg) == {"dense", "xmod S=4 c=0.125 sigmoid bal=none"}
    xm = cfg["xmod S=4 c=0.125 sigmoid bal=none"]
    assert xm["n"] == 3 and xm["seeds"] == [0, 1, 2]
    assert xm["spikes"]["mean"] == pytest.approx(1.0)
    assert xm["spikes"]["se"] == pytest.approx(1 / 3**0.5)
    assert xm["paired_spikes"]["mean"] == pytest.approx(1.0)  # its dense run is smooth
    assert cfg["dense"]["paired_spikes"] is None
    assert xm["coverage_mean"]["mean"] == pytest.approx(0.5)
    assert xm["coverage_mean"]["se"] == pytest.approx(0.1 / 3**0.5)
    assert xm["residual_rms_end"]["mean"] == pytest.approx([1.0, 3.0])
    assert xm["sparse_depth_sd"]["mean"] == pytest.approx(0.5)
    assert xm["residual_rms_init"] is None  # no config.yaml: nothing to rebuild
    assert cfg["dense"]["spikes"]["mean"] == 0 and cfg["dense"]["coverage"] is None
    assert (tmp_path / "out" / dyn["plot"]).is_file()
    assert dyn["depth_plot"] == "depth_hist.png" and (tmp_path / "out" / "depth_hist.png").is_file()
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Training dynamics" in md and "(1 without one skipped)" in md
    assert "![sparse depth per token](depth_hist.png)" in md
    assert "| xmod S=4 c=0.125 sigmoid bal=none | 3 | 1.00 +- 0.58 |" in md


def test_residual_rms_at_init_is_the_run_model_rebuilt(tmp_path: Path, tiny_data_dir: Path) -> None:
    """The init figure equals diagnostics.residual_rms of the model built from the
    run's config.yaml with the trainer's seeding, on the run's validation windows;
    another seed gives other weights and another figure."""
    from xmodlm.config import Config
    from xmodlm.data.batches import load_split, val_batches
    from xmodlm.diagnostics import residual_rms
    from xmodlm.model import Transformer

    model = tiny_model_cfg(vocab_size=300, stride=2, capacity=0.25, gating="variance_scaled")
    cfg = Config(model=model)
    cfg.data.dir = str(tiny_data_dir)
    cfg.train.seed = 3
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(cfg.to_yaml())
    (run / "metrics.jsonl").write_text(json.dumps(_train(10, 5.0)) + "\n")
    got = run_dynamics(run)
    assert got is not None and got["init_tokens"].endswith(
        f"on validation data ({tiny_data_dir})")
    cfg = load_config(run / "config.yaml")
    tokens = val_batches(load_split(tiny_data_dir, "val"), cfg.data.val_batches,
                         cfg.train.batch_size, cfg.model.context)[0][0][:4]
    torch.manual_seed(cfg.train.seed)
    want = residual_rms(Transformer(cfg.model).eval(), tokens)
    assert got["residual_rms_init"] == pytest.approx(want, rel=1e-6)
    torch.manual_seed(cfg.train.seed + 1)
    other = residual_rms(Transformer(cfg.model).eval(), tokens)
    assert other != pytest.approx(want, rel=1e-6)
    # without the data directory: fixed random tokens, and the source says so
    cfg.data.dir = str(tmp_path / "nowhere")
    (run / "config.yaml").write_text(cfg.to_yaml())
    again = run_dynamics(run)
    assert again is not None and "on random tokens" in again["init_tokens"]
    assert again["residual_rms_init"] == run_dynamics(run)["residual_rms_init"]


def test_pairs_that_mix_cpu_kinds_dtypes_or_compile_modes_are_flagged() -> None:
    """A routed run and its dense partner on two CPU kinds (or dtypes, compile modes)
    are two draws: the comparison says so; unrecorded values flag nothing."""
    from xmodlm.report.analysis import mixed_pair

    a = pd.Series({"cpu_kind": "AMD EPYC (family 26 model 2; avx2 avx512f)", "dtype": "fp32",
                   "compile": "on"})
    assert mixed_pair(a, a.copy()) == ""
    b = a.copy()
    b["cpu_kind"], b["compile"] = "Intel Xeon (family 6 model 143; avx2 avx512f amx_bf16)", "off"
    assert mixed_pair(a, b).startswith("cpu_kind: AMD EPYC") and "compile: on vs off" in mixed_pair(a, b)
    assert mixed_pair(a, pd.Series({"dtype": "fp32"})) == ""  # not recorded: nothing to say


def test_cpu_kind_names_family_model_and_kernel_flags() -> None:
    from xmodlm.hardware import cpu_kind

    info = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
            "model name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16 sha_ni\n\n"
            "processor\t: 1\nmodel name\t: other\n")
    assert cpu_kind(info) == "AMD EPYC (family 26 model 2; avx2 avx512f avx512_bf16)"
    assert cpu_kind("model name\t: AMD EPYC\nflags\t: avx2\n") == "AMD EPYC (avx2)"
