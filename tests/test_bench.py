"""The benchmark, the reference GPT, and the speed paths of the model (DESIGN 9, 11).

The fast paths (fused router/top-k/gather node, hand-written norm, rotary,
SwiGLU and cross-entropy backwards) are checked against the plain formulas they
replace, forward and backward; the routed block is checked compile-clean.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model_cfg
from xmodlm import flops
from xmodlm.bench import TARGETS, run_bench
from xmodlm.model import Transformer, routing
from xmodlm.model.blocks import RoutedBlock
from xmodlm.model.layers import RMSNorm, Rotary, SwiGLU, apply_rotary, cross_entropy_fp32
from xmodlm.reference_gpt import ReferenceGPT, reference_optimizer


def _dynamo_ok() -> bool:
    try:
        import torch._dynamo as dynamo
    except ImportError:
        return False
    return bool(dynamo.is_dynamo_supported())


needs_dynamo = pytest.mark.skipif(
    not _dynamo_ok(), reason="torch.compile / dynamo is not supported on this platform"
)


def _routed_block_loss(block: RoutedBlock, rope: Rotary, x: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(x.shape[1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, out = block(x, rope, pos, "topk")
    return y.float().square().mean() + out.aux["causal_bce"]


@needs_dynamo
@pytest.mark.parametrize("gating", ["logit", "variance_scaled"])
def test_routed_block_forward_backward_has_no_graph_breaks(gating: str) -> None:
    """Dynamo traces a RoutedBlock's forward as one graph, and with fullgraph=True
    (AOT autograd, no C++ codegen so the test stays fast) forward and backward run
    and equal eager."""
    import torch._dynamo as dynamo

    dynamo.reset()
    cfg = tiny_model_cfg(n_layers=4, stride=2, capacity=0.25, gating=gating)
    model = Transformer(cfg)
    block = model.blocks[1]
    assert isinstance(block, RoutedBlock)
    x = torch.randn(2, cfg.context, cfg.d_model)

    explain = dynamo.explain(_routed_block_loss)(block, model.rope, x)
    assert explain.graph_break_count == 0, explain.break_reasons
    assert explain.graph_count == 1

    x_eager = x.clone().requires_grad_()
    loss_eager = _routed_block_loss(block, model.rope, x_eager)
    grads_eager = torch.autograd.grad(loss_eager, [x_eager, *block.parameters()])
    compiled = torch.compile(_routed_block_loss, fullgraph=True, backend="aot_eager")
    x_comp = x.clone().requires_grad_()
    loss_comp = compiled(block, model.rope, x_comp)
    grads_comp = torch.autograd.grad(loss_comp, [x_comp, *block.parameters()])
    torch.testing.assert_close(loss_comp, loss_eager)
    for a, b in zip(grads_comp, grads_eager, strict=True):
        torch.testing.assert_close(a, b)


@needs_dynamo
def test_xmod_model_training_forward_has_no_graph_breaks() -> None:
    import torch._dynamo as dynamo

    dynamo.reset()
    cfg = tiny_model_cfg(n_layers=8, stride=4, capacity=0.25, balance_coef=0.01)
    model = Transformer(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.context))

    def loss(idx_BT: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(idx_BT, idx_BT).total_loss

    explain = dynamo.explain(loss)(idx)
    assert explain.graph_break_count == 0, explain.break_reasons


# --- fast paths equal the plain formulas ---------------------------------------------


def test_route_equals_router_topk_gather() -> None:
    """routing.route (one autograd node) = router_logits + topk_indices + gather_tokens."""
    cfg = tiny_model_cfg(stride=2, capacity=0.25)
    block = Transformer(cfg).blocks[1]
    assert isinstance(block, RoutedBlock)
    torch.nn.init.normal_(block.router.weight)
    x = torch.randn(3, cfg.context, cfg.d_model, requires_grad=True)
    k = flops.capacity_tokens(cfg.capacity, cfg.context)
    w = block.router.weight

    r, idx, xk = routing.route(x, w, k)
    r_ref = block.router_logits(x)
    idx_ref = routing.topk_indices(r_ref, k)
    xk_ref = routing.gather_tokens(x, idx_ref)
    assert torch.equal(idx, idx_ref)
    torch.testing.assert_close(r, r_ref, rtol=0, atol=0)
    torch.testing.assert_close(xk, xk_ref, rtol=0, atol=0)

    gr, gk = torch.randn_like(r), torch.randn_like(xk)
    grads = torch.autograd.grad((r * gr).sum() + (xk * gk).sum(), [x, w])
    grads_ref = torch.autograd.grad((r_ref * gr).sum() + (xk_ref * gk).sum(), [x, w])
    for a, b in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, b)


def test_rmsnorm_matches_autograd_and_out_dtype() -> None:
    """The hand-written backward equals autograd through the textbook formula; the
    bf16 output equals casting the fp32 one (what autocast would do)."""
    norm = RMSNorm(16)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 5, 16, requires_grad=True)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight
    y = norm(x)
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    gy = torch.randn_like(y)
    g = torch.autograd.grad((y * gy).sum(), [x, norm.weight])
    g_ref = torch.autograd.grad((ref * gy).sum(), [x, norm.weight])
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.equal(norm(x, torch.bfloat16), ref.to(torch.bfloat16))
    # a bf16 gradient arriving from a bf16 consumer is upcast, as autocast's would be
    y16 = norm(x, torch.bfloat16)
    (g16,) = torch.autograd.grad((y16.float() * gy).sum(), x)
    ref16 = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight).bfloat16()
    (g16_ref,) = torch.autograd.grad((ref16.float() * gy).sum(), x)
    torch.testing.assert_close(g16, g16_ref, rtol=1e-5, atol=1e-6)


def test_rotary_matches_textbook_and_qkv_path() -> None:
    B, T, H, K = 2, 7, 3, 8
    rope = Rotary(K, 16)
    x = torch.randn(B, T, H, K)
    pos = torch.arange(T)
    angles = pos[:, None].float() * (1.0 / 10000 ** (torch.arange(0, K, 2) / K))[None]
    c, s = angles.cos()[:, None], angles.sin()[:, None]
    x1, x2 = x.chunk(2, -1)
    textbook = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    torch.testing.assert_close(apply_rotary(x, *rope(pos)), textbook)

    from xmodlm.model.layers import Attention

    attn = Attention(H * K, H)
    inp = torch.randn(B, T, H * K, requires_grad=True)
    for table_pos in (pos, torch.stack([pos, pos.flip(0)])):  # (T) and gathered (B, T)
        cos, sin = rope(table_pos)
        q, k, v = attn.project_qkv(inp, cos, sin)
        qr, kr, vr = attn.qkv(inp).view(B, T, 3, H, K).unbind(2)
        refs = [apply_rotary(qr, cos, sin), apply_rotary(kr, cos, sin), vr]
        refs = [t.transpose(1, 2) for t in refs]
        weights = [torch.randn_like(t) for t in refs]
        out = sum((a * w).sum() for a, w in zip((q, k, v), weights, strict=True))
        ref = sum((a * w).sum() for a, w in zip(refs, weights, strict=True))
        for a, b in zip((q, k, v), refs, strict=True):
            assert torch.equal(a, b)
        (g,) = torch.autograd.grad(out, inp)
        (g_ref,) = torch.autograd.grad(ref, inp)
        torch.testing.assert_close(g, g_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_and_cross_entropy_match_autograd(dtype: torch.dtype) -> None:
    mlp = SwiGLU(16, 24)
    x = torch.randn(2, 5, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        y = mlp(x)
        gate, up = mlp.gate_up(x).chunk(2, -1)
        y_ref = mlp.down(F.silu(gate) * up)
    assert torch.equal(y, y_ref)
    gy = torch.randn_like(y)
    g = torch.autograd.grad((y * gy).sum(), [x, *mlp.parameters()])
    g_ref = torch.autograd.grad((y_ref * gy).sum(), [x, *mlp.parameters()])
    for a, b in zip(g, g_ref, strict=True):
        assert torch.equal(a, b)

    logits = (3 * torch.randn(12, 50)).to(dtype).requires_grad_()
    targets = torch.randint(0, 50, (12,))
    loss = cross_entropy_fp32(logits, targets)
    loss_ref = F.cross_entropy(logits.float(), targets)
    torch.testing.assert_close(loss, loss_ref)
    (g,) = torch.autograd.grad(loss, logits)
    (g_ref,) = torch.autograd.grad(loss_ref, logits)
    assert g.dtype == dtype
    tol = {"rtol": 1e-2, "atol": 1e-4} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(g, g_ref, **tol)


# --- the reference GPT and the bench ---------------------------------------------------


def test_reference_gpt_has_the_dense_shape_and_trains() -> None:
    cfg = tiny_model_cfg()
    ref = ReferenceGPT(cfg)
    assert sum(p.numel() for p in ref.parameters()) == flops.count(cfg).params_total
    opt = reference_optimizer(ref)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.context))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = ref(idx, idx)
    assert logits.shape == (2, cfg.context, cfg.vocab_size)
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)


def _positive(node: object) -> bool:
    if isinstance(node, dict):
        return all(v > 0 for k, v in node.items() if k in ("median", "min", "max"))
    return isinstance(node, (int, float)) and node > 0


def test_quick_bench_smoke() -> None:
    res = run_bench(quick=True, reps=2, include_law=False, include_decode=True)
    for key in (
        "matmul_peak_gflops", "train_step", "xmod_vs_dense_same_params",
        "xmod_vs_dense_flop_matched", "routing_overhead", "reference_gpt", "law_fit_s",
        "decode", "compile", "machine", "targets",
    ):
        assert key in res, key
    assert "bf16" not in res["matmul_peak_gflops"] or _positive(res["matmul_peak_gflops"]["bf16"])
    assert _positive(res["matmul_peak_gflops"]["fp32"])
    assert set(res["train_step"]) >= {"dense", "mod", "xmod_s4_c0125", "xmod_s8_c0125", "moe"}
    for name, fig in res["train_step"].items():
        assert _positive(fig["ms"]) and fig["tokens_per_s"] > 0, name
        assert 0 < fig["mfu"]["median"] < 1.5, name
        assert fig["ms"]["min"] <= fig["ms"]["median"] <= fig["ms"]["max"]
    assert res["train_step"]["moe"]["layout"] == "EEEE"
    assert res["train_step"]["xmod_s8_c0125"]["layout"].startswith("Dsssssss")
    same = res["xmod_vs_dense_same_params"]
    assert _positive(same["speedup_measured"]) and same["speedup_ideal"] > 2
    assert same["params_total"]["dense"] == pytest.approx(same["params_total"]["xmod"], rel=0.01)
    assert _positive(res["xmod_vs_dense_flop_matched"]["time_ratio"])
    assert _positive(res["reference_gpt"]["dense_vs_reference"])
    assert 0 < res["routing_overhead"]["share"] < 1
    dec = res["decode"]
    assert dec["dense"]["tokens_per_s"] > 0 and dec["xmod"]["tokens_per_s"] > 0
    assert dec["xmod"]["kv_bytes_used"] < dec["dense"]["kv_bytes_used"]
    assert "skipped" in res["law_fit_s"] and "skipped" in res["compile"]
    assert set(TARGETS) <= set(res["targets"])
    import json

    json.dumps(res)  # one JSON object


def test_bench_configs_are_what_the_bench_says() -> None:
    from xmodlm.bench import bench_configs

    cfgs = bench_configs()
    dense = cfgs["dense"]
    assert (dense.d_model, dense.n_layers, dense.context) == (512, 4, 1024)
    assert cfgs["xmod_s4_c0125"].block_layout == "DsssDsssDsss"
    assert cfgs["dense_same_params"] == dataclasses.replace(dense, n_layers=12)
    assert cfgs["moe"].expert_dim == dense.ffn_dim // 2
    assert cfgs["mod"].gating == "logit" and cfgs["mod"].stride == 2
    for name in ("mod", "xmod_s8_c0125"):
        gap = flops.count(cfgs[name]).flops_train / flops.count(dense).flops_train - 1
        assert abs(gap) < 0.15, name


def test_auto_dtype_is_bf16_only_where_the_cpu_multiplies_it() -> None:
    from xmodlm import hardware

    zen4 = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni\n"
    zen3 = "processor\t: 0\nflags\t\t: fpu sse avx2 fma\n"
    graviton3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
    assert hardware.native_bf16_in_cpuinfo(zen4)
    assert not hardware.native_bf16_in_cpuinfo(zen3)
    assert hardware.native_bf16_in_cpuinfo(graviton3)
    assert not hardware.native_bf16_in_cpuinfo("")
    cpu = torch.device("cpu")
    assert hardware.resolve_dtype("fp32", cpu) == "fp32"
    assert hardware.resolve_dtype("bf16", cpu) == "bf16"
    expected = "bf16" if hardware.cpu_has_native_bf16() else "fp32"
    assert hardware.resolve_dtype("auto", cpu) == expected
