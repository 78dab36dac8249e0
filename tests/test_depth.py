"""The paper's (K, A, N0) construction and its aliases (xmodlm.depth, ModelConfig.depth)."""

from __future__ import annotations

import pytest

from xmodlm import depth, flops
from xmodlm.config import load_config
from xmodlm.depth import DepthError, construct, paper_layout, stages
from xmodlm.errors import UserError


def _blocks(layout: str) -> tuple[int, int]:
    return len(layout), layout.count("s")


def test_the_papers_layouts() -> None:
    # appendix B.1: A4K8 = D x4 + (S8 x24 + D) + (S8 x32 + D) x4 at 28 active layers
    a4k8 = paper_layout(8, 4, 4, 28)
    assert a4k8 == "D" * 4 + "s" * 24 + "D" + ("s" * 32 + "D") * 4
    assert _blocks(a4k8) == (161, 152)
    assert construct(8, 4, 4, 28).stage_sparse == (24, 32, 32, 32, 32)
    a3k16 = paper_layout(16, 3, 4, 28)
    assert a3k16 == "D" * 4 + ("s" * 48 + "D") * 6 and len(a3k16) == 298
    mod = paper_layout(8, 0.125, 1, 28)  # D + (S8 + D) x 24
    assert mod == "D" + "sD" * 24 and len(mod) == 49
    for K, A, N0, L in ((8, 4, 4, 28), (16, 3, 4, 28), (8, 1, 2, 8), (4, 0.5, 2, 8), (16, 5, 2, 8)):
        assert depth.active_depth(paper_layout(K, A, N0, L), 1 / K) == pytest.approx(L)


def test_dense_and_ablation_layouts() -> None:
    assert paper_layout(1, 4, 4, 28) == "D" * 28  # K = 1 is dense of the same depth
    assert paper_layout(8, 1, 28, 28) == "D" * 28  # all prefix
    no_anchor = paper_layout(8, 1, 2, 8, anchors=False)
    assert no_anchor == "DD" + "s" * 48  # each anchor -> K sparse blocks
    assert depth.active_depth(no_anchor, 1 / 8) == 8
    assert stages(no_anchor) == [list(range(48))]  # no anchor, one stage
    no_prefix = paper_layout(8, 1, 0, 8)
    assert no_prefix == ("s" * 8 + "D") * 4
    assert stages(paper_layout(8, 1, 2, 8)) == [list(range(0, 8)), list(range(8, 16)),
                                               list(range(16, 24))]
    assert paper_layout(8, 4, 2, 8, dense="E").startswith("EEE")


@pytest.mark.parametrize("args, words", [
    ((8, 3, 2, 2.5), "shortened first stage"),
    ((8, 0.3, 2, 8), "must be whole"),
    ((2.5, 1, 2, 8), "whole number"),
    ((8, 1, 9, 8), "prefix alone"),
    ((0.5, 1, 2, 8), ">= 1"),
])
def test_impossible_combinations_say_why(args: tuple, words: str) -> None:
    with pytest.raises(DepthError, match=words):
        construct(*args)


def test_aliases_resolve_in_one_place() -> None:
    base = load_config("dense-tiny").model
    legacy = base.__class__(**{**base.__dict__, "n_layers": 12, "stride": 4, "capacity": 0.125})
    d = legacy.depth
    assert (d.sparsity, d.anchor_stride, d.stride, d.capacity) == (8, 0.375, 4, 0.125)
    assert d.layout == "DsssDsssDsss" and d.construction == "stride"
    # (K, A) given in place of (S, c), in the stride construction
    same = base.__class__(**{**base.__dict__, "n_layers": 12, "sparsity": 8, "anchor_stride": 3 / 8})
    assert same.block_layout == d.layout
    # (S, c) given in place of (K, A), in the paper's construction
    paper = base.__class__(**{**base.__dict__, "active_layers": 8, "dense_prefix": 2,
                              "capacity": 0.125, "stride": 9})
    assert paper.block_layout == paper_layout(8, 1, 2, 8)
    assert (paper.depth.sparsity, paper.depth.anchor_stride) == (8, 1)


def test_config_refuses_what_cannot_be_built() -> None:
    with pytest.raises(UserError, match="disagree"):
        load_config("dense-tiny", ["model.sparsity=8", "model.capacity=0.25"])
    with pytest.raises(UserError, match="shortened first stage"):
        load_config("dense-tiny", ["model.active_layers=2.5", "model.dense_prefix=2",
                                   "model.sparsity=8", "model.anchor_stride=3"])
    with pytest.raises(UserError, match="not both"):
        load_config("dense-tiny", ["model.active_layers=8", "model.layout=DD"])


def test_paper_config_counts_its_blocks() -> None:
    cfg = load_config("dense-tiny", ["model.active_layers=8", "model.dense_prefix=2",
                                     "model.sparsity=8", "model.anchor_stride=1"]).model
    assert cfg.num_blocks == 29 and flops.active_depth(cfg) == pytest.approx(8)
    dense = load_config("dense-tiny", ["model.active_layers=8", "model.dense_prefix=2"]).model
    assert dense.block_layout == "D" * 8 and cfg.family == "xmod" and dense.family == "dense"
