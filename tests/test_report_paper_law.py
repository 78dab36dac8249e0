"""``xmod report --law FIT`` with a fit of the paper's law: its held-out scores beside
the constant-Delta baseline, and its predictions for the runs it did not see (a
registered prediction) scored against their outcomes, on a synthetic sweep drawn from
Table 8, fitted without its L = 64k group."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from xmodlm.cli import main
from xmodlm.law import paper, paper_synthetic


@pytest.fixture(scope="module")
def reported(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, pd.DataFrame]:
    tmp = tmp_path_factory.mktemp("paper_law_report")
    table = paper_synthetic.results_table(noise=0.005, seed=0)
    every, before = tmp / "results.csv", tmp / "before.csv"
    table.to_csv(every, index=False)
    table[table["context"] < 65536].to_csv(before, index=False)  # the fit precedes those runs
    fit = tmp / "law.json"
    assert main(["law", "fit", str(before), "--form", "paper", "--min-steps", "0",
                 "--n-boot", "10", "--holdout", "leave-a-out", "--out", str(fit),
                 "--quiet"]) == 0
    out = tmp / "report"
    assert main(["report", str(every), "--law", str(fit), "--out", str(out)]) == 0
    return (json.loads((out / "report.json").read_text()), (out / "report.md").read_text(),
            table)


def test_unseen_runs_are_predicted_and_scored(reported) -> None:
    report, _, table = reported
    law = report["law"]
    assert law["kind"] == "paper" and law["variant"] == "xmod"
    unseen = law["unseen"]
    far = table[(table["context"] == 65536) & (table["family"] == "xmod")]
    assert sorted(r["run_id"] for r in unseen["rows"]) == sorted(far["run_id"])
    truth = paper_synthetic.table(noise=0.005, seed=0)
    truth = truth[truth["context"] == 65536]
    for r in unseen["rows"]:
        assert r["outside"] and "context" in r["outside"][0]
        lo, hi = r["interval"]
        assert lo <= r["predicted"] <= hi
        # measured against the same dense reference as the fit: the synthetic Delta
        measured = truth[truth["sparsity"] == r["K"]]["delta"].iloc[0]
        assert r["observed"] == pytest.approx(measured, abs=1e-9)
        assert r["in_band"] == (abs(r["predicted"] - r["observed"]) <= 0.02)
    assert unseen["n"] == len(far) and unseen["rmse"] < unseen["baseline"]["rmse"]


def test_the_section_and_the_claims_show_the_law(reported, tmp_path: Path) -> None:
    report, md, _ = reported
    law = report["law"]
    assert set(law["params"]) == set(paper.NAMES)
    assert all(p["ci"][0] <= p["value"] <= p["ci"][1] for p in law["params"].values())
    assert "points" not in law["heldout"]["leave-a-out"]  # the plots' data stay in the fit
    assert law["heldout"]["leave-a-out"]["beats_baseline"]
    assert sorted(Path(p).name for p in law["plots"]) == ["paper_k.png", "paper_pred_true.png"]
    assert "### The law" in md and "## Law" in md
    assert md.count("Runs the fit did not see") == 2  # the claim and the law section
    assert "| leave-a-out |" in md


def test_a_fit_without_its_runs_recorded_is_said_so(tmp_path: Path) -> None:
    from xmodlm.report.paper_law_section import paper_law_section

    section = paper_law_section(paper.table8(), "paper", pd.DataFrame(), None, tmp_path)
    assert section["unseen"] is None and section["plots"] == [] and "no record" in section["note"]


def test_the_law_curves_are_reference_plus_delta(reported) -> None:
    """The law's loss against K at A = 1 for each context and backbone: the dense
    reference plus Eq. 14's Delta, which sits on the synthetic losses to within the
    fit's error; 32k holds several backbones, each its own curve."""
    report, _, table = reported
    curves = report["law"]["loss_curves"]
    a1 = table[(table["family"] == "xmod") & (table["anchor_stride"] == 1)]
    assert sorted({c["context"] for c in curves}) == sorted(a1["context"].unique())
    truth = paper_synthetic.table(noise=0.005, seed=0)
    truth = truth[truth["anchor_stride"] == 1]
    backbones = truth.loc[truth["context"] == 32768, "label"].nunique()
    assert backbones > 1 and sum(c["context"] == 32768 for c in curves) == backbones
    for c in curves:
        here = truth[(truth["context"] == c["context"])
                     & (abs(truth["params_active"] / c["params_active"] - 1) < 0.03)]
        assert c["K"] == sorted(here["sparsity"].astype(float))
        measured = here.sort_values("sparsity")["val_loss"].to_numpy()
        assert c["loss"] == pytest.approx(list(measured), abs=0.03)
        assert max(abs(a - b) for a, b in zip(c["loss"], measured, strict=True)) > 1e-4  # the law's, not the data
