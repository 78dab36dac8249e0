"""The routing mathematics (xmodlm.model.routing): pure functions, tested alone."""

from __future__ import annotations

import pytest
import torch

from xmodlm import flops
from xmodlm.model import routing


def test_exactly_k_tokens_selected_and_sorted() -> None:
    r_BT = torch.randn(3, 50)
    for c in (0.01, 0.125, 0.5, 1.0):
        k = flops.capacity_tokens(c, 50)
        idx = routing.topk_indices(r_BT, k)
        assert idx.shape == (3, k)
        assert (idx[:, 1:] > idx[:, :-1]).all(), "indices must be sorted (causal order)"
        expected = torch.topk(r_BT, k, dim=-1).indices.sort(-1).values
        assert torch.equal(idx, expected)
    valid = torch.ones(3, 50, dtype=torch.bool)
    valid[:, :10] = False
    r_big = r_BT.clone()
    r_big[:, :10] = 100.0  # padding must never win
    idx = routing.topk_indices(r_big, 5, valid)
    assert (idx >= 10).all()


@pytest.mark.parametrize("gating", ["logit", "sigmoid", "variance_scaled"])
def test_gated_scatter_equals_the_separate_ops(gating: str) -> None:
    """The fused gate-and-scatter node: forward bit for bit, gradients (x, f, r, gamma)
    equal to autograd through gather, gate and scatter-add, and a float64 gradcheck."""
    torch.manual_seed(0)
    B, T, K, D = 2, 12, 4, 6
    idx = routing.topk_indices(torch.randn(B, T), K)

    def leaves(dtype: torch.dtype) -> list[torch.Tensor]:
        torch.manual_seed(1)
        vals = [torch.randn(B, T, D), torch.randn(B, K, D), torch.randn(B, T), torch.tensor([1.7])]
        return [v.to(dtype).requires_grad_() for v in vals]

    x, f, r, gamma = leaves(torch.float32)
    g = gamma if gating == "variance_scaled" else None
    fused = routing.gated_scatter(x, f, r, idx, gating, g)
    xs, fs, rs, gammas = leaves(torch.float32)
    gate_BK = routing.gate(torch.gather(rs, 1, idx), gating, gammas if g is not None else None)
    plain = routing.scatter_add_tokens(xs, idx, gate_BK.unsqueeze(-1) * fs)
    assert torch.equal(fused, plain)
    w = torch.randn_like(fused)
    (fused * w).sum().backward()
    (plain * w).sum().backward()
    for a, b in ((x, xs), (f, fs), (r, rs)) + (((gamma, gammas),) if g is not None else ()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    x, f, r, gamma = leaves(torch.float64)
    args = (x, f, r, idx, gating, gamma if g is not None else None)
    assert torch.autograd.gradcheck(routing.gated_scatter, args)


def test_balance_loss_zero_when_balanced_and_positive_when_collapsed() -> None:
    even = torch.full((2, 10, 3), 0.5)
    assert routing.balance_loss([even]).item() == pytest.approx(0.0, abs=1e-9)
    collapsed = torch.zeros(2, 10, 3)
    collapsed[:, :2] = 1.0
    assert routing.balance_loss([collapsed]).item() > 1.0


def test_solve_gamma_finds_the_root_of_a_curved_response() -> None:
    """The secant solver meets its tolerance on a convex, offset response in gamma^2."""
    def response(g: float) -> float:
        return 1.0 + 0.8 * g**2 + 0.05 * g**4

    gamma = routing.solve_gamma(response, target=3.0)
    assert response(gamma) == pytest.approx(3.0, rel=0.01)
    assert routing.solve_gamma(response, target=0.5) == pytest.approx(0.2)  # unreachable: floor


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.125, 0.25, 0.5, 0.9, 1.0])
def test_threshold_routes_exactly_the_fraction(fraction: float) -> None:
    """k = round(f N) logits lie strictly above the threshold, and the causal
    decision with it routes exactly those."""
    d_N = torch.randn(1000, generator=torch.Generator().manual_seed(3)) * 5 - 2
    threshold = routing.threshold_for_fraction(d_N, fraction)
    routed = routing.causal_decision(d_N, threshold)
    assert int(routed.sum()) == round(fraction * 1000)
    assert torch.equal(routed, d_N > threshold)


def test_threshold_is_the_midpoint_of_the_boundary_pair() -> None:
    d = torch.tensor([4.0, -1.0, 2.0, 0.0, 3.0])
    assert routing.threshold_for_fraction(d, 0.4) == pytest.approx(2.5)  # 4, 3 above
    assert routing.threshold_for_fraction(d.view(1, 5), 0.2) == pytest.approx(3.5)  # any shape


def test_causal_decision_is_strictly_above_the_threshold() -> None:
    d = torch.tensor([[-0.5, 0.0, 0.5, 1.0]])
    assert routing.causal_decision(d, 0.0).tolist() == [[False, False, True, True]]
    assert routing.causal_decision(d, torch.tensor([0.5])).tolist() == [[False, False, False, True]]


def test_stage_stats_beside_the_reference_schemes() -> None:
    """Identical subsets give coverage p and Jaccard 1; disjoint ones full coverage and
    Jaccard 0; the random reference is the closed form."""
    from xmodlm.model.routing import stage_stats

    same = torch.zeros(4, 2, 8, dtype=torch.bool)
    same[:, :, :2] = True
    got = stage_stats(same)
    assert got["coverage"] == 0.25 and got["jaccard"] == 1.0
    assert got["update_hist"] == [0.75, 0.0, 0.0, 0.0, 0.25]
    assert got["identical"] == {"coverage": 0.25, "jaccard": 1.0}
    assert abs(got["random"]["coverage"] - (1 - 0.75**4)) < 1e-12
    assert abs(got["random"]["jaccard"] - 0.25 / 1.75) < 1e-12
    assert abs(sum(got["random"]["update_hist"]) - 1) < 1e-12
    apart = torch.zeros(4, 2, 8, dtype=torch.bool)
    for n in range(4):
        apart[n, :, 2 * n: 2 * n + 2] = True
    got = stage_stats(apart)
    assert got["coverage"] == 1.0 and got["jaccard"] == 0.0 and got["update_hist"][1] == 1.0


def test_token_bias_spreads_identical_routers_over_a_stage() -> None:
    """Blocks with the same router and no branch output (the stream never changes)
    pick the same tokens without the bias and disjoint ones with it; the count
    resets at each anchor, so every stage starts from the raw logits again."""
    import dataclasses

    from conftest import tiny_model_cfg
    from xmodlm.model import Transformer

    cfg = tiny_model_cfg(active_layers=7, dense_prefix=1, sparsity=4, anchor_stride=0.5,
                         gating="sigmoid", context=32)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.context))

    def run(tau: float) -> tuple[list[dict], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = Transformer(dataclasses.replace(cfg, token_bias_tau=tau))
        with torch.no_grad():
            w = torch.randn_like(model.routed_blocks()[0].router.weight)
            for b in model.routed_blocks():
                b.router.weight.copy_(w)
            for name, p in model.blocks.named_parameters():
                if name.endswith(("attn.proj.weight", "mlp.down.weight")):
                    p.zero_()
            pos = torch.arange(cfg.context)
            _, outs = model.run_blocks(model.embed(x), pos, "topk", model.rope(pos))
            sel = [out.processed_BT for out in outs if out.processed_BT is not None]
            return model(x, return_stats=True).stats["stages"], sel

    off, _ = run(0.0)
    on, sel = run(10.0)
    assert len(on) == 4 and all(s["blocks"] == 2 for s in on)
    assert all(s["jaccard"] == 1.0 and s["coverage"] == 0.25 for s in off)
    assert all(s["jaccard"] == 0.0 and s["coverage"] == 0.5 for s in on)
    assert torch.equal(sel[0], sel[2]) and torch.equal(sel[1], sel[3])  # reset at the anchor
