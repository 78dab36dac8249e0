"""The depth-router seam: every kind, through the one interface blocks, decoding,
FLOP counting and the optimiser use; calibration of the causal threshold; loading
checkpoints from before the seam."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import tiny_model_cfg
from xmodlm import flops
from xmodlm.config import CAUSAL_ROUTERS
from xmodlm.depth_routers import kinds
from xmodlm.errors import UserError
from xmodlm.model import Transformer
from xmodlm.model.blocks import RoutedBlock
from xmodlm.train.optim import param_groups

KINDS = sorted(kinds())


def _model(kind: str, **changes: object) -> Transformer:
    cfg = tiny_model_cfg(n_layers=8, stride=4, capacity=0.25, causal_router=kind, **changes)
    return Transformer(cfg).eval()


def _tokens(n: int, T: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 97, (n, T), generator=torch.Generator().manual_seed(seed))


def test_every_kind_is_a_config_choice() -> None:
    assert set(KINDS) >= {"bce", "predictor"} and tuple(KINDS) == CAUSAL_ROUTERS
    with pytest.raises(UserError, match="causal_router"):
        tiny_model_cfg(stride=2, capacity=0.5, causal_router="oracle")


@pytest.mark.parametrize("kind", KINDS)
def test_a_kinds_stated_cost_is_what_its_block_holds_and_runs(kind: str) -> None:
    """Parameters: the analytic count of a sparse block equals its module's; FLOPs:
    the kind's extra cost equals what its head executes on every token."""
    model = _model(kind)
    block = next(b for b in model.blocks if isinstance(b, RoutedBlock))
    total, _ = flops.block_params(model.cfg, "s")
    assert total == sum(p.numel() for p in block.parameters())
    x = torch.randn(2, 32, 32)
    r = block.router.logits(x)  # 2 d a token, the same for every kind
    with FlopCounterMode(display=False) as counter:
        block.router.decision_logits(x, r)
    assert counter.get_total_flops() == pytest.approx(64 * block.router.kind.extra_flops())


@pytest.mark.parametrize("kind", KINDS)
def test_calibration_routes_exactly_c_on_its_text_under_causal_forward(kind: str) -> None:
    """Calibrated block by block on the ragged path, every block of the (masked)
    causal forward then routes exactly k / T of the same windows: each threshold
    was fitted to the stream its block meets behind the blocks before it."""
    model = _model(kind)
    idx = _tokens(20)
    assert model.threshold_rule() == "half (not calibrated)"
    thresholds = model.calibrate_thresholds_(idx)
    assert len(thresholds) == 6 and model.threshold_rule() == "calibrated"
    with torch.no_grad():
        used = model(idx, routing_mode="causal", return_stats=True).stats["capacity_used"]
    assert used == [0.25] * 6
    with model.using_threshold_rule("half"), torch.no_grad():
        half = model(idx, routing_mode="causal", return_stats=True).stats["capacity_used"]
    assert half != used and model.threshold_rule() == "calibrated"


def test_half_rule_ignores_stored_thresholds() -> None:
    model = _model("bce")
    model.calibrate_thresholds_(_tokens(8))
    half = Transformer(dataclasses.replace(model.cfg, causal_threshold="half")).eval()
    half.load_state_dict(model.state_dict())
    assert half.threshold_rule() == "half"
    idx = _tokens(4, seed=1)
    with torch.no_grad(), model.using_threshold_rule("half"):
        want = model(idx, routing_mode="causal").logits
    with torch.no_grad():
        torch.testing.assert_close(half(idx, routing_mode="causal").logits, want)


@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpoint_from_before_the_seam_loads_and_says_half(kind: str) -> None:
    """Old checkpoints held the predictor as ``predictor.*`` on the block and no
    thresholds: they load strictly, unchanged, and route by the half rule."""
    model = _model(kind)
    old = {}
    for key, value in model.state_dict().items():
        if key.endswith(("router.threshold", "router.calibrated")):
            continue
        old[key.replace("router.head.", "predictor.")] = value
    fresh = _model(kind)
    fresh.load_state_dict(old, strict=True)
    assert fresh.threshold_rule() == "half (not calibrated)"
    idx = _tokens(2)
    with torch.no_grad():
        torch.testing.assert_close(
            fresh(idx, routing_mode="causal").logits, model(idx, routing_mode="causal").logits
        )


@pytest.mark.parametrize("kind", KINDS)
def test_the_optimiser_asks_the_router_for_its_decay_rule(kind: str) -> None:
    model = _model(kind)
    decayed = {id(p) for p in param_groups(model, 0.1)[0]["params"]}
    for block in model.routed_blocks():
        for name, p in block.router.named_parameters():
            assert (id(p) in decayed) == block.router.kind.decays(name, p.dim()), name
