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
