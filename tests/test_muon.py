"""Muon: the update against torch.optim.Muon, stacked matrices, the parameter split,
the combined optimiser's state, and the settings' checks."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import tiny_model_cfg
from xmodlm.config import TrainConfig
from xmodlm.errors import UserError
from xmodlm.model import Transformer
from xmodlm.train.muon import Muon, orthogonalise
from xmodlm.train.optim import MuonAdamW, build_optimizer, set_lr, trained_by_muon


def _steps(params: list[torch.Tensor], opt: torch.optim.Optimizer, grads: list[list[torch.Tensor]]) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_is_torch_muon_on_matrices(nesterov: bool) -> None:
    """bf16 Newton-Schulz, RMS match 0.2: torch.optim.Muon(adjust_lr_fn="match_rms_adamw")."""
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(8, 5, generator=gen), torch.randn(4, 6, generator=gen)]
    grads = [[torch.randn(p.shape, generator=gen) for p in init] for _ in range(3)]
    ours = [p.clone().requires_grad_() for p in init]
    ref = [p.clone().requires_grad_() for p in init]
    kw = dict(lr=0.05, weight_decay=0.1, momentum=0.9, nesterov=nesterov, ns_steps=5)
    _steps(ours, Muon(ours, rms_match=0.2, ns_dtype=torch.bfloat16, **kw), grads)
    _steps(ref, torch.optim.Muon(ref, adjust_lr_fn="match_rms_adamw", **kw), grads)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_stacked_matrices_are_orthogonalised_one_by_one() -> None:
    """An (E, A, B) tensor is E matrices: each orthogonalised and scaled on its own."""
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(3, 6, 4, generator=gen)
    stacked = orthogonalise(g, 5, torch.float32)
    for e in range(3):
        torch.testing.assert_close(stacked[e], orthogonalise(g[e], 5, torch.float32))
    # about orthogonal: singular values in a band around 1
    s = torch.linalg.svdvals(orthogonalise(g[0], 10, torch.float32))
    assert float(s.min()) > 0.5 and float(s.max()) < 1.5
    w = torch.randn(3, 6, 4, generator=gen)
    one = w.clone().requires_grad_()
    split = [w[e].clone().requires_grad_() for e in range(3)]
    _steps([one], Muon([one], lr=0.1, ns_dtype=torch.float32), [[g]])
    _steps(split, Muon(split, lr=0.1, ns_dtype=torch.float32), [list(g)])
    for e in range(3):
        torch.testing.assert_close(one[e], split[e])


def test_update_rms_is_rms_match_times_lr() -> None:
    """With rms_match r, a matrix's (orthogonal) update has RMS about r x lr."""
    p = torch.zeros(64, 32, requires_grad=True)
    p.grad = torch.randn(64, 32)
    Muon([p], lr=0.01, weight_decay=0.0, rms_match=0.3, ns_dtype=torch.float32, ns_steps=10).step()
    assert float(p.detach().pow(2).mean().sqrt()) == pytest.approx(0.3 * 0.01, rel=0.15)


def test_every_parameter_lands_in_exactly_one_group() -> None:
    """Hidden matrices (attention, MLP, experts) to Muon; embedding, head, norms, routers
    (depth, their predictor heads, MoE), gammas and biases to AdamW, decayed or not."""
    model = Transformer(
        tiny_model_cfg(n_layers=4, layout="DsEs", causal_router="predictor", n_experts=2, moe_top_k=1)
    )
    opt = build_optimizer(model, TrainConfig(optimizer="muon"))
    assert isinstance(opt, MuonAdamW)
    muon_ids = {id(p) for g in opt.muon.param_groups for p in g["params"]}
    adamw_ids = [id(p) for g in opt.adamw.param_groups for p in g["params"]]
    assert not muon_ids & set(adamw_ids) and len(adamw_ids) == len(set(adamw_ids))
    names = dict(model.named_parameters())
    assert muon_ids | set(adamw_ids) == {id(p) for p in names.values()}
    to_muon = {n for n, p in names.items() if id(p) in muon_ids}
    assert to_muon == {n for n, p in names.items() if trained_by_muon(n, p)}
    for name in ("blocks.0.block.attn.qkv.weight", "blocks.0.block.attn.proj.weight",
                 "blocks.1.block.mlp.gate_up.weight", "blocks.1.block.mlp.down.weight",
                 "blocks.2.block.mlp.experts.1.down.weight"):
        assert name in to_muon, name
    for name in ("embed.weight", "head.weight", "norm.weight", "blocks.0.block.norm1.weight",
                 "blocks.1.router.weight", "blocks.1.router.head.0.weight",
                 "blocks.1.router.head.0.bias", "blocks.2.block.mlp.router.weight",
                 "blocks.1.gamma"):
        assert name not in to_muon, name
    assert all(n.startswith("blocks.") and names[n].dim() == 2 for n in to_muon)


def test_muon_adamw_state_round_trip_and_learning_rates() -> None:
    """One state dict restores both optimisers; adamw_lr sets AdamW's peak (0: train.lr);
    a plain AdamW state is refused."""
    cfg = TrainConfig(optimizer="muon", lr=0.01, adamw_lr=0.002, warmup_steps=0, schedule="constant")
    torch.manual_seed(0)
    model = Transformer(tiny_model_cfg(n_layers=2))
    opt = build_optimizer(model, cfg, torch.float32)
    assert set_lr(opt, 0, 10, cfg) == 0.01
    assert {g["lr"] for g in opt.muon.param_groups} == {0.01}
    assert {g["lr"] for g in opt.adamw.param_groups} == {0.002}
    x = torch.randint(0, 97, (2, 8))
    model(x, x).total_loss.backward()
    opt.step()
    saved = opt.state_dict()
    again = build_optimizer(model, cfg, torch.float32)
    again.load_state_dict(saved)
    assert torch.equal(
        next(iter(again.muon.state.values()))["momentum_buffer"],
        next(iter(opt.muon.state.values()))["momentum_buffer"],
    )
    with pytest.raises(ValueError, match="not train.optimizer=muon"):
        again.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())
    same = TrainConfig(optimizer="muon", lr=0.01)
    assert {g["lr"] for g in build_optimizer(model, same).adamw.param_groups} == {0.01}


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"optimizer": "sgd"}, "train.optimizer='sgd': must be one of adamw, muon"),
        ({"muon_momentum": 1.0}, "train.muon_momentum=1.0: must be in [0, 1)"),
        ({"muon_ns_steps": 0}, "train.muon_ns_steps=0: must be an integer in 1..20"),
        ({"muon_rms_match": 0.0}, "train.muon_rms_match=0.0: must be > 0"),
        ({"adamw_lr": -1.0}, "train.adamw_lr=-1.0: must be >= 0"),
    ],
)
def test_bad_muon_settings_are_clear_errors(setting: dict[str, object], message: str) -> None:
    with pytest.raises(UserError, match=re.escape(message)):
        TrainConfig(**setting).validate()
