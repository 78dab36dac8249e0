"""The paired baseline and the learning-rate filter of the law fit, on a study's design.

The table is generated here, from formulas written here: dense at one width per
context (so the dense law cannot be identified in N), every routed run paired
with a dense run of its seed, context and budget, a large seed effect shared by
the two (the data order), and a few runs at another learning rate beside them.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from xmodlm.cli import main
from xmodlm.errors import UserError
from xmodlm.law.fit import fit_law
from xmodlm.law.lawfit import LawFit
from xmodlm.law.predict import predict
from xmodlm.law.recommend import recommend
from xmodlm.pairing import NO_PARTNER, dense_partners

N_BOOT = 100
G = 0.03  # true delta: -G ln rho
SEED_SIGMA = 0.03  # a seed's luck, shared by the routed run and its dense partner
SIGMA = 0.002
LR, OTHER_LR = 4e-3, 2.8e-3
WIDTH = 128


def dense_loss(n: float, d: float) -> float:
    return 1.8 + 380.0 / n**0.33 + 420.0 / d**0.29


def study(seeds=(0, 1, 2), lonely: bool = False, ladder: bool = False,
          rng_seed: int = 0) -> pd.DataFrame:
    """Dense and X-MoD at S x c, two contexts, two budgets, paired by seed; two dense
    and two X-MoD runs at ``OTHER_LR``; ``lonely``: one X-MoD run loses its partner;
    ``ladder``: dense runs at widths 96 and 192 too (enough to fit, not to identify,
    a dense law)."""
    rng = np.random.default_rng(rng_seed)
    cells = [(1, 1.0)] + [(s, c) for s in (2, 4, 8) for c in (0.125, 0.25, 0.5)]
    shapes = [(WIDTH, cell) for cell in cells]
    if ladder:
        shapes += [(96, (1, 1.0)), (192, (1, 1.0))]
    rows = []
    for context in (128, 512):
        for compute in (2.2e13, 6.6e13):
            for seed in seeds:
                luck = SEED_SIGMA * rng.standard_normal()
                for width, (stride, capacity) in shapes:
                    n = 12.0 * width**2 * 4
                    d = compute / (6 * n)
                    rho = stride / (1 + capacity * (stride - 1))
                    ln_l = np.log(dense_loss(n, d)) - G * np.log(rho) + luck
                    rows.append({
                        "family": "dense" if stride == 1 else "xmod", "width": width,
                        "n_layers": 4 if stride == 1 else 4 * stride, "stride": stride,
                        "capacity": capacity, "context": context, "params_active": n,
                        "tokens": d, "compute": compute * (1 + 0.01 * (stride > 1)),
                        "seed": seed, "lr": LR, "steps": 2400, "status": "ok",
                        "val_loss": np.exp(ln_l + SIGMA * rng.standard_normal()),
                    })
    table = pd.DataFrame(rows)
    off = table[(table["context"] == 128) & (table["compute"] < 3e13) & (table["seed"] == 0)
                & table["stride"].isin([1, 8]) & table["capacity"].isin([1.0, 0.125])]
    table = pd.concat([table, off.assign(lr=OTHER_LR, val_loss=off["val_loss"] * 1.05)])
    if lonely:
        drop = (table["family"] == "dense") & (table["context"] == 512) & (table["seed"] == 2)
        table = table[~drop | (table["compute"] < 3e13)]
    return table.reset_index(drop=True)


@pytest.fixture(scope="module")
def table() -> pd.DataFrame:
    return study()


@pytest.fixture(scope="module")
def paired(table: pd.DataFrame) -> LawFit:
    return fit_law(table, form="base", n_boot=N_BOOT, seed=0, baseline="paired")


@pytest.fixture(scope="module")
def ladder() -> pd.DataFrame:
    return study(ladder=True)


def _g_cap(fit: LawFit) -> tuple[float, float, float]:
    params = fit.to_json()["delta"]["forms"]["base"]["params"]["g_cap"]
    return params["value"], *params["ci"]


def test_partners_share_context_width_seed_rate_and_budget(table: pd.DataFrame) -> None:
    partners = dense_partners(table, table["family"] == "dense")
    routed = np.flatnonzero(table["family"] != "dense")
    assert (partners[routed] != NO_PARTNER).all()
    assert (partners[table["family"] == "dense"] == NO_PARTNER).all()
    for col in ("context", "width", "seed", "lr"):
        assert (table[col].to_numpy()[routed] == table[col].to_numpy()[partners[routed]]).all()
    gap = np.log(table["compute"].to_numpy()[routed] / table["compute"].to_numpy()[partners[routed]])
    assert np.abs(gap).max() < 0.02


def test_paired_baseline_needs_no_dense_law(table: pd.DataFrame, paired: LawFit) -> None:
    """One dense width per context: no dense law can be fitted, the paired delta can."""
    with pytest.raises(UserError, match="every run has the same params_active.*--baseline paired"):
        fit_law(table, form="base", n_boot=N_BOOT)
    assert paired.baseline == "paired" and not paired.dense
    assert any("no dense law" in note for note in paired.notes)
    value, lo, hi = _g_cap(paired)
    assert lo > 0 and abs(value - G) < 0.006  # resolved, and near the truth
    # the seed luck (sd 0.03) cancels in the paired difference: a wrong partner would
    # leave it in y and widen the interval several times over
    assert hi - lo < 0.02
    # g_ctx is 0 in truth; one dense partner serves the nine cells of its seed, and a
    # bootstrap that does not draw partners calls it resolved here ([-0.0035, -0.0006])
    ctx = paired.to_json()["delta"]["forms"]["base"]["params"]["g_ctx"]["ci"]
    assert ctx[0] < 0 < ctx[1]
    held = paired.metrics["heldout_by_protocol"]
    assert set(held) == {"leave-cell-out", "top-compute", "longest-context"}
    assert all(h["rmse"] < 0.01 for h in held.values())
    # without a dense law it predicts differences from dense, not losses
    out = predict(paired, table)
    assert "pred_loss" not in out and {"delta", "delta_lo", "delta_hi"} <= set(out)
    routed = (table["family"] != "dense").to_numpy()
    truth = -G * np.log(out["rho"].to_numpy())
    assert np.abs(out["delta"].to_numpy()[routed] - truth[routed]).max() < 0.01
    assert (out["delta"].to_numpy()[~routed] == 0).all()
    assert (out["delta_lo"] <= out["delta"]).all() and (out["delta"] <= out["delta_hi"]).all()


def test_law_predict_cli_names_what_a_paired_fit_predicts(
    paired: LawFit, table: pd.DataFrame, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    (tmp_path / "fit.json").write_text(json.dumps(paired.to_json()))
    table.to_csv(tmp_path / "rows.csv", index=False)
    argv = ["law", "predict", str(tmp_path / "fit.json"), "--input", str(tmp_path / "rows.csv")]
    assert main([*argv, "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["predicts"] == "delta" and "pred_loss" not in payload["predictions"][0]
    assert main(argv) == 0
    assert "differences from dense, not losses" in capsys.readouterr().out
    # a sweep's table with MoE rows beside (the README's `--input results/cpu-study/...`):
    # those rows are left out and said to be, the others predicted
    moe = table.head(3).assign(family="moe")
    pd.concat([table, moe]).to_csv(tmp_path / "rows.csv", index=False)
    assert main([*argv, "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert len(payload["predictions"]) == len(table)
    assert payload["left_out"].startswith("3 MoE row(s)")
    moe.to_csv(tmp_path / "rows.csv", index=False)
    assert main(argv) == 2
    assert "every row is MoE" in capsys.readouterr().err


def test_other_learning_rates_are_left_out_and_counted(paired: LawFit, table) -> None:
    assert paired.runs["lr"] == LR
    assert paired.runs["excluded_lr"] == int((table["lr"] == OTHER_LR).sum()) == 2
    assert paired.runs["n"] == int((table["lr"] == LR).sum())
    with pytest.raises(UserError, match="no runs at that peak learning rate"):
        fit_law(table, n_boot=N_BOOT, lr=1e-3)
    tie = pd.concat([table[table["lr"] == LR].head(2), table[table["lr"] == OTHER_LR]])
    with pytest.raises(UserError, match="equally common"):
        fit_law(tie, n_boot=N_BOOT)


def test_a_run_without_its_dense_partner_is_named() -> None:
    with pytest.raises(UserError, match=r"have no FLOP-matched dense run.*context 512.*seed 2"):
        fit_law(study(lonely=True), form="base", n_boot=N_BOOT, baseline="paired")


ARGS = dict(compute=4e13, context=512, active_params=8e5, strides=(2, 4, 8),
            capacities=(0.125, 0.25, 0.5))


def test_recommend_ranks_by_the_paired_delta_without_a_dense_law(paired: LawFit) -> None:
    out = recommend(law=paired, **ARGS)
    assert out["answer"].startswith("train X-MoD") and out["dense"]["loss"] is None
    best = out["candidates"][0]
    assert best["vs_dense"] == pytest.approx(best["delta"]) and best["delta"] < -0.03
    assert "in ln L against dense" in out["reason"]


def test_recommend_applies_a_paired_delta_to_the_dense_reference(ladder: pd.DataFrame) -> None:
    paired = fit_law(ladder, form="base", n_boot=N_BOOT, seed=0, baseline="paired")
    out = recommend(law=paired, **ARGS)
    dense = out["dense"]["loss"]
    for e in out["candidates"]:
        assert e["loss"] == pytest.approx(dense * np.exp(e["delta"]), rel=1e-9)
        assert e["delta"] == pytest.approx(sum(e["terms"].values()), abs=1e-12)
    # the dense law is flagged, but the comparison does not go through it
    assert not paired.identification["ok"] and not paired.blocking_flags()
    assert out["answer"].startswith("train X-MoD")
    assert any("dense law that is not identified" in w for w in out["warnings"])
    # through the flagged dense law, the same data support no sparse answer
    by_law = fit_law(ladder, form="base", n_boot=N_BOOT, seed=0)
    assert by_law.blocking_flags()
    assert recommend(law=by_law, **ARGS)["answer"] == "train dense"


def test_cli_fits_the_paired_baseline(tmp_path, table: pd.DataFrame, capsys) -> None:
    path = tmp_path / "runs.csv"
    table.to_csv(path, index=False)
    assert main(["law", "fit", str(path), "--form", "base", "--n-boot", "100",
                 "--baseline", "paired", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "delta baseline: paired" in out and f"2 at another learning rate than {LR:g}" in out
    assert "note: no dense law" in out
    assert main(["law", "fit", str(path), "--baseline", "partner", "--quiet"]) == 2


def test_report_and_plots_take_a_law_without_a_dense_law(tmp_path, table: pd.DataFrame,
                                                         paired: LawFit) -> None:
    from xmodlm.fileio import atomic_write_json
    from xmodlm.report.law_plots import plot_law
    from xmodlm.report.sweep_report import sweep_report

    path, fit_path = tmp_path / "results.csv", tmp_path / "fit.json"
    table.to_csv(path, index=False)
    atomic_write_json(fit_path, paired.to_json())
    report = sweep_report(path, tmp_path / "report", law=fit_path)
    assert report["law"]["baseline"] == "paired"
    assert "against its FLOP-matched dense run" in (tmp_path / "report" / "report.md").read_text()
    law_cells = [row["law"] for row in report["headline"] if "law" in row]
    assert law_cells and all(c["top"]["vs_dense"] < 0 for c in law_cells)
    names = {p.name for p in plot_law(paired, table, tmp_path / "plots")}
    assert names == {"law_delta.png", "law_bootstrap.png"}


@pytest.mark.slow
def test_paired_intervals_cover_the_truth() -> None:
    """Over 20 tables of the study's design the 95% intervals hold every true term
    in at least 18 (a bootstrap that draws configurations only held g_ctx in 70%)."""
    truth = {"g_cap": G, "g_ctx": 0.0, "g_int": 0.0}
    hits = dict.fromkeys(truth, 0)
    for k in range(20):
        table = study(rng_seed=100 + k)
        params = fit_law(table, form="base", n_boot=200, seed=k, baseline="paired"
                         ).to_json()["delta"]["forms"]["base"]["params"]
        for name, value in truth.items():
            lo, hi = params[name]["ci"]
            hits[name] += lo <= value <= hi
    assert min(hits.values()) >= 18, hits


def test_a_delta_law_with_too_few_configurations_is_flagged(table: pd.DataFrame) -> None:
    """Two configurations (three seeds each) for two free parameters: the clustered
    bootstrap returns tight intervals, and none of them may be called resolved."""
    from xmodlm.report.sweep_report import _law_section

    few = table[(table["context"] == 128) & (table["compute"] < 3e13) & (table["lr"] == LR)
                & ((table["stride"] == 1) | ((table["capacity"] == 0.125)
                                            & table["stride"].isin([2, 8])))]
    fit = fit_law(few, form="base", n_boot=N_BOOT, seed=0, baseline="paired")
    flags = [f for f in fit.blocking_flags() if "configurations" in f["problem"]]
    assert flags and "2 sparse configurations for 2 free parameters" in flags[0]["problem"]
    params = fit.to_json()["delta"]["forms"]["base"]["params"]
    lo, hi = params["g_cap"]["ci"]
    assert lo > 0  # tight and apparently resolved ...
    terms = _law_section(fit, "fit.json")["terms"]
    assert not terms["capacity"]["resolved"] and terms["capacity"]["flagged"]  # ... not so
    assert recommend(law=fit, **ARGS)["answer"] == "train dense"


def test_top_compute_holds_out_each_contexts_top_tier() -> None:
    """The study's budgets differ by context (2.2e13 and 6.6e13 at T = 128, 2.8e13
    and 8.4e13 at T = 512): the held-out top tier is each context's, not 8.4e13 alone."""
    from xmodlm.law.holdout import folds
    from xmodlm.law.table import validate

    rows = [{"params_active": 8e5, "tokens": c / 5e7, "val_loss": 4.6, "context": t,
             "compute": c} for t, budgets in ((128, (2.2e13, 6.6e13)), (512, (2.8e13, 8.4e13)))
            for c in budgets]
    frame = validate(pd.DataFrame(rows)).frame
    (fold,) = folds(frame, "top-compute")
    assert frame.loc[fold.test, "compute"].tolist() == [6.6e13, 8.4e13]
