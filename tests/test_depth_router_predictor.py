"""The ``predictor`` depth-router kind: an MLP on stop-gradient inputs decides."""

from __future__ import annotations

import torch

from conftest import tiny_model_cfg
from xmodlm.depth_routers.predictor import Predictor
from xmodlm.model import Transformer


def test_predictor_does_not_touch_lm_loss() -> None:
    cfg = tiny_model_cfg(stride=2, capacity=0.25, causal_router="predictor")
    model = Transformer(cfg)
    x = torch.randint(0, 97, (2, 32))
    model(x, x).loss.backward()
    heads = [b.router.head for b in model.routed_blocks()]
    assert all(p.grad is None for h in heads for p in h.parameters())
    model(x, x).total_loss.backward()  # the BCE trains the predictor
    assert all(h[0].weight.grad is not None for h in heads)


def test_head_matrices_decay_biases_do_not_and_cost_is_its_size() -> None:
    kind = Predictor(32)
    head = kind.build_head()
    assert kind.extra_params() == sum(p.numel() for p in head.parameters())
    assert all(not layer.bias.detach().any() for layer in (head[0], head[2]))
    assert kind.decays("head.0.weight", 2) and not kind.decays("head.0.bias", 1)
    assert not kind.decays("weight", 2)  # the router vector: never
