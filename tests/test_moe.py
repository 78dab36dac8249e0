"""The fine-grained MoE (``model.moe_router=fine``): routing, balancing, dispatch
equivalences, the expert-load statistic and the MoE part of the accounting."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import tiny_model_cfg
from xmodlm import flops
from xmodlm.config import ModelConfig
from xmodlm.errors import UserError
from xmodlm.model import Transformer
from xmodlm.model.layers import SwiGLU
from xmodlm.model.moe import EXPERT_LOAD, BiasedSigmoidRouter, MoEMLP

FINE = {"router": "fine", "bias_rate": 1e-2}


@pytest.mark.parametrize("router", ["switch", "fine"])
def test_one_routed_expert_top1_equals_dense_swiglu(router: str) -> None:
    mlp = SwiGLU(32, 64)
    moe = MoEMLP(32, 64, n_experts=1, top_k=1, router=router)
    moe.experts[0].load_state_dict(mlp.state_dict())
    x = torch.randn(2, 8, 32, requires_grad=True)
    y_moe, aux = moe(x)
    y = mlp(x)
    torch.testing.assert_close(y_moe, y)
    torch.testing.assert_close(*(torch.autograd.grad(out.sum(), x)[0] for out in (y_moe, y)))
    assert aux["moe_balance"].item() == pytest.approx(1.0)


def _forward_and_grads(layer: MoEMLP, x: torch.Tensor, dispatch: str) -> list[torch.Tensor]:
    layer.dispatch = dispatch
    y, aux = layer(x)
    loss = (y * torch.linspace(-1, 1, y.shape[-1])).sum() + aux["moe_balance"]
    return [y, *torch.autograd.grad(loss, [x, *layer.parameters()])]


@pytest.mark.parametrize("router,n_shared", [("switch", 0), ("fine", 0), ("fine", 2)])
def test_sorted_dispatch_equals_loop_forward_and_backward(
    router: str, n_shared: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Output, the input's gradient and every weight's gradient (router, each expert,
    shared experts) agree, with the sorted path unpadded and padded."""
    from xmodlm.model import moe as moe_mod

    layer = MoEMLP(16, 24, n_experts=8, top_k=3, router=router, n_shared=n_shared)
    x = torch.randn(3, 11, 16, requires_grad=True)
    loop = _forward_and_grads(layer, x, "loop")
    assert all(g.abs().sum() > 0 for g in loop[1:])  # every expert got tokens: a real check
    for multiple in (1, 8):
        monkeypatch.setattr(moe_mod, "rows_multiple", lambda _x, m=multiple: m)
        for a, b in zip(_forward_and_grads(layer, x, "sorted"), loop, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fine_router_bias_selects_but_does_not_weigh() -> None:
    """The bias changes which experts a token gets, never the weights of the chosen:
    with every expert chosen (top_k = E) the output ignores the bias, and a large bias
    on one expert puts it in every token's top-k with its unbiased score."""
    router = BiasedSigmoidRouter(8, n_experts=4, top_k=4, bias_rate=0.0)
    x = torch.randn(20, 8)
    w0, e0, _ = router(x)
    router.bias_E.copy_(torch.tensor([5.0, -5.0, 0.3, 0.0]))
    w1, e1, _ = router(x)
    torch.testing.assert_close(w0.gather(-1, e0.argsort(-1)), w1.gather(-1, e1.argsort(-1)))
    router.top_k = 2
    weight_NK, expert_NK, _ = router(x)
    assert (expert_NK[:, 0] == 0).all() and not (expert_NK == 1).any()
    scores = torch.sigmoid(x @ router.weight.T)
    chosen = scores.gather(-1, expert_NK)
    torch.testing.assert_close(weight_NK, chosen / chosen.sum(-1, keepdim=True))


def test_bias_moves_toward_even_load_after_each_step() -> None:
    """Training forwards count assignments; eval and no-grad forwards do not; the step
    moves each bias by rate * sign(mean - load) and resets the counts."""
    layer = MoEMLP(8, 16, n_experts=4, top_k=1, **FINE)
    x = torch.randn(2, 16, 8)
    layer.eval()
    layer(x)
    layer.train()
    with torch.no_grad():
        layer(x)
    assert layer.router.load_E.sum() == 0
    _, aux = layer(x)
    load = layer.router.load_E.clone()
    assert load.sum() == 32 and torch.equal(load.long(), aux[EXPERT_LOAD])
    layer.after_optimizer_step()
    expect = 1e-2 * torch.sign(load.mean() - load)
    torch.testing.assert_close(layer.router.bias_E, expect)
    assert layer.router.load_E.sum() == 0
    layer.after_optimizer_step()  # nothing counted since: no move
    torch.testing.assert_close(layer.router.bias_E, expect)


def test_bias_balances_a_skewed_router() -> None:
    """Loss-free balancing alone evens out a router that starts sending most tokens
    to one expert (router weights held fixed): the load over the last 50 steps (sign
    updates oscillate step to step) is near even."""
    torch.manual_seed(1)
    layer = MoEMLP(8, 8, n_experts=4, top_k=1, router="fine", bias_rate=0.01)
    with torch.no_grad():
        layer.router.weight[0] += 0.5  # expert 0 wins most tokens
    x = torch.randn(1, 256, 8).abs()
    total_E = torch.zeros(4, dtype=torch.long)
    for step in range(250):
        _, aux = layer(x)
        if step == 0:
            before = aux[EXPERT_LOAD].max() / aux[EXPERT_LOAD].float().mean()
        if step >= 200:
            total_E += aux[EXPERT_LOAD]
        layer.after_optimizer_step()
    after = total_E.max() / total_E.float().mean()
    assert before > 3.0 and after < 1.2, (before, after)


def test_transformer_steps_every_moe_layer_and_reports_load() -> None:
    cfg = tiny_model_cfg(mlp="moe", n_experts=8, moe_top_k=2, moe_router="fine",
                         moe_granularity=4, moe_shared=1, moe_bias_rate=1e-2)
    model = Transformer(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.context))
    out = model(x, x, return_stats=True)
    out.total_loss.backward()
    assert set(out.aux) == {"moe_balance"}  # no z-loss: the expert load is not a loss
    loads = out.stats["expert_load_max_over_mean"]
    assert len(loads) == cfg.n_layers and all(1.0 <= v <= 8 for v in loads)
    model.after_optimizer_step()
    for block in model.blocks:
        assert block.block.mlp.router.bias_E.abs().sum() > 0
        assert block.block.mlp.router.load_E.sum() == 0
    assert "blocks.0.block.mlp.router.bias_E" in model.state_dict()  # routing state is saved
    assert "blocks.0.block.mlp.router.load_E" not in model.state_dict()


def test_each_piece_switches_off() -> None:
    base = dict(mlp="moe", n_experts=8, moe_top_k=2, moe_router="fine")
    x = torch.randint(0, 97, (2, 32))
    off = Transformer(tiny_model_cfg(**base, moe_aux_coef=0.0, moe_bias_rate=0.0))
    out = off(x, x)
    assert out.aux_loss is None  # the balance loss is reported but not trained on
    out.total_loss.backward()
    off.after_optimizer_step()
    mlp = off.blocks[0].block.mlp
    assert mlp.shared is None and mlp.router.bias_E.abs().sum() == 0


def test_default_moe_keeps_its_state_dict() -> None:
    """The switch router (the default) has no bias buffer and no shared expert: its
    checkpoints and random streams are the ones before the fine router existed."""
    cfg = tiny_model_cfg(mlp="moe", n_experts=4, moe_top_k=2)
    keys = set(Transformer(cfg).state_dict())
    assert not any("bias_E" in k or "shared" in k for k in keys)
    assert cfg.expert_dim == cfg.ffn_dim


def test_moe_config_is_validated() -> None:
    with pytest.raises(UserError, match="moe_router"):
        tiny_model_cfg(mlp="moe", moe_router="expert_choice")
    with pytest.raises(UserError, match="moe_granularity=5 does not divide"):
        tiny_model_cfg(mlp="moe", d_ff=96, moe_granularity=5)
    for key in ("moe_shared", "moe_bias_rate"):
        with pytest.raises(UserError, match=key):
            tiny_model_cfg(mlp="moe", **{key: -1})
    assert tiny_model_cfg(mlp="moe", d_ff=96, moe_granularity=4).expert_dim == 24


def test_moe_flops_match_flop_counter() -> None:
    """The MoE part of the count is what the layer's matmuls execute: router, top_k
    routed and the shared experts per token (fp32: no padding rows)."""
    cfg = tiny_model_cfg(mlp="moe", n_experts=8, moe_top_k=3, moe_router="fine",
                         d_ff=64, moe_granularity=4, moe_shared=2)
    layer = MoEMLP(cfg.d_model, cfg.expert_dim, cfg.n_experts, cfg.moe_top_k,
                   router="fine", n_shared=2)
    x = torch.randn(2, 16, cfg.d_model)
    with FlopCounterMode(display=False) as counter:
        layer(x)
    assert counter.get_total_flops() == 32 * flops.moe_mlp_flops(cfg)
    total, _ = flops.moe_mlp_params(cfg)
    assert total == sum(p.numel() for p in layer.parameters())


# The paper's backbones (Table 4: 16 query heads, 8 KV heads of 128, 28 layers, GPT-2
# vocabulary, untied) with MoE 6 of E routed + 2 shared experts, G = 8.
PAPER = {"556m": (1024, 3072), "936m": (1536, 3840), "1.65b": (2048, 6144)}
VOCAB, LAYERS = 50257, 28


def paper_moe(size: str, n_experts: int) -> ModelConfig:
    d, ffn = PAPER[size]
    cfg = ModelConfig(vocab_size=VOCAB, d_model=d, n_layers=LAYERS, n_heads=16, d_ff=ffn,
                      context=32768, mlp="moe", moe_router="fine", n_experts=n_experts,
                      moe_top_k=6, moe_shared=2, moe_granularity=8)
    cfg.validate()
    return cfg


def paper_total(cfg: ModelConfig) -> float:
    """Hand arithmetic for the attention, norms and embeddings (GQA: Q and O
    d x 2048, K and V d x 1024), the MoE part from :func:`flops.moe_mlp_params`."""
    d = cfg.d_model
    attn = 2 * d * 16 * 128 + 2 * d * 8 * 128
    return LAYERS * (attn + 2 * d + flops.moe_mlp_params(cfg)[0]) + d + 2 * VOCAB * d


@pytest.mark.parametrize("size,n_experts,expect", [
    ("556m", 64, 2.46e9), ("556m", 128, 4.58e9), ("936m", 64, 4.51e9), ("936m", 128, 8.48e9),
    ("1.65b", 64, 9.28e9), ("1.65b", 128, 17.7e9),  # the paper prints 17.16B (see docs)
])
def test_paper_moe_sizes(size: str, n_experts: int, expect: float) -> None:
    cfg = paper_moe(size, n_experts)
    assert cfg.expert_dim == {"556m": 384, "936m": 480, "1.65b": 768}[size]
    d, d_e = cfg.d_model, cfg.expert_dim
    per_layer = (n_experts + 2) * 3 * d * d_e + d * n_experts  # experts + router
    assert flops.moe_mlp_params(cfg)[0] == per_layer
    assert abs(paper_total(cfg) / expect - 1) < 0.03


def test_paper_moe_experts_alone_exceed_the_printed_17_16b() -> None:
    cfg = paper_moe("1.65b", 128)
    experts = LAYERS * (128 + 2) * 3 * cfg.d_model * cfg.expert_dim
    assert experts == pytest.approx(17.18e9, rel=1e-3) and experts > 17.16e9


def test_moe_active_flops_equal_dense_ffn_at_granularity() -> None:
    """6 routed + 2 shared experts of width d_ff / 8 run the dense FFN's FLOPs, plus
    the router: the paper's active-matched MoE."""
    moe = paper_moe("556m", 64)
    dense = dataclasses.replace(moe, mlp="swiglu")
    gap = flops.count(moe).flops_forward - flops.count(dense).flops_forward
    assert gap == 28 * 2 * 1024 * 64


def test_export_refuses_the_fine_moe() -> None:
    """The transformers export restates the switch router; a fine-grained MoE is
    refused in one line rather than exported wrong."""
    from types import SimpleNamespace

    from xmodlm.config import Config
    from xmodlm.export import export_config

    cfg = Config(model=tiny_model_cfg(mlp="moe", moe_router="fine", moe_shared=1))
    tok = SimpleNamespace(vocab_size=97, eot_id=0)
    with pytest.raises(UserError, match="switch MoE only"):
        export_config(cfg, tok, {})


def test_fine_router_adds_no_graph_break() -> None:
    """Under torch.compile the fine router (its selection bias, and the load counts it
    adds to a buffer in training) breaks the graph no more often than the switch
    router, whose only breaks are where the dispatch reads the slice sizes."""
    breaks, models = {}, {}
    for router in ("switch", "fine"):
        torch._dynamo.reset()
        cfg = tiny_model_cfg(mlp="moe", n_experts=4, moe_top_k=2, moe_d_ff=32, moe_router=router,
                             moe_shared=1, moe_bias_rate=1e-2)
        models[router] = model = Transformer(cfg)
        compiled = torch.compile(model, backend="eager")
        counters = torch._dynamo.utils.counters
        counters.clear()
        x = torch.randint(0, cfg.vocab_size, (2, cfg.context))
        compiled(x, x).total_loss.backward()
        breaks[router] = sum(counters["graph_break"].values())
    torch._dynamo.reset()
    assert 0 < breaks["fine"] <= breaks["switch"], breaks
    assert models["fine"].blocks[0].block.mlp.router.load_E.sum() == 2 * cfg.context * 2  # counted


def test_evaluation_reports_expert_load_per_moe_layer() -> None:
    """``evaluate`` (what ``xmod eval`` and training's evaluations call) reports
    max / mean expert load per MoE layer, and counts nothing toward the bias."""
    from xmodlm.eval.loss import evaluate

    cfg = tiny_model_cfg(layout="EDEE", mlp="moe", n_experts=4, moe_top_k=2,
                         moe_router="fine")
    model = Transformer(cfg)
    batches = [(torch.randint(0, 97, (2, 32)), torch.randint(0, 97, (2, 32))) for _ in range(2)]
    result = evaluate(model, batches, torch.device("cpu"), "fp32")
    loads = result["expert_load_max_over_mean"]
    assert len(loads) == 3 and all(1.0 <= v <= 4.0 for v in loads)
    assert all(b.block.mlp.router.load_E.sum() == 0 for b in model.blocks if b.aux_weights)
