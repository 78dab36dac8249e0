"""The scaling-law framework (DESIGN 5) on synthetic runs from known laws.

Every table comes from :func:`synthetic_runs`: a true dense law and delta form
with noise sigma = 0.01 in ln L, so a correct fit must put the truth inside its
95% bootstrap intervals and predict held-out runs to about the noise.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest

from xmodlm import flops
from xmodlm.errors import UserError
from xmodlm.law import delta, dense, holdout
from xmodlm.law.fit import fit_law, one_se_choice
from xmodlm.law.lawfit import LawFit, load_fit
from xmodlm.law.predict import predict
from xmodlm.law.recommend import dense_config, recommend
from xmodlm.law.synthetic import TRUE_DELTA, TRUE_DENSE, synthetic_runs
from xmodlm.law.table import read_table, validate
from xmodlm.model import active_depth
from xmodlm.report.law_plots import plot_law

SIGMA = 0.01
N_BOOT = 100  # enough for 95% percentile intervals in tests; the CLI default is 1000
TRUE_FORMS = {
    "base": TRUE_DELTA,
    "scale": {"g_cap": 0.03, "kappa": 0.1, "g_ctx": 0.01, "g_int": -0.005},
    "saturating": {"g_cap": 0.04, "r0": 0.5, "g_ctx": 0.01, "g_int": -0.005},
    "quadratic": {"g_cap": 0.04, "g_quad": 0.01, "g_ctx": 0.01, "g_int": -0.005},
}


def inside(table: dict, truth: dict) -> dict[str, bool]:
    return {k: table[k]["ci"][0] <= v <= table[k]["ci"][1] for k, v in truth.items()}


@pytest.fixture(scope="module")
def mixed_runs() -> pd.DataFrame:
    """Dense and X-MoD runs at two contexts and four compute tiers, base delta form."""
    return synthetic_runs(120, sigma=SIGMA, seed=1)


@pytest.fixture(scope="module")
def mixed_fit(mixed_runs: pd.DataFrame) -> LawFit:
    return fit_law(mixed_runs, n_boot=N_BOOT, seed=0)


@pytest.fixture(scope="module")
def sparse_helps() -> LawFit:
    """A law fitted where X-MoD clearly helps: many dense runs at one context."""
    runs = synthetic_runs(
        160,
        true_delta_params={"g_cap": 0.06, "g_ctx": 0.0, "g_int": 0.0},
        contexts=(1024,),
        dense_fraction=0.5,
        seed=2,
    )
    return fit_law(runs, form="base", n_boot=N_BOOT, seed=0)


def test_dense_fit_recovers_truth_from_minimal_csv(tmp_path) -> None:
    runs = synthetic_runs(48, sigma=SIGMA, dense_fraction=1.0, contexts=(1024,), seed=5)
    path = tmp_path / "runs.csv"
    runs[["params_active", "tokens", "val_loss"]].to_csv(path, index=False)
    fit = fit_law(read_table(path), n_boot=200, seed=0, min_steps=0)  # no steps column
    law = fit.to_json()["dense"][0]
    assert law["context"] == 0 and fit.selected is None and fit.notes
    assert all(inside(law["params"], TRUE_DENSE).values()), law["params"]
    for name, p in law["params"].items():
        assert p["ci"][1] > p["ci"][0], (
            f"{name}: a collapsed interval means the refits stopped early"
        )
    assert law["optimizer"]["converged"] and law["optimizer"]["grad_norm"] < 1e-6
    assert law["optimizer"]["bootstrap_converged"] > 0.95


@pytest.mark.parametrize("name", list(TRUE_FORMS))
def test_delta_form_recovers_truth(name: str) -> None:
    runs = synthetic_runs(100, true_delta_form=name, true_delta_params=TRUE_FORMS[name], seed=0)
    fit = fit_law(runs, form=name, n_boot=N_BOOT, seed=0)
    params = fit.to_json()["delta"]["forms"][name]["params"]
    assert all(inside(params, TRUE_FORMS[name]).values()), params
    assert fit.metrics["heldout"]["rmse"] < 2 * SIGMA


def test_auto_selects_by_heldout_error(mixed_fit: LawFit) -> None:
    selection = mixed_fit.selection
    assert selection is not None and selection["protocol"] == "leave-cell-out"
    rmse = {name: m["rmse"] for name, m in selection["heldout"].items()}
    assert set(rmse) == set(delta.FORMS)
    assert mixed_fit.selected == "base"  # the truth, and the simplest form
    assert rmse["base"] <= 1.1 * min(rmse.values())
    held = mixed_fit.metrics["heldout"]
    assert held["rmse"] < 2 * SIGMA and held["n"] == mixed_fit.runs["sparse"]
    assert held["kendall_tau"] > 0.5 and 0 <= held["regret"] < SIGMA
    assert 0.5 < held["ratio"] < 2


def _held(err: np.ndarray) -> holdout.HeldOut:
    rmse = float(np.sqrt(np.mean(err**2)))
    return holdout.HeldOut(
        "leave-cell-out", np.arange(len(err)), err, np.zeros(len(err)), {"rmse": rmse}
    )


def test_one_se_rule_prefers_the_simpler_form_only_within_noise() -> None:
    rng = np.random.default_rng(0)
    noise = rng.normal(0, 0.02, 60)
    params = {"base": 3, "scale": 4}
    rich = _held(noise)
    close = _held(noise + rng.normal(0, 0.004, 60))  # a hair worse: within one SE
    chosen, why = one_se_choice({"base": close, "scale": rich}, params)
    assert chosen == "base" and "within one standard error" in why
    far = _held(noise + 0.03)  # clearly worse on every run
    chosen, why = one_se_choice({"base": far, "scale": rich}, params)
    assert chosen == "scale" and why.startswith("lowest held-out RMSE")


def test_auto_picks_a_richer_form_when_the_data_demand_it() -> None:
    truth = {"g_cap": 0.03, "kappa": 0.5, "g_ctx": 0.01, "g_int": -0.005}
    runs = synthetic_runs(100, true_delta_form="scale", true_delta_params=truth, seed=0)
    fit = fit_law(runs, n_boot=N_BOOT, seed=0)
    assert fit.selected == "scale", fit.selection["why"]


@pytest.mark.parametrize("protocol", ["top-compute", "longest-context"])
def test_other_protocols(mixed_runs: pd.DataFrame, protocol: str) -> None:
    frame = validate(mixed_runs).frame
    rng = np.random.default_rng(0)
    fits = {}
    for t in (256, 1024):
        rows = frame[(frame["context"] == t) & ~frame["is_sparse"]]
        ln_n, ln_d = np.log(rows["params_active"]), np.log(rows["tokens"])
        fits[t] = dense.fit_dense(
            ln_n.to_numpy(), ln_d.to_numpy(), np.log(rows["val_loss"]).to_numpy(), rng, "t"
        )
    results, failed = holdout.evaluate(
        frame, protocol, [delta.FORMS["base"]], fits, delta.REFERENCE, rng
    )
    assert not failed
    metrics = results["base"].metrics
    assert metrics["n"] > 0 and metrics["rmse"] < 3 * SIGMA


def test_forms_are_exactly_zero_in_dense_limit() -> None:
    rng = np.random.default_rng(0)
    limit = pd.DataFrame(
        {
            "stride": [1, 1, 1, 2, 4, 16],
            "capacity": [0.125, 0.5, 1.0, 1.0, 1.0, 1.0],
            "context": [256, 1024, 8192, 256, 4096, 512],
            "params_active": [1e5, 1e7, 1e9, 1e6, 1e8, 3e7],
        }
    )
    limit["rho"] = limit["stride"] / (1 + limit["capacity"] * (limit["stride"] - 1))
    x = delta.Features.of(limit, delta.REFERENCE)
    for form in delta.FORMS.values():
        lo, hi = np.array([p.bounds for p in form.params]).T
        theta = lo + rng.random((50, len(lo))) * (hi - lo)
        for term in form.terms(theta, x).values():
            assert np.all(term == 0.0), form.name
        assert np.all(form.predict(theta, x) == 0.0)


def test_rho_matches_model_active_depth() -> None:
    for stride, capacity in [(2, 0.125), (4, 0.25), (8, 0.5)]:
        cfg, _ = flops.flop_match(dense_config(256, 512, 4096), stride, capacity)
        row = pd.DataFrame(
            {
                "params_active": [1e6],
                "tokens": [1e8],
                "stride": [stride],
                "capacity": [capacity],
                "context": [512],
            }
        )
        rho = validate(row, need_loss=False).frame["rho"].iloc[0]
        assert rho == pytest.approx(cfg.n_layers / active_depth(cfg), rel=1e-12)


def _runs(n: int = 12) -> pd.DataFrame:
    return synthetic_runs(n, dense_fraction=1.0, contexts=(512,), seed=3)


@pytest.mark.parametrize(
    "breaks, message",
    [
        (lambda df: df.head(4), "4 runs cannot fit the 5 dense-law parameters"),
        (lambda df: df.assign(val_loss=df["val_loss"].where(df.index != 3)), "row 3: val_loss"),
        (
            lambda df: df.assign(val_loss=df["val_loss"].where(df.index != 2, -1.0)),
            "row 2: val_loss=-1.0",
        ),
        (lambda df: df.assign(tokens=df["tokens"].where(df.index != 1, 0.0)), "row 1: tokens"),
        (lambda df: df.assign(params_active=1e6, tokens=1e8), "single configuration"),
        (lambda df: df.drop(columns=["val_loss", "tokens"]), "missing column(s) tokens, val_loss"),
        (lambda df: df.assign(status="failed"), "no usable runs"),
        (lambda df: df.assign(stride=4, capacity=0.25), "no dense runs"),
    ],
)
def test_degenerate_inputs_raise_user_error(breaks, message: str) -> None:
    with pytest.raises(UserError, match=re.escape(message)):
        fit_law(breaks(_runs()), n_boot=N_BOOT)


def test_bad_arguments_raise_user_error() -> None:
    runs = _runs()
    for kwargs, message in [
        ({"form": "cubic"}, "unknown delta form"),
        ({"holdout": "random"}, "unknown holdout protocol"),
        ({"n_boot": 5}, "n_boot=5"),
    ]:
        with pytest.raises(UserError, match=message):
            fit_law(runs, **kwargs)


def test_too_few_xmod_runs_for_the_form() -> None:
    runs = synthetic_runs(40, contexts=(512,), seed=3)
    few = pd.concat([runs[runs["stride"] == 1], runs[runs["stride"] > 1].head(2)])
    with pytest.raises(UserError, match=r"2 X-MoD runs cannot fit [23] parameters; need at least"):
        fit_law(few, form="base", n_boot=N_BOOT)


def test_unfinished_and_moe_runs_are_dropped_and_counted() -> None:
    runs = _runs().assign(status=["ok", "done", "diverged", "OK ", "running", "ok"] * 2)
    runs.loc[0, "family"] = "moe"
    validated = validate(runs)
    assert validated.dropped_unfinished == 4 and validated.excluded_moe == 1
    assert len(validated.frame) == 7


def test_read_table_csv_parquet_and_bad_paths(tmp_path) -> None:
    runs = _runs()
    runs.to_parquet(tmp_path / "runs.parquet")
    runs.to_csv(tmp_path / "runs.csv", index=False)
    for name in ("runs.parquet", "runs.csv"):
        pd.testing.assert_frame_equal(read_table(tmp_path / name), runs, check_dtype=False)
    (tmp_path / "runs.txt").write_text("x")
    (tmp_path / "bad.parquet").write_text("not parquet")
    for name, message in [
        ("missing.csv", "not found"),
        ("runs.txt", "expected a .csv"),
        ("bad.parquet", "not readable"),
    ]:
        with pytest.raises(UserError, match=message):
            read_table(tmp_path / name)


def test_predict_one_row_each_with_interval(mixed_fit: LawFit, mixed_runs: pd.DataFrame) -> None:
    out = predict(mixed_fit, mixed_runs)
    assert len(out) == len(mixed_runs)
    assert (out["lo"] <= out["pred_loss"]).all() and (out["pred_loss"] <= out["hi"]).all()
    assert (out["lo"] < out["hi"]).all()
    dense_rows = mixed_runs["stride"] == 1
    assert (out.loc[dense_rows, "delta"] == 0).all() and (
        out.loc[~dense_rows, "delta"] < 0
    ).mean() > 0.9
    terms = out[["capacity_term", "context_term", "interaction_term"]].sum(axis=1)
    assert np.allclose(terms, out["delta"])
    assert np.allclose(np.log(out["pred_loss"]), np.log(mixed_runs["val_loss"]), atol=4 * SIGMA)


def test_json_round_trip(mixed_fit: LawFit, tmp_path) -> None:
    data = json.loads(json.dumps(mixed_fit.to_json(), allow_nan=False))
    assert set(data["dense"][0]["params"]) == {"E", "A", "B", "alpha", "beta"}
    assert len(data["dense"][0]["samples"]) == N_BOOT
    path = tmp_path / "fit.json"
    path.write_text(json.dumps(data))
    again = load_fit(path)
    assert json.dumps(again.to_json()) == json.dumps(data)
    rows = pd.DataFrame(
        {
            "params_active": [1e7, 2e7],
            "tokens": [1e9, 1e9],
            "context": 1024,
            "stride": [1, 4],
            "capacity": [1, 0.25],
        }
    )
    pd.testing.assert_frame_equal(predict(again, rows), predict(mixed_fit, rows))
    path.write_text("{}")
    with pytest.raises(UserError, match="not a law fit"):
        load_fit(path)


def test_recommend_picks_sparse_when_the_law_says_so(sparse_helps: LawFit) -> None:
    out = recommend(
        1e17, 1024, 1e7, law=sparse_helps, strides=(1, 2, 4, 8), capacities=(0.125, 0.25, 0.5)
    )
    assert out["answer"].startswith("train X-MoD") and out["best"]["p_beats_dense"] >= 0.9
    assert out["best"]["p_routing_helps"] >= 0.9
    assert (
        out["best"] is out["candidates"][0] or out["best"]["loss"] >= out["candidates"][0]["loss"]
    )
    assert not out["warnings"]
    json.dumps(out, allow_nan=False)
    capped = recommend(1e17, 1024, 1e7, law=sparse_helps, max_total_params=3e7)
    assert capped["excluded_by_max_total_params"] > 0
    assert all(c["params_total"] <= 3e7 for c in capped["candidates"])


def test_report_names_resolved_terms_and_the_law_answer_per_cell(sparse_helps: LawFit) -> None:
    """The sweep report's law section says per named term whether the data resolve it
    (one context: the context term is held, not fitted), and its headline carries what
    `recommend` answers at each cell's budget for the cell's dense model."""
    from xmodlm.report.analysis import headline
    from xmodlm.report.sweep_report import _law_section

    terms = _law_section(sparse_helps, "fit.json")["terms"]
    assert set(terms) == {"capacity", "context", "interaction"}
    cap = terms["capacity"]
    assert cap["param"] == "g_cap" and not cap["fixed"]
    assert cap["resolved"] == (cap["ci"][0] > 0 or cap["ci"][1] < 0)
    assert cap["resolved"]  # the synthetic truth is g_cap = 0.06
    assert terms["context"]["fixed"] and not terms["context"]["resolved"]
    pairs = [{"context": 1024, "tier": 1e17, "width": 512, "family": "xmod", "n": 3,
              "config": "xmod S=4", "mean": -0.01, "se": 0.002, "resolved": True}]
    df = pd.DataFrame([{"family": "dense", "context": 1024, "tier": 1e17, "width": 512,
                        "params_active": 1e7}])
    (row,) = headline(pairs, df, sparse_helps)
    want = recommend(1e17, 1024, 1e7, law=sparse_helps)
    assert row["law"]["answer"] == want["answer"] != "train dense"
    assert row["law"]["top"]["stride"] == want["best"]["stride"]
    (row,) = headline(pairs, df.assign(context=2048), sparse_helps)
    assert row["law"]["answer"] is None  # no dense run in the cell to size the reference


def test_the_selected_law_is_scored_under_every_protocol(
    mixed_fit: LawFit, sparse_helps: LawFit
) -> None:
    """Selection uses one protocol; the fit also scores the chosen law under the other
    two where the table supports them (two contexts, four tiers, several cells), and
    says why where it does not (one context: no longest-context test)."""
    m = mixed_fit.metrics
    by = m["heldout_by_protocol"]
    assert list(by) == list(holdout.PROTOCOLS)
    assert by[m["heldout_protocol"]] == m["heldout"]
    for protocol, scores in by.items():
        assert scores["n"] > 0 and 0 < scores["rmse"] < 0.05, protocol  # noise is 0.01
    one = sparse_helps.metrics["heldout_by_protocol"]
    assert "2 or more context lengths" in one["longest-context"]["not_applicable"]
    assert one["top-compute"]["rmse"] > 0
    from xmodlm.report.render import _protocols_markdown

    md = "\n".join(_protocols_markdown(one, sparse_helps.metrics["heldout_protocol"]))
    assert f"| leave-cell-out (selects the form) | {one['leave-cell-out']['n']} |" in md
    assert "| longest-context | - | holdout longest-context needs" in md


@pytest.fixture(scope="module")
def sparse_hurts() -> LawFit:
    """A law fitted where X-MoD hurts (g_cap < 0) at one context."""
    runs = synthetic_runs(
        100,
        true_delta_params={"g_cap": -0.03, "g_ctx": 0.0, "g_int": 0.0},
        contexts=(1024,),
        seed=4,
    )
    return fit_law(runs, form="base", n_boot=N_BOOT, seed=0)


def test_recommend_says_dense_when_sparse_hurts(sparse_hurts: LawFit) -> None:
    out = recommend(1e17, 1024, 1e7, law=sparse_hurts)
    assert out["answer"] == "train dense" and out["best"] is None
    assert "P >= 0.9" in out["reason"]
    assert all(c["p_beats_dense"] < 0.9 for c in out["candidates"])


def test_recommend_does_not_credit_routing_with_a_size_change(sparse_hurts: LawFit) -> None:
    """A 3e5-parameter reference is 4 layers deep: S = 2 or 4 candidates miss its FLOPs by
    +17-50%, and at C = 1e14 that extra size alone beats the reference. The law says
    routing hurts, so the answer must stay dense and say why."""
    out = recommend(1e14, 1024, 3e5, law=sparse_hurts)
    bigger = [c for c in out["candidates"] if c["p_beats_dense"] >= 0.9]
    assert bigger and all(c["flop_mismatch"] > 0.1 for c in bigger)
    assert all(c["p_routing_helps"] < 0.1 for c in bigger)
    assert out["answer"] == "train dense" and "FLOP mismatch" in out["reason"]


def test_recommend_warns_on_extrapolation(sparse_helps: LawFit) -> None:
    out = recommend(1e22, 8192, 1e10, law=sparse_helps)
    text = " ".join(out["warnings"])
    assert "compute 1e+22" in text and "context 8192" in text and "active_params" in text


def test_recommend_names_each_input_outside_the_fit(sparse_helps: LawFit) -> None:
    """A candidate outside the fitted capacities (c = 1/16 when the fit saw 1/8-1/2) is
    marked along that axis, and only there; one inside every range is not marked."""
    fitted = sparse_helps.ranges
    out = recommend(1e17, 1024, 1e7, law=sparse_helps, strides=(4,), capacities=(0.0625, 0.125))
    by_c = {c["capacity"]: c for c in out["candidates"]}
    assert fitted["capacity"][0] > 0.0625 >= 0
    assert [w.split(" ")[0] for w in by_c[0.0625]["outside"]] == ["capacity"]
    assert by_c[0.0625]["extrapolated"] and not by_c[0.125]["outside"]
    assert "capacity (1)" in " ".join(out["warnings"])
    # the reason speaks of its configuration's axes when that one is outside
    picked = out["best"] or max(out["candidates"], key=lambda e: e["p_beats_dense"])
    if picked["outside"]:
        assert "capacity 0.0625 outside" in out["reason"]


def test_recommend_uses_the_shipped_law() -> None:
    """Without --law the shipped micro-law fit answers, says so, and flags extrapolation."""
    inside = recommend(1e12, 128, 3e5)
    assert inside["warnings"][0].startswith("no --law given")
    assert inside["law"]["contexts"] == [128]
    far = recommend(1e17, 1024, 1e7)
    assert any("outside the fitted" in w for w in far["warnings"])
    assert all(c["extrapolated"] for c in far["candidates"])


def test_plot_law_writes_pngs(mixed_fit: LawFit, mixed_runs: pd.DataFrame, tmp_path) -> None:
    """Four PNGs, and the figures show the fit's numbers: the predicted-vs-observed
    panel holds every fitted run at (observed, law's prediction) and every held-out
    run at its refit prediction; the delta panel's points are ln L - ln L_dense law."""
    from xmodlm.law.predict import predict_samples
    from xmodlm.report import law_plots

    paths = plot_law(mixed_fit, mixed_runs, tmp_path)
    assert sorted(p.name for p in paths) == sorted(
        ["law_isoflop.png", "law_pred_obs.png", "law_delta.png", "law_bootstrap.png"]
    )
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    frame = validate(mixed_runs).frame
    fig = law_plots._pred_obs(mixed_fit, frame)
    in_fit, held = (c.get_offsets() for c in fig.axes[0].collections)
    expected = np.exp(predict_samples(mixed_fit, frame).ln_point)
    np.testing.assert_allclose(in_fit[:, 0], frame["val_loss"])
    np.testing.assert_allclose(in_fit[:, 1], expected)
    np.testing.assert_allclose(held[:, 0], mixed_fit.heldout_points["observed"])
    np.testing.assert_allclose(held[:, 1], mixed_fit.heldout_points["predicted"])
    assert fig.axes[0].get_xlabel() == "observed loss"
    sparse = frame[frame["is_sparse"]]
    fig = law_plots._delta(mixed_fit, frame)
    points = np.vstack([c.get_offsets() for c in fig.axes[0].collections])
    observed = np.log(sparse["val_loss"].to_numpy()) - predict_samples(mixed_fit, sparse).ln_dense
    assert sorted(points[:, 1]) == pytest.approx(sorted(observed))


def test_a_budget_the_runs_stopped_just_short_of_is_inside_the_fit() -> None:
    """Runs stop on a whole step, a hair under their budget (5.99999e13 for 6e13):
    asking at the budget is not an extrapolation; 2% past it is."""
    from xmodlm.law.recommend import outside_fit

    ranges = {"compute": [6.69e12, 5.99999549e13], "tokens": [1e6, 2.99e7], "params_active": [3e4, 1.8e6]}
    assert outside_fit(ranges, {"compute": 6e13, "tokens": 3e7, "params_active": 1.8e6}) == []
    far = outside_fit(ranges, {"compute": 6.12e13, "tokens": 1e7, "params_active": 1.9e6})
    assert [w.split(" ")[0] for w in far] == ["compute", "N_ae"]
