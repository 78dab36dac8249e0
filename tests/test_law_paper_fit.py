"""The paper's fit: synthetic recovery of Table 8, grouped held-out tests, the dense
reference from dense curves, and ``xmod law fit --form paper``."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from xmodlm.cli import main
from xmodlm.errors import UserError
from xmodlm.law import paper, paper_fit, paper_synthetic, reference
from xmodlm.law.table import validate

NOISE = 0.005


@pytest.fixture(scope="module")
def noisy() -> pd.DataFrame:
    return paper_synthetic.table(noise=NOISE, seed=0)


@pytest.fixture(scope="module")
def fitted(noisy: pd.DataFrame) -> paper.PaperLaw:
    return paper_fit.fit_paper(noisy, n_boot=0, seed=0,
                               out_of_range=paper_synthetic.OUT_OF_RANGE)


def test_noise_free_data_give_table8_back() -> None:
    frame = paper_synthetic.table(noise=0.0)
    frame = frame[~paper_fit.out_of_range_mask(frame, paper_synthetic.OUT_OF_RANGE)]
    p = paper_fit.fit_two_stage(paper_fit.point_of(frame), frame["delta"].to_numpy(), seed=0)
    for name in paper.NAMES:
        assert p[name] == pytest.approx(paper.TABLE8[name], rel=1e-3), name


def test_synthetic_recovery_with_noise(noisy: pd.DataFrame, fitted: paper.PaperLaw) -> None:
    """Data from Table 8 plus noise of 0.005: the fit explains them to the noise,
    predicts held-out groups near it and beats the constant-Delta baseline, and the
    recovered law gives Table 8's optimum. Single parameters trade off (u with etaN,
    w with etaL, z with rhoA) and are checked loosely."""
    m = fitted.metrics
    assert m["in_fit"]["rmse"] < 1.2 * NOISE and m["in_fit"]["r2_delta"] > 0.99
    for protocol in paper_fit.PROTOCOLS:
        held = m["heldout"][protocol]
        assert held["rmse"] < 2 * NOISE, protocol
        assert held["beats_baseline"] and held["baseline"]["rmse"] > 5 * held["rmse"]
        assert held["within_band"] > 0.95
    assert m["out_of_range"]["n"] == 9 and m["out_of_range"]["rmse"] < 2 * NOISE
    v = fitted.value
    for name in ("eta_l", "rho_l", "rho_n", "eta_n", "rho_k"):
        assert v[name] == pytest.approx(paper.TABLE8[name], rel=0.25), name

    def total_at(k: float) -> float:
        from xmodlm.law import backbone as bb
        b = bb.backbone_for(556e6)
        return b.layer_params * (4 + 12 * (1 + k)) + b.embedding_params

    n_act = float(noisy["params_active"].iloc[0])
    for L in (2048, 32768):
        true = paper.k_hat(paper.TABLE8, n_act, L, total_at)
        assert paper.k_hat(v, n_act, L, total_at) == pytest.approx(true, rel=0.15), L


def test_fit_is_seeded(noisy: pd.DataFrame) -> None:
    part = noisy[noisy["context"] <= 8192]  # the K and L sweep's low contexts: a quick fit
    x, y = paper_fit.point_of(part), part["delta"].to_numpy()
    assert paper_fit.fit_two_stage(x, y, seed=3) == paper_fit.fit_two_stage(x, y, seed=3)


def test_bootstrap_draws_configurations(noisy: pd.DataFrame, fitted: paper.PaperLaw) -> None:
    inside = noisy[~paper_fit.out_of_range_mask(noisy, paper_synthetic.OUT_OF_RANGE)]
    draws = paper_fit.bootstrap(inside, fitted.value, n_boot=3, seed=0)
    assert draws.shape == (3, len(paper.NAMES)) and np.isfinite(draws).all()
    assert (draws[:, paper.NAMES.index("u")] >= 0).all()
    assert not np.allclose(draws[0], draws[1])


def test_a1_is_never_held_out(noisy: pd.DataFrame, fitted: paper.PaperLaw) -> None:
    assert 1.0 not in fitted.metrics["heldout"]["leave-a-out"]["groups"]
    assert fitted.metrics["heldout"]["leave-a-out"]["n"] == 20


def test_scores_against_the_constant_baseline() -> None:
    obs = np.array([-0.1, -0.2, -0.3])
    s = paper_fit.scores(obs, obs + 0.01, np.full(3, -0.2))
    assert s["rmse"] == pytest.approx(0.01) and s["within_band"] == 1.0
    assert s["baseline"]["rmse"] == pytest.approx(np.sqrt(0.02 / 3))
    assert s["beats_baseline"] and s["baseline"]["r2_delta"] == pytest.approx(0.0)


def _runs() -> pd.DataFrame:
    """One dense run and two sparse runs at context 1024, same active size; a third
    sparse run at a size without dense runs."""
    return pd.DataFrame({
        "run_id": ["d", "s1", "s2", "s3"], "params_active": [1e6, 1.01e6, 1.0e6, 5e6],
        "tokens": [1.6e9, 2e9, 1e9, 1e9], "compute": [1.6e16, 8e15, 1.3e16, 1e16],
        "flops_per_token": [1e7, 4e6, 1.3e7, 1e7], "val_loss": [2.9, 2.9, 2.8, 2.7],
        "stride": [1, 9, 9, 9], "capacity": [1.0, 0.125, 0.125, 0.125],
        "context": [1024] * 4, "status": ["ok"] * 4,
    })


def test_reference_interpolates_dense_curves_at_the_same_flops() -> None:
    frame = validate(_runs()).frame
    curves = pd.DataFrame({"run_id": ["d"] * 3, "compute": [1e15, 4e15, 1.6e16],
                           "val_loss": [4.0, 3.4, 2.9]})
    ref = reference.references(frame, curves, use_law=False)
    # s1 at 8e15 lies halfway (in ln FLOPs) between 4e15 and 1.6e16
    assert ref.loc[1, "reference"] == "curve" and ref.loc[1, "reference_runs"] == "d"
    assert ref.loc[1, "reference_loss"] == pytest.approx(3.15)
    # s2 at 1.3e16 is inside the curve too; s3 has no dense run of its size
    assert ref.loc[2, "reference"] == "curve"
    assert ref.loc[3, "reference"] == "none" and np.isnan(ref.loc[3, "reference_loss"])
    assert ref.loc[0, "reference"] == "self"
    # without curves only the dense run's final point exists: s1 is off it
    assert reference.references(frame, None, use_law=False).loc[1, "reference"] == "none"


def test_read_curves_keeps_every_eval_point(tmp_path) -> None:
    run = tmp_path / "runs" / "d"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"flops_per_token": 1e7}))
    lines = [{"step": 0, "tokens": 0, "kind": "eval", "val_loss_topk": 9.0},
             {"step": 10, "tokens": 1000, "loss": 5.0},
             {"step": 10, "tokens": 1000, "kind": "eval", "val_loss_topk": 4.0},
             {"step": 20, "tokens": 2000, "kind": "eval", "val_loss_topk": 3.6,
              "val_loss_causal": 3.5}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n{torn")
    curves = reference.read_curves(tmp_path)
    assert curves["compute"].tolist() == [1e10, 2e10]
    assert curves["val_loss"].tolist() == [4.0, 3.5]


def test_law_frame_counts_and_references() -> None:
    frame, record = reference.law_frame(paper_synthetic.results_table(seed=1))
    assert record["references"] == {"curve": len(frame)}
    assert record["counts"].startswith("N = params_total")
    synthetic = paper_synthetic.table(seed=1)
    merged = frame.merge(synthetic, on=["params_active", "context", "sparsity", "anchor_stride"],
                         suffixes=("", "_syn"))
    assert len(merged) == len(frame) == len(synthetic)
    assert np.allclose(merged["params_total"], merged["params_total_syn"])
    assert np.allclose(merged["delta"], merged["delta_syn"])


def test_law_frame_fits_x_mod_with_all_its_mechanisms() -> None:
    """A study's table holds its ablations and MoD beside X-MoD: Eq. 14 is fitted on
    X-MoD alone, and the record names what was left out by variant."""
    table = paper_synthetic.results_table(seed=1)
    sparse = table[table["layout"].str.contains("s")]
    ablated = sparse.head(4).assign(balance="none", run_id=lambda d: d["run_id"] + "-nobias",
                                    val_loss=9.0, val_loss_causal=9.0)
    mod = sparse.head(2).assign(family="mod", run_id=lambda d: d["run_id"] + "-mod")
    frame, record = reference.law_frame(pd.concat([table, ablated, mod], ignore_index=True))
    assert len(frame) == len(sparse) and (frame["val_loss"] < 9).all()
    assert record["variant"] == "xmod"
    assert record["excluded_variants"] == {"xmod[balance=none]": 4, "mod": 2}


def test_scales_are_backbones_not_exact_counts() -> None:
    """Routers add a little to a sparse model's N_act: runs within 2% are one scale, so
    leave-scale-out holds out a backbone, and one backbone has nothing to hold out."""
    n_act = np.array([918_600.0, 921_700.0, 919_000.0, 5.4e8, 5.43e8, 9.1e8])
    assert list(paper_fit.scales(n_act)) == [918_600.0] * 3 + [5.4e8] * 2 + [9.1e8]
    one = paper_synthetic.table(seed=0)
    one = one[one["label"] == 556e6].copy()
    one["params_active"] *= 1 + 0.003 * (one["sparsity"] % 3)  # router-sized spread
    out = paper_fit.heldout(one, "leave-scale-out")
    assert "not_applicable" in out


def test_cli_fit_paper_then_recommend(tmp_path, capsys) -> None:
    table = tmp_path / "results.csv"
    paper_synthetic.results_table().to_csv(table, index=False)
    out = tmp_path / "fit.json"
    assert main(["law", "fit", str(table), "--form", "paper", "--n-boot", "0",
                 "--holdout", "leave-a-out",
                 "--out-of-range", "context=65536", "--out-of-range", "params_active=1.5e9",
                 "--out", str(out), "--plots", str(tmp_path / "plots"), "--quiet"]) == 0
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "paper_k.png", "paper_pred_true.png"]
    data = json.loads(out.read_text())
    assert data["schema"] == paper.SCHEMA and data["reference"]["references"]
    assert data["metrics"]["out_of_range"]["n"] == 9
    assert list(data["metrics"]["heldout"]) == ["leave-a-out"]
    capsys.readouterr()
    assert main(["recommend", "--law", str(out), "--compute", "1e20", "--context", "8192",
                 "--active-params", "556e6", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["law"]["name"] == "fitted" and answer["best"]["delta"] < 0


def test_plots_draw_the_fit_and_its_heldout_points(noisy, fitted, tmp_path) -> None:
    """Each held-out protocol keeps every run it scored (the predicted-against-true
    plot draws them), and the K plot's N(K) line is the construction's: straight in
    K at A = 1 through (1, N_act), so it gives each run's own total back."""
    from xmodlm.report import paper_law_plots as plots

    for protocol in paper_fit.PROTOCOLS:
        held = fitted.metrics["heldout"][protocol]
        pts = held["points"]
        assert len(pts["observed"]) == len(pts["predicted"]) == len(pts["group"]) == held["n"]
        err = np.asarray(pts["predicted"]) - np.asarray(pts["observed"])
        assert float(np.sqrt(np.mean(err**2))) == pytest.approx(held["rmse"])
    rows = noisy[(noisy["anchor_stride"] == 1) & (noisy["label"] == 556e6)]
    n_act = float(rows["params_active"].iloc[0])
    intercept, slope = plots.total_line(rows["sparsity"].to_numpy(float),
                                        rows["params_total"].to_numpy(float), n_act)
    assert intercept + slope * rows["sparsity"].to_numpy(float) == pytest.approx(
        rows["params_total"].to_numpy(float), rel=1e-6)
    assert intercept + slope == pytest.approx(n_act, rel=1e-6)
    paths = plots.plot_paper_law(fitted, noisy, tmp_path)
    assert [p.name for p in paths] == ["paper_k.png", "paper_pred_true.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)
    one_k = noisy[noisy["sparsity"] == 8]
    assert plots.k_figure(fitted, one_k, np.zeros(len(one_k), bool)) is None  # no curve to show


def test_law_frame_without_embedding_counts_uses_eqs_4_5() -> None:
    curves = pd.DataFrame({"run_id": ["d"] * 3, "compute": [1e15, 4e15, 1.6e16],
                           "val_loss": [4.0, 3.4, 2.9]})
    frame, record = reference.law_frame(_runs(), curves, use_law=False)
    assert record["left_out_no_reference"] == 1 and len(frame) == 2
    assert "Eqs. 4-5" in record["counts"] and record["notes"]
    # S = 9, c = 1/8: K = 8, A = 1, and N / N_act = blocks / active depth = 9 / 2
    assert frame["sparsity"].tolist() == [8.0, 8.0] and frame["anchor_stride"].tolist() == [1, 1]
    assert (frame["params_total"] / frame["params_active"]).tolist() == pytest.approx([4.5, 4.5])
    assert frame["delta"].iloc[0] == pytest.approx(2.9 - 3.15)


def test_reference_falls_back_to_the_dense_law() -> None:
    """No dense curve covers the sparse run's budget: the fitted dense law of its
    context answers, at the dense FLOPs per token of its size."""
    rng = np.random.default_rng(0)
    n = np.repeat([1e6, 2e6, 4e6, 8e6], 3)
    d = np.tile([1e8, 3e8, 1e9], 4)
    loss = 1.8 + 40 / n**0.3 + 80 / d**0.25
    table = pd.DataFrame({"run_id": [f"d{i}" for i in range(12)], "params_active": n,
                          "tokens": d, "compute": 6 * n * d, "flops_per_token": 6 * n,
                          "val_loss": loss * np.exp(rng.normal(0, 1e-3, 12)),
                          "stride": 1, "capacity": 1.0, "context": 512, "status": "ok"})
    sparse = pd.DataFrame({"run_id": ["s"], "params_active": [2e6], "tokens": [5e9],
                           "compute": [5e16], "flops_per_token": [1e7], "val_loss": [2.5],
                           "stride": [9], "capacity": [0.125], "context": [512],
                           "status": ["ok"]})
    frame = validate(pd.concat([table, sparse], ignore_index=True)).frame
    ref = reference.references(frame, None)
    assert ref.loc[12, "reference"] == "dense law"
    expected = 1.8 + 40 / 2e6**0.3 + 80 / (5e16 / 12e6) ** 0.25
    assert ref.loc[12, "reference_loss"] == pytest.approx(expected, rel=0.01)


def test_predict_paper_rows_with_bootstrap_intervals(tmp_path, capsys) -> None:
    """``xmod law predict`` with a fit of the paper's form: each sparse row's Delta by
    Eq. 14 on the fit's counts (the same as :func:`reference.law_frame` gives the
    fitted runs), the 2.5-97.5 percentile over the draws, and what lies outside the
    fitted ranges; a registered prediction is reproducible from these two files."""
    from xmodlm.law.paper_predict import predict_paper

    rows = paper_synthetic.results_table(seed=1)
    frame, _ = reference.law_frame(rows)
    law = paper.table8()
    bare = predict_paper(law, rows)
    assert len(bare) == len(rows) and bare["delta_lo"].isna().all()  # one per input row
    assert bare["run_id"].tolist() == rows["run_id"].tolist()  # each prediction names its run
    dense = bare["sparsity"] == 1
    assert dense.any() and np.allclose(bare.loc[dense, "delta"], paper.TABLE8["e"])
    merged = bare.merge(frame, on=["params_active", "params_total", "context", "sparsity",
                                   "anchor_stride"], suffixes=("", "_fitted"))
    assert len(merged) == len(frame)
    assert np.allclose(merged["delta"], paper.delta(paper_fit.point_of(merged), paper.TABLE8))
    rng = np.random.default_rng(0)
    base = np.array([paper.TABLE8[k] for k in paper.NAMES])
    law.samples = base * rng.lognormal(0.0, 0.05, size=(200, len(base)))
    out = predict_paper(law, rows)
    assert (out["delta_lo"] < out["delta"]).all() and (out["delta"] < out["delta_hi"]).all()
    assert out["outside"].str.contains("context 6.554e+04 outside", regex=False).sum() == (
        rows["context"] == 65536).sum() > 0
    fit = tmp_path / "fit.json"
    fit.write_text(json.dumps(law.to_json()))
    table = tmp_path / "rows.csv"
    rows.to_csv(table, index=False)
    assert main(["law", "predict", str(fit), "--input", str(table), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["predicts"] == "delta"
    assert [p["delta"] for p in got["predictions"]] == pytest.approx(list(out["delta"]))


def test_predictions_count_rows_as_the_fit_counted_runs(tmp_path, capsys) -> None:
    """A fit on a table without ``params_non_embedding`` (Eqs. 4-5) predicts planned
    rows that have it by its own rule: the same Delta as the rows without the column,
    not N_act with embeddings (1.15-1.47x larger on these backbones, N / N_act
    0.71-0.94x, Delta up to 0.023 nats off). A fit with embeddings refuses rows that
    cannot be counted its way, and recommend refuses an Eqs. 4-5 fit."""
    from xmodlm.law.paper_predict import predict_paper

    rows = paper_synthetic.results_table(seed=1)
    bare = rows.drop(columns="params_non_embedding")
    runs, record = reference.law_frame(bare)
    assert record["counts"] == paper.COUNTS_EQS_4_5
    law = paper_fit.fit_paper(runs, n_boot=0, protocols=(), reference=record)
    assert law.counts() == paper.COUNTS_EQS_4_5
    got, want = predict_paper(law, rows), predict_paper(law, bare)
    assert np.allclose(got["delta"], want["delta"]) and np.allclose(
        got["params_active"], want["params_active"])
    embedded = predict_paper(paper.PaperLaw(**{**law.__dict__, "reference": {
        **record, "counts": paper.COUNTS_WITH_EMBEDDINGS}}), rows)
    assert not np.allclose(embedded["params_active"], got["params_active"])

    runs, record = reference.law_frame(rows)
    assert record["counts"] == paper.COUNTS_WITH_EMBEDDINGS
    law_e = paper.PaperLaw(**{**law.__dict__, "reference": record})
    with pytest.raises(UserError, match="params_non_embedding"):
        predict_paper(law_e, bare)
    fit = tmp_path / "fit.json"
    fit.write_text(json.dumps(law.to_json()))
    capsys.readouterr()
    assert main(["recommend", "--law", str(fit), "--compute", "1e20", "--context", "8192",
                 "--active-params", "556e6"]) == 2
    assert "without embeddings" in capsys.readouterr().err
