"""The paper's law: Eq. 14 with Table 8, the paper's backbones, and the recommender."""

from __future__ import annotations

import json

import numpy as np
import pytest

from xmodlm.cli import main
from xmodlm.errors import UserError
from xmodlm.law import backbone as bb
from xmodlm.law import paper
from xmodlm.law.paper_recommend import recommend_paper

# Table 1 (L = 32k): N_act label -> (N of A4K8, N of A3K16 as printed), (X-MoD minus Dense)
TABLE1 = {
    556e6: ((2.64e9, 4.79e9), (2.549 - 2.773, 2.503 - 2.773)),
    936e6: ((4.52e9, 8.24e9), (2.427 - 2.635, 2.402 - 2.635)),
    1.65e9: ((8.31e9, 14.73e9), (2.359 - 2.531, 2.322 - 2.531)),
}
# Eq. 14 with Table 8 on those rows (N_act the label, N the printed total), to 3 decimals
PREDICTED = {556e6: (-0.180, -0.216), 936e6: (-0.174, -0.209), 1.65e9: (-0.168, -0.202)}


@pytest.mark.parametrize("n_act", sorted(TABLE1))
def test_table8_predicts_table1_rows(n_act: float) -> None:
    (n_a4k8, n_a3k16), measured = TABLE1[n_act]
    x = paper.Point.of(n_act, [n_a4k8, n_a3k16], 32768, [8, 16], [4, 3])
    pred = paper.delta(x, paper.TABLE8)
    assert pred == pytest.approx(PREDICTED[n_act], abs=6e-4)
    # the law under-predicts the measured gain, by 0.004-0.054 nats
    gap = np.asarray(measured) - pred
    assert np.all(gap < 0.001) and np.all(gap > -0.06)


def test_eq14_vanishes_where_the_paper_says() -> None:
    p = paper.TABLE8
    dense = paper.Point.of(556e6, 556e6, 32768, 1.0, 3.0)
    assert paper.delta(dense, p) == pytest.approx([p["e"]])
    at_a1 = paper.terms(paper.Point.of(556e6, 3e9, 8192, 8.0, 1.0), p)
    assert at_a1["anchor"] == pytest.approx([0.0])
    assert at_a1["capacity"][0] < 0 < at_a1["context"][0]


def test_backbones_count_the_paper_tables() -> None:
    """Table 1 totals and Table 6 FLOPs per token from the construction."""
    b = bb.backbone_for(556e6)
    dense, a4k8, a3k16 = bb.build(b, 1, 0, 0), bb.build(b, 8, 4), bb.build(b, 16, 3)
    assert (dense.blocks, a4k8.blocks, a3k16.blocks) == (28, 161, 298)
    assert dense.params_total / 1e9 == pytest.approx(0.543, abs=0.001)
    assert a4k8.params_total / 1e9 == pytest.approx(2.64, abs=0.005)
    assert a3k16.params_total / 1e9 == pytest.approx(4.79, abs=0.005)
    for m, table6 in ((dense, 8.4e9), (a4k8, 3.9e9), (a3k16, 3.9e9)):
        assert m.flops_forward(32768) == pytest.approx(table6, rel=0.02)
    assert bb.build(bb.backbone_for(936e6), 16, 3).params_total / 1e9 == pytest.approx(8.24, abs=0.01)
    assert bb.backbone_for(2e9).d_model % 128 == 0  # off the table: the shape rule


def _total_at(n_act: float):
    b = bb.backbone_for(n_act)

    def total(k: float) -> float:
        return (b.layer_params * (4 + 12 * (1 + k)) + b.embedding_params) * n_act / b.dense_total

    return total


def test_k_hat_grows_with_context_and_falls_with_scale() -> None:
    p = paper.TABLE8
    k = {L: paper.k_hat(p, 556e6, L, _total_at(556e6)) for L in (2048, 8192, 32768)}
    assert k[2048] == pytest.approx(3.1, abs=0.1)
    assert 21 <= k[32768] <= 25
    assert k[2048] < k[8192] < k[32768]
    assert paper.k_hat(p, 936e6, 32768, _total_at(936e6)) < k[32768]
    assert paper.eq16_exponents(p)["context"] == pytest.approx(0.55, abs=0.01)


def test_recommend_answers_inside_the_fitted_range_by_default() -> None:
    out = recommend_paper(1e20, 32768, 556e6)
    cands = out["candidates"]
    assert [c["delta"] for c in cands] == sorted(c["delta"] for c in cands)
    assert out["best"] == cands[0] and out["best"]["delta"] < 0
    assert all(3 <= c["sparsity"] <= 16 and 0.5 <= c["anchor_stride"] <= 5 for c in cands)
    assert not any(c["outside_range"] for c in cands)
    for key in ("sparsity", "anchor_stride", "dense_prefix", "params_total", "params_active",
                "delta", "terms", "outside_range"):
        assert key in out["best"]
    assert set(out["best"]["terms"]) == {"capacity", "context", "anchor"}
    assert out["law"]["name"] == "paper" and "Table 8" in out["law"]["provenance"]["source"]
    # the A4K8 candidate is the paper's model: 161 blocks, Delta as in Table 1's check
    a4k8 = next(c for c in cands if (c["sparsity"], c["anchor_stride"]) == (8, 4))
    assert a4k8["blocks"] == 161 and a4k8["delta"] == pytest.approx(-0.180, abs=0.002)
    assert a4k8["flops_ratio"] == pytest.approx(0.47, abs=0.01)


def test_recommend_k_trend_with_context() -> None:
    """At A = 1 the best K is about 3 at 2k and grows with L; K_hat beside it."""
    best_at_a1, k_hat = {}, {}
    for L in (2048, 8192, 32768, 65536):
        out = recommend_paper(1e20, L, 556e6, extrapolate=True)
        best_at_a1[L] = out["optimum"]["grid_best_at_a1"]["sparsity"]
        k_hat[L] = out["optimum"]["k_hat"]
    assert best_at_a1[2048] == 3
    assert best_at_a1[2048] < best_at_a1[8192] < best_at_a1[32768] < best_at_a1[65536]
    assert k_hat[2048] < k_hat[8192] < k_hat[32768] < k_hat[65536]


def test_extrapolate_flags_and_limits() -> None:
    out = recommend_paper(1e20, 32768, 556e6, extrapolate=True)
    big = [c for c in out["candidates"] if c["sparsity"] > 16]
    assert big and all(c["outside_range"] and c["outside"] for c in big)
    assert max(c["sparsity"] for c in out["candidates"]) == 64
    capped = recommend_paper(1e20, 32768, 556e6, max_total_params=3e9)
    assert capped["excluded_by_max_total_params"] > 0
    assert all(c["params_total"] <= 3e9 for c in capped["candidates"])
    far = recommend_paper(1e20, 65536, 556e6)
    assert far["warnings"] and all("context" in " ".join(c["outside"]) for c in far["candidates"])
    with pytest.raises(UserError, match="max_total_params"):
        recommend_paper(1e20, 32768, 556e6, max_total_params=1e8)


def test_cli_recommend_law_paper(capsys) -> None:
    assert main(["recommend", "--law", "paper", "--compute", "1e20", "--context", "2048",
                 "--active-params", "556e6", "--json", "--top", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["candidates"]) == 3 and out["n_candidates"] > 3
    assert out["optimum"]["k_hat"] == pytest.approx(3.1, abs=0.1)
    assert main(["recommend", "--law", "paper", "--compute", "1e20", "--context", "32768",
                 "--active-params", "556e6"]) == 0
    assert "K_hat" in capsys.readouterr().out


def test_paper_law_json_round_trip(tmp_path) -> None:
    law = paper.table8()
    path = tmp_path / "law.json"
    path.write_text(json.dumps(law.to_json()))
    back = paper.PaperLaw.from_json(json.loads(path.read_text()))
    assert back.value == law.value and back.ranges == law.ranges
    assert main(["recommend", "--law", str(path), "--compute", "1e20", "--context", "8192",
                 "--active-params", "556e6", "--json"]) == 0


def test_recommend_on_a_preset_backbone(capsys) -> None:
    """``--backbone cpu-d64``: the candidates are that preset's models (its width, GQA
    heads, FFN, vocabulary, 8 active layers), N_act its dense total; the paper's shape
    of that size would be another model. Exactly one of --active-params and --backbone."""
    from xmodlm.config import load_config
    from xmodlm.law.backbone import backbone_of
    from xmodlm.law.paper_recommend import recommend_paper

    cfg = load_config("cpu-d64", ["model.vocab_size=4096"]).model
    b = backbone_of(cfg)
    assert (b.d_model, b.head_dim, b.ffn_dim, b.n_heads, b.n_kv_heads, b.active_layers) == (
        64, 16, 192, 4, 2, 8)
    out = recommend_paper(1e14, 4096, 0.0, backbone=b, dense_prefixes=(2,))
    assert out["inputs"]["active_params"] == b.dense_total == b.label
    a1k8 = next(e for e in out["candidates"] if e["sparsity"] == 8 and e["anchor_stride"] == 1)
    xmod = load_config("cpu-d64", ["model.vocab_size=4096", "model.sparsity=8",
                                   "model.anchor_stride=1"]).model
    assert a1k8["blocks"] == len(xmod.depth.layout) == 29
    assert main(["recommend", "--law", "paper", "--compute", "1e14", "--context", "4096",
                 "--backbone", "cpu-d64", "--dense-prefix", "2"]) == 0
    assert "train" in capsys.readouterr().out
    assert main(["recommend", "--law", "paper", "--compute", "1e14", "--context", "4096",
                 "--backbone", "cpu-d64", "--active-params", "5e8"]) == 2
    assert "not both" in capsys.readouterr().err
