"""Equivalence and behaviour tests of the model family (DESIGN 2, 3, 6)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import tiny_model_cfg
from test_presets import SHRINK, STEPPED
from xmodlm import flops
from xmodlm.config import load_config
from xmodlm.model import Transformer, routing
from xmodlm.model.blocks import RoutedBlock
from xmodlm.model.layers import CPU_FP32_ATTENTION_MAX_KEYS, SwiGLU, attention
from xmodlm.model.moe import MoEMLP


def _tokens(cfg, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, cfg.context))


def _copy_matching(src: Transformer, dst: Transformer) -> None:
    """Load src's weights into dst wherever names match after stripping routing extras."""
    src_state = src.state_dict()
    dst_state = dst.state_dict()
    for name in dst_state:
        if name in src_state:
            dst_state[name] = src_state[name].clone()
    dst.load_state_dict(dst_state)


def _grads(model: Transformer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_xmod_capacity_one_equals_dense_forward_and_grads() -> None:
    """With c = 1 and the gate neutralised (g = 1), every sparse block is a dense block."""
    dense_cfg = tiny_model_cfg(n_layers=4)
    # explicit layout keeps the routed blocks although capacity is 1
    xmod_cfg = tiny_model_cfg(n_layers=4, layout="DsDs", capacity=1.0, gating="variance_scaled")
    dense, xmod = Transformer(dense_cfg), Transformer(xmod_cfg)
    _copy_matching(dense, xmod)
    for block in xmod.blocks:
        if isinstance(block, RoutedBlock):
            torch.nn.init.zeros_(block.router.weight)  # sigmoid(0) = 1/2 times the
            # variance-scaled rule's gamma at c = 1 (2, not set here): gate exactly 1
    x = _tokens(dense_cfg)
    out_d, out_x = dense(x, x), xmod(x, x)
    torch.testing.assert_close(out_x.logits, out_d.logits, rtol=1e-5, atol=1e-5)
    out_d.loss.backward()
    out_x.loss.backward()
    gd, gx = _grads(dense), _grads(xmod)
    for name, g in gd.items():
        torch.testing.assert_close(gx[name], g, rtol=1e-4, atol=1e-6)


def test_stride_one_equals_dense() -> None:
    """S = 1 builds the dense model itself: same parameters drawn in the same order
    (no router, gate or predictor), same FLOPs, same logits, with no weights copied."""
    from xmodlm import flops

    sparse_cfg = tiny_model_cfg(stride=1, capacity=0.125, gating="variance_scaled", balance_coef=0.01)
    torch.manual_seed(0)
    a = Transformer(sparse_cfg)
    torch.manual_seed(0)
    b = Transformer(tiny_model_cfg())
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    assert flops.count(a.cfg) == flops.count(b.cfg)
    x = _tokens(a.cfg)
    out_a, out_b = a(x, x), b(x, x)
    assert torch.equal(out_a.logits, out_b.logits)
    assert torch.equal(out_a.total_loss, out_b.total_loss)  # no auxiliary loss either


@pytest.mark.parametrize("changes", [
    dict(gating="sigmoid"),
    dict(gating="sigmoid", gate_scope="ffn"),  # MoD's x + a + g f
    dict(gating="variance_scaled", with_bias=True),  # r less the token-choice bias
], ids=["block", "ffn", "bias"])
def test_routed_block_gather_path_equals_masked_reference(changes: dict) -> None:
    """The gathered k-token block equals dense attention masked to those tokens at
    their original positions (forward and backward), for either gate scope and with
    a token-choice bias."""
    changes = dict(changes)
    with_bias = changes.pop("with_bias", False)
    cfg = tiny_model_cfg(n_layers=4, stride=2, capacity=0.25, **changes)
    model = Transformer(cfg)
    block = model.blocks[1]
    assert isinstance(block, RoutedBlock)
    x = torch.randn(2, cfg.context, cfg.d_model, requires_grad=True)
    pos = torch.arange(cfg.context)
    shift = 0.5 * torch.randint(0, 3, (2, cfg.context)).float() if with_bias else None
    y_fast, out = block(x, model.rope, pos, "topk", shift_BT=shift)
    r = block.router.logits(x) - (0 if shift is None else shift)
    y_ref = block.masked_forward(x, r, out.topk_BT, model.rope, pos)
    torch.testing.assert_close(y_fast, y_ref, rtol=1e-5, atol=1e-5)
    (g_fast,) = torch.autograd.grad(y_fast.square().sum(), x)
    (g_ref,) = torch.autograd.grad(y_ref.square().sum(), x)
    torch.testing.assert_close(g_fast, g_ref, rtol=1e-4, atol=1e-5)
    # unselected tokens ride the residual stream unchanged
    torch.testing.assert_close(y_fast[~out.topk_BT], x[~out.topk_BT])


def test_causal_routing_runs_on_routed_tokens_and_equals_the_masked_reference() -> None:
    """Causal routing gathers each sequence's routed tokens (a varying number, padded
    to the most) and equals dense attention masked to them, forward and backward; a
    sequence that routes nothing passes through."""
    cfg = tiny_model_cfg(n_layers=4, stride=2, capacity=0.25)
    model = Transformer(cfg)
    block = model.blocks[1]
    assert isinstance(block, RoutedBlock)
    x = torch.randn(3, cfg.context, cfg.d_model, requires_grad=True)
    pos = torch.arange(cfg.context)
    r = block.router.logits(x)
    with torch.no_grad():
        block.router.threshold.fill_(float(r[0].median()))  # uneven counts per sequence
    y_fast, out = block(x, model.rope, pos, "causal")
    sel = out.causal_BT
    assert len(set(sel.sum(1).tolist())) > 1
    y_ref = block.masked_forward(x, r, sel, model.rope, pos)
    torch.testing.assert_close(y_fast, y_ref, rtol=1e-5, atol=1e-5)
    (g_fast,) = torch.autograd.grad(y_fast.square().sum(), x)
    (g_ref,) = torch.autograd.grad(y_ref.square().sum(), x)
    torch.testing.assert_close(g_fast, g_ref, rtol=1e-4, atol=1e-5)
    none = torch.zeros_like(sel)
    torch.testing.assert_close(block.ragged_forward(x, r, none, model.rope, pos_T=pos), x)


@pytest.mark.parametrize("gating", ["logit", "sigmoid", "variance_scaled"])
def test_router_receives_gradient(gating: str) -> None:
    cfg = tiny_model_cfg(stride=2, capacity=0.25, gating=gating, causal_coef=0.0)
    model = Transformer(cfg)
    x = _tokens(cfg)
    model(x, x).loss.backward()  # LM loss only: the gate alone must carry the gradient
    for block in model.blocks:
        if isinstance(block, RoutedBlock):
            assert block.router.weight.grad is not None
            assert block.router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("causal_router", ["bce", "predictor"])
def test_causal_mode_is_causal(causal_router: str) -> None:
    cfg = tiny_model_cfg(stride=2, capacity=0.25, causal_router=causal_router)
    model = Transformer(cfg).eval()
    # make the decisions non-trivial: some tokens in, some out
    for block in model.blocks:
        if isinstance(block, RoutedBlock):
            torch.nn.init.normal_(block.router.weight, std=1.0)
    x = _tokens(cfg, batch=1)
    t = cfg.context // 2
    y = x.clone()
    y[:, t + 1 :] = torch.randint(0, cfg.vocab_size, (1, cfg.context - t - 1))
    with torch.no_grad():
        a = model(x, routing_mode="causal").logits
        b = model(y, routing_mode="causal").logits
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1])
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


def test_topk_mode_is_not_causal() -> None:
    """Sanity check of the test above: top-k routing does look ahead."""
    cfg = tiny_model_cfg(stride=2, capacity=0.25)
    model = Transformer(cfg).eval()
    for block in model.blocks:
        if isinstance(block, RoutedBlock):
            torch.nn.init.normal_(block.router.weight, std=1.0)
    x = _tokens(cfg, batch=1)
    y = x.clone()
    y[:, cfg.context // 2 :] = (y[:, cfg.context // 2 :] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(x).logits, model(y).logits
    assert not torch.allclose(a[:, : cfg.context // 2], b[:, : cfg.context // 2])


def test_predictor_does_not_touch_lm_loss() -> None:
    cfg = tiny_model_cfg(stride=2, capacity=0.25, causal_router="predictor")
    model = Transformer(cfg)
    x = _tokens(cfg)
    model(x, x).loss.backward()
    for block in model.blocks:
        if isinstance(block, RoutedBlock):
            assert all(p.grad is None for p in block.router.head.parameters())
    out = model(x, x)
    out.total_loss.backward()  # the BCE trains the predictor
    preds = [b.router.head for b in model.blocks if isinstance(b, RoutedBlock)]
    assert all(p[0].weight.grad is not None for p in preds)


def test_short_bf16_attention_runs_in_fp32_on_a_cpu() -> None:
    """bf16 attention over at most CPU_FP32_ATTENTION_MAX_KEYS keys is the fp32 kernel's
    result cast back (causal and masked alike), under bf16 autocast as in training (which
    would otherwise cast SDPA's inputs back to bf16); over more keys it is bf16's own."""
    import torch.nn.functional as F

    n = CPU_FP32_ATTENTION_MAX_KEYS
    gen = torch.Generator().manual_seed(0)
    for keys in (16, n, 2 * n):
        q, k, v = (torch.randn(2, 2, keys, 16, generator=gen).bfloat16() for _ in range(3))
        mask = torch.rand(keys, keys, generator=gen) < 0.5
        mask |= torch.eye(keys, dtype=torch.bool)
        fp32 = [F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True),
                F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)]
        bf16 = [F.scaled_dot_product_attention(q, k, v, is_causal=True),
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = [attention(q, k, v, causal=True), attention(q, k, v, mask)]
        want = [y.bfloat16() for y in fp32] if keys <= n else bf16
        for g, w, b in zip(got, want, bf16, strict=True):
            assert g.dtype == torch.bfloat16 and torch.equal(g, w), keys
            if keys <= n:
                assert not torch.equal(g, b)  # the kernels do differ: the test can tell
    x = torch.randn(2, 2, 8, 16)  # fp32 stays as it is
    assert torch.equal(attention(x, x, x, causal=True),
                       F.scaled_dot_product_attention(x, x, x, is_causal=True))


def test_moe_one_expert_equals_dense_mlp() -> None:
    mlp = SwiGLU(32, 64)
    moe = MoEMLP(32, 64, n_experts=1, top_k=1)
    moe.experts[0].load_state_dict(mlp.state_dict())
    x = torch.randn(2, 8, 32, requires_grad=True)
    y_moe, aux = moe(x)
    torch.testing.assert_close(y_moe, mlp(x))
    (g1,) = torch.autograd.grad(y_moe.sum(), x)
    (g2,) = torch.autograd.grad(mlp(x).sum(), x)
    torch.testing.assert_close(g1, g2)
    assert aux["moe_balance"].item() == pytest.approx(1.0)


def test_moe_loop_equals_reference_mixture() -> None:
    """The sorted dispatch equals the naive per-token weighted sum of expert outputs."""
    moe = MoEMLP(16, 32, n_experts=4, top_k=2)
    x = torch.randn(1, 10, 16)
    y, _ = moe(x)
    probs = torch.softmax(x[0] @ moe.router.weight.T, -1)
    w, e = probs.topk(2, -1)
    w = w / w.sum(-1, keepdim=True)
    ref = torch.stack(
        [sum(w[t, j] * moe.experts[int(e[t, j])](x[0, t]) for j in range(2)) for t in range(10)]
    )
    torch.testing.assert_close(y[0], ref, rtol=1e-5, atol=1e-6)


def test_moe_padded_dispatch_equals_unpadded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Padding each expert's rows (what bf16 on a CPU does) changes nothing but the
    row counts the experts see: output and every gradient equal the unpadded
    dispatch. Checked in fp32 with the padding forced, so round-off cannot hide a
    misplaced row."""
    from xmodlm.model import moe as moe_mod

    torch.manual_seed(0)
    layer = MoEMLP(16, 32, n_experts=4, top_k=2)
    x = torch.randn(3, 10, 16, requires_grad=True)

    def run() -> tuple[torch.Tensor, ...]:
        seen.clear()
        y, aux = layer(x)
        loss = (y * torch.arange(16.0)).sum() + aux["moe_balance"]
        return (y, *torch.autograd.grad(loss, [x, *layer.parameters()]))

    seen: list[int] = []
    for expert in layer.experts:
        expert.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[0]))
    plain = run()
    assert sum(seen) == 3 * 10 * 2
    monkeypatch.setattr(moe_mod, "rows_multiple", lambda _x: 8)
    padded = run()
    assert all(n % 8 == 0 for n in seen) and sum(seen) > 3 * 10 * 2
    for a, b in zip(padded, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_moe_pads_rows_only_for_low_precision_cpu_matmuls() -> None:
    from xmodlm.model.moe import CPU_LOW_PRECISION_ROWS_MULTIPLE, rows_multiple

    x = torch.randn(4, 8)
    assert rows_multiple(x) == 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert rows_multiple(x) == CPU_LOW_PRECISION_ROWS_MULTIPLE
        layer = MoEMLP(8, 16, n_experts=4, top_k=2)
        seen: list[int] = []
        for expert in layer.experts:
            expert.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[0]))
        layer(torch.randn(2, 40, 8))
    assert seen and all(n % CPU_LOW_PRECISION_ROWS_MULTIPLE == 0 for n in seen)


def test_logits_carry_a_graph_only_without_targets() -> None:
    """With targets the loss is the training path and the logits come back detached
    (a compiled step would otherwise zero-fill a (B, T, V) gradient for them every
    step); without targets they are the output to differentiate, as in the HF
    wrapper's own loss."""
    cfg = tiny_model_cfg(n_layers=8, stride=4, capacity=0.25)
    model = Transformer(cfg)
    x = _tokens(cfg)
    out = model(x, x)
    assert not out.logits.requires_grad and out.total_loss.requires_grad
    torch.testing.assert_close(out.logits, model(x).logits)
    assert model(x).logits.requires_grad


def test_moe_graph_breaks_only_at_its_dispatch() -> None:
    """Under torch.compile an MoE model breaks its graph only where the dispatch reads
    the expert slice sizes: one break per MoE layer plus one host read, and the block
    loop (:meth:`Transformer.run_blocks`, a nested frame, which dynamo then runs
    eagerly around the compiled blocks) counts two more: 4 + 3 here. A data-dependent
    op in the router or its losses (a bincount in the balance loss was one) adds a
    break per layer on top."""
    torch._dynamo.reset()
    cfg = tiny_model_cfg(mlp="moe", n_experts=4, moe_top_k=2, moe_d_ff=32)
    compiled = torch.compile(Transformer(cfg), backend="eager")
    counters = torch._dynamo.utils.counters
    counters.clear()
    x = _tokens(cfg)
    compiled(x, x).total_loss.backward()
    breaks = sum(counters["graph_break"].values())
    assert breaks <= cfg.num_blocks + 3, dict(counters["graph_break"])
    torch._dynamo.reset()


def test_aux_losses_and_stats_come_back_from_forward() -> None:
    cfg = tiny_model_cfg(n_layers=8, stride=4, capacity=0.25, balance="cv", balance_coef=0.01)
    model = Transformer(cfg)
    x = _tokens(cfg)
    out = model(x, x, return_stats=True)
    assert set(out.aux) == {"causal_bce", "balance"}
    assert out.aux_loss is not None and out.aux_loss.requires_grad
    s = out.stats
    assert len(s["coverage"]) == 2 and len(s["jaccard"]) == 5
    assert len(s["depth_hist"]) == 7 and abs(sum(s["depth_hist"]) - 1) < 1e-6
    assert all(abs(c - 0.25) < 1e-6 for c in s["capacity_used"])
    assert 0.0 <= s["agreement_mean"] <= 1.0
    # balancing off costs nothing: the term is not even computed
    cfg_off = tiny_model_cfg(n_layers=8, stride=4, capacity=0.25, balance="cv", balance_coef=0.0)
    assert "balance" not in Transformer(cfg_off)(x, x).aux


def test_explicit_layout_overrides_derived() -> None:
    cfg = tiny_model_cfg(n_layers=6, stride=3, capacity=0.5, layout="Dsssss")
    model = Transformer(cfg)
    assert model.layout == "Dsssss"
    assert model.windows == [[0, 1, 2, 3, 4]]


@pytest.mark.parametrize("name", STEPPED)
def test_every_preset_builds_and_trains_one_step(name: str) -> None:
    """In bf16 autocast, both routings; the paper's presets shrunk as in test_presets."""
    small = SHRINK if name.startswith("paper-") else ("model.d_model=64", "model.n_heads=4")
    cfg = load_config(name, ["model.context=32", *small])
    model = Transformer(cfg.model)
    x = torch.randint(0, cfg.model.vocab_size, (2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, x)
    out.total_loss.backward()
    assert torch.isfinite(out.total_loss)
    assert sum(p.grad is not None for p in model.parameters()) > 0
    with torch.no_grad():
        assert torch.isfinite(model(x, routing_mode="causal").logits).all()


def _added_variance(cfg, seeds=(0, 1, 2)) -> float:
    """Mean over weight draws of the residual variance the blocks add at init."""
    from xmodlm.diagnostics import added_variance

    vals = []
    for seed in seeds:
        torch.manual_seed(seed)
        model = Transformer(cfg)
        gen = torch.Generator().manual_seed(100 + seed)  # not the calibration batch
        vals.append(added_variance(model, torch.randint(0, cfg.vocab_size, (8, cfg.context), generator=gen)))
    return sum(vals) / len(vals)


def _flop_matched_dense(xmod_cfg):
    """The dense model of xmod's width whose training FLOPs per token are closest."""
    import dataclasses

    from xmodlm import flops

    target = flops.count(xmod_cfg).flops_train
    dense = dataclasses.replace(xmod_cfg, stride=1, capacity=1.0, layout="")
    return min(
        (dataclasses.replace(dense, n_layers=n) for n in range(1, 33)),
        key=lambda c: abs(flops.count(c).flops_train / target - 1),
    )


@pytest.mark.parametrize("stride", [2, 4, 8, 16])
@pytest.mark.parametrize("capacity", [0.125, 0.25, 0.5])
def test_variance_scaled_init_matches_flop_matched_dense(stride: int, capacity: float) -> None:
    """DESIGN 2: at init the blocks add the residual variance of the FLOP-matched dense
    model (within 10%), measured on other tokens and other weight draws than the
    rule's own calibration."""
    from xmodlm import flops

    ref = tiny_model_cfg(vocab_size=4096, n_layers=4, d_model=64, n_heads=4, context=64)
    xmod, _ = flops.flop_match(ref, stride, capacity)
    dense = _flop_matched_dense(xmod)
    ratio = _added_variance(xmod) / _added_variance(dense)
    assert abs(ratio - 1) <= 0.10, (stride, capacity, dense.n_layers, ratio)


def test_variance_scaled_init_is_neutral_at_full_capacity() -> None:
    """Every sparse block takes every token: gamma is 2 (gate exactly 1), no measurement."""
    model = Transformer(tiny_model_cfg(n_layers=4, layout="DsDs", capacity=1.0))
    assert [float(b.gamma.detach()) for b in model.blocks if isinstance(b, RoutedBlock)] == [2.0, 2.0]


def test_gate_calibration_leaves_global_rng_alone() -> None:
    """Building a calibrated model draws exactly what building a sigmoid-gated one does."""
    torch.manual_seed(0)
    Transformer(tiny_model_cfg(n_layers=8, stride=4, capacity=0.25))
    after_vs = torch.rand(1)
    torch.manual_seed(0)
    Transformer(tiny_model_cfg(n_layers=8, stride=4, capacity=0.25, gating="sigmoid"))
    assert torch.equal(after_vs, torch.rand(1))


def test_residual_rms_diagnostic_variance_scaled_vs_sigmoid() -> None:
    """The init diagnostic against the FLOP-matched dense model (S = 8, c = 1/8): same
    weights for every gate, so anchors agree up to the first sparse block; the
    variance-scaled stack adds about the dense model's residual variance (the rule
    targets dense at L_ae, a little deeper; one weight draw), while a gate left at
    gamma = 2 overshoots it about twofold and the raw logit gate (r ~ 0) adds
    far less."""
    from xmodlm.diagnostics import added_variance, compare_gates_at_init

    dense = tiny_model_cfg(d_model=64, n_layers=4, context=64)
    cfg, _ = flops.flop_match(dense, 8, 0.125, gating="variance_scaled", balance_coef=0.01)
    rms = compare_gates_at_init(cfg, gatings=("sigmoid", "variance_scaled", "logit"))
    assert len(rms["sigmoid"]) == len(rms["variance_scaled"]) == cfg.n_layers
    assert rms["sigmoid"][0] == pytest.approx(rms["variance_scaled"][0])  # block 0 is an anchor
    assert rms["variance_scaled"][-1] != pytest.approx(rms["logit"][-1], rel=1e-3)
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.context),
                           generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    v_dense = added_variance(Transformer(dense).eval(), tokens)

    def ratio(gating: str, gamma: float | None = None) -> float:
        torch.manual_seed(0)
        model = Transformer(dataclasses.replace(cfg, gating=gating)).eval()
        if gamma is not None:
            for block in model.blocks:
                if isinstance(block, RoutedBlock):
                    block.gamma.data.fill_(gamma)
        return added_variance(model, tokens) / v_dense

    assert 0.8 < ratio("variance_scaled") < 1.25
    assert ratio("variance_scaled", gamma=routing.NEUTRAL_GAMMA) > 1.6
    assert ratio("logit") < 0.7


@pytest.mark.parametrize("changes", [
    {}, {"n_layers": 8, "stride": 4, "capacity": 0.25, "causal_router": "predictor"},
])
def test_whole_model_traces_to_one_graph(changes: dict) -> None:
    """Dense and X-MoD training steps trace to one graph with no breaks (k is static),
    so whole-model ``torch.compile`` on a GPU compiles the routed blocks too."""
    torch._dynamo.reset()
    cfg = tiny_model_cfg(**changes)
    model = Transformer(cfg)
    x = _tokens(cfg)
    explained = torch._dynamo.explain(lambda a, b: model(a, b).total_loss)(x, x)
    assert explained.graph_break_count == 0, [str(r.reason)[:200] for r in explained.break_reasons]
    assert explained.graph_count == 1
