"""The ``bce`` depth-router kind: the router's own logit is the decision."""

from __future__ import annotations

import torch

from conftest import tiny_model_cfg
from xmodlm.depth_routers.bce import RouterLogit
from xmodlm.model import Transformer


def test_decision_is_the_router_logit_at_no_extra_cost() -> None:
    kind = RouterLogit(32)
    assert kind.extra_params() == 0 and kind.extra_flops() == 0 and kind.build_head() is None
    assert not kind.decays("weight", 2)
    model = Transformer(tiny_model_cfg(stride=2, capacity=0.5))
    router = model.routed_blocks()[0].router
    x = torch.randn(2, 5, 32)
    r = router.logits(x)
    assert torch.equal(router.decision_logits(x, r), r)


def test_the_bce_trains_the_router_itself() -> None:
    model = Transformer(tiny_model_cfg(stride=2, capacity=0.25, causal_coef=1.0, gating="logit"))
    x = torch.randint(0, 97, (2, 32))
    out = model(x, x)
    (bce,) = torch.autograd.grad(out.aux_loss, [model.routed_blocks()[0].router.weight],
                                 retain_graph=True, allow_unused=True)
    assert bce is not None and bce.abs().sum() > 0
