"""The benchmark, the reference models, and the speed paths of the model (DESIGN 9, 11).

The fast paths (fused router/top-k/gather node, hand-written norm, rotary,
SwiGLU and cross-entropy backwards) are checked against the plain formulas they
replace, forward and backward; the routed block is checked compile-clean.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model_cfg
from xmodlm import flops
from xmodlm.bench import (
    SIZES,
    TARGETS,
    GPT2Reference,
    bench_configs,
    family_configs,
    gpt2_counts,
    parse_sizes,
    parse_threads,
    run_bench,
)
from xmodlm.bench.reference_gpt import ReferenceGPT, reference_optimizer
from xmodlm.bench.sizes import size_named
from xmodlm.bench.targets import evaluate, main_threads
from xmodlm.errors import UserError
from xmodlm.model import Transformer, routing
from xmodlm.model.blocks import RoutedBlock
from xmodlm.model.layers import RMSNorm, Rotary, SwiGLU, apply_rotary, cross_entropy_fp32


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
    r_ref = block.router.logits(x)
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
    # a target's logit 200 below the row maximum: p underflows, the loss must not
    far = torch.zeros(2, 50, dtype=dtype)
    far[:, 7] = 200.0
    far.requires_grad_()
    loss = cross_entropy_fp32(far, torch.tensor([3, 7]))
    torch.testing.assert_close(loss, F.cross_entropy(far.float(), torch.tensor([3, 7])))
    assert 99.0 < loss.item() < 101.0
    # walking the graph twice (retain_graph) gives the same gradient twice
    loss = cross_entropy_fp32(logits, targets)
    (g1,) = torch.autograd.grad(loss, logits, retain_graph=True)
    (g2,) = torch.autograd.grad(loss, logits)
    assert torch.equal(g1, g2)


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


FAMILY = ("dense", "mod", "xmod_s4_c0125", "xmod_s8_c0125", "moe", "dense_same_params")
MODELS = (*FAMILY, "gpt2", "reference_gpt")


@pytest.fixture(scope="module")
def quick_result() -> dict:
    """One smoke run shared by the tests below: two sizes, one thread, two rounds."""
    torch.set_num_threads(1)
    return run_bench(quick=True, reps=2, include_law=False, sizes="bench,w128-t128", threads=[1])


def test_quick_bench_has_every_size_model_and_comparison(quick_result: dict) -> None:
    res = quick_result
    assert list(res["sizes"]) == ["bench", "w128-t128"] and res["threads"] == [1]
    for key in ("routing_overhead", "width_scan", "law_fit_s", "targets", "machine",
                "sweep_worker_throughput"):
        assert key in res, key
    for name, section in res["sizes"].items():
        assert set(section["models"]) == set(MODELS), name
        assert "skipped" in section["compile"]  # quick mode: eager only
        sec = section["threads"]["1"]
        assert sec["reps"] == 2
        assert _positive(sec["matmul_peak_gflops"]["fp32"])
        assert set(sec["train_step"]) == set(MODELS)
        for model, fig in sec["train_step"].items():
            assert fig["faster"] == "eager" and fig["best"] == fig["eager"], model
            assert _positive(fig["eager"]["ms"]) and fig["eager"]["tokens_per_s"] > 0, model
            assert 0 < fig["eager"]["mfu"]["median"] < 1.5, model
            ms = fig["eager"]["ms"]
            assert ms["min"] <= ms["median"] <= ms["max"]
        assert set(sec["vs_dense"]) == set(FAMILY) - {"dense"}
        for model, cmp in sec["vs_dense"].items():
            for mode in ("eager", "best"):
                assert _positive(cmp[mode]["time_ratio"]), (name, model)
                assert _positive(cmp[mode]["time_per_flop_ratio"]), (name, model)
                assert cmp[mode]["time_per_flop_ratio"]["median"] == pytest.approx(
                    cmp[mode]["time_ratio"]["median"] / cmp[mode]["flop_ratio"])
            assert abs(cmp["best"]["flop_ratio"] - 1) < 0.15 or model == "dense_same_params"
        assert _positive(sec["dense_vs_gpt2"]["best"]["time_ratio"])
        assert _positive(sec["dense_vs_reference"]["best"]["time_ratio"])
        parts = section["dense_vs_gpt2_parts"]
        assert set(parts["ours"]["parts_ms"]) == {"positions", "norms", "mlp_activation", "loss"}
        assert set(parts["gpt2"]["parts_ms"]) == {"norms", "mlp_activation", "loss"}
        for kind in ("ours", "gpt2"):  # every part of a step is less than the step
            assert 0 < sum(parts[kind]["parts_ms"].values()) < parts[kind]["step_ms"]
        assert parts["ours_minus_gpt2_ms"]["positions"] == parts["ours"]["parts_ms"]["positions"]
        same = sec["xmod_vs_dense_same_params"]
        assert _positive(same["speedup_measured"]) and same["speedup_ideal"] > 2
    bench = res["sizes"]["bench"]
    assert bench["shape"]["d_model"] == 128 and bench["shape"]["context"] == 256  # shrunk
    assert res["sizes"]["w128-t128"]["shape"] == {
        "d_model": 128, "n_heads": 4, "context": 128, "vocab_size": 4096, "batch": 16,
        "tokens_per_step": 2048,
    }
    assert bench["models"]["moe"]["layout"] == "EEEE"
    assert bench["models"]["xmod_s8_c0125"]["layout"].startswith("Dsssssss")
    assert abs(bench["models"]["gpt2"]["flops_vs_dense"] - 1) < 0.05
    json.dumps(res)  # one JSON object


def test_quick_bench_single_size_sections_and_targets(quick_result: dict) -> None:
    res = quick_result
    assert 0.05 < res["peak_rss_gb"] < 64  # this process's peak resident memory, in GB
    assert res["routing_overhead"]["size"] == "bench"
    assert 0 < res["routing_overhead"]["share"] < 1
    for name in res["sizes"]:  # quick: decode at every size
        dec = res["sizes"][name]["threads"]["1"]["decode"]
        for model in ("dense", "xmod_s4_c0125", "xmod_s8_c0125"):
            for batch in ("batch1", "batch8"):
                assert dec["models"][model][batch]["tokens_per_s"] > 0, (name, model)
                assert dec["models"][model][batch]["prefill_tokens_per_s"] > 0, (name, model)
        for xmod in ("xmod_s4_c0125", "xmod_s8_c0125"):
            cmp = dec[xmod]
            partner = cmp["vs_dense_same_active"]["model"]
            assert partner in dec["models"] and partner.startswith("dense_")
            depth = dec["models"][partner]["active_depth"]
            assert depth == round(dec["models"][xmod]["active_depth"])
            assert _positive(cmp["vs_dense"]["batch1"]["tokens_per_s"])
            assert 0.5 < cmp["kv_over_ideal"] < 1.5, (name, xmod)  # calibrated: about c
    scan = res["width_scan"]
    assert list(scan["widths"]) == ["w128"] and scan["threads"] == 1
    for xmod in ("xmod_s4_c0125", "xmod_s8_c0125"):
        assert _positive(scan["widths"]["w128"][xmod]["best"]["time_ratio"])
    assert "skipped" in res["law_fit_s"]
    assert res["sweep_worker_throughput"]["tokens_per_s"] > 0
    pair = res["paper_pair"]
    assert pair["layouts"]["dense"].count("D") == len(pair["layouts"]["dense"])
    assert pair["layouts"]["xmod_a1k8"].count("D") < len(pair["layouts"]["xmod_a1k8"])
    assert set(pair["layouts"]["moe_8x64"]) == {"E"}
    assert 1.0 < pair["moe_vs_dense"]["flop_ratio"] < 1.1  # dense FLOPs plus the routers
    assert pair["moe_vs_dense"]["params_ratio"] > 3
    assert _positive(pair["xmod_vs_moe"]["time_ratio"])
    assert 0 < pair["xmod_vs_dense"]["flop_ratio"] < 1
    assert _positive(pair["xmod_vs_dense"]["time_per_flop_ratio"])
    targets = res["targets"]
    assert {t.name for t in TARGETS} <= set(targets)
    for t in TARGETS:
        row = targets[t.name]
        assert row["pass"] is None and row[t.kind] == t.bound  # quick: no pass/miss
        # whole-run figures: the law fit is skipped in quick mode, the paper pair is not
        measured = t.size in res["sizes"] if t.size else t.figure.startswith("paper_pair.")
        assert (row["value"] is not None) == measured, t.name


def test_targets_judge_at_the_main_thread_count() -> None:
    def section(ratio: float) -> dict:
        return {"decode": {"xmod_s4_c0125": {"vs_dense_same_active": {
            "batch1": {"tokens_per_s": ratio}}}}}

    result = {"quick": False, "law_fit_s": {"seconds": 70.0},
              "sizes": {"w128-t128": {"threads": {"1": section(0.8), "2": section(0.95)}}},
              "width_scan": {"widths": {"w512": {"xmod_s8_c0125": {"best": {
                  "time_ratio": {"median": 1.04}}}}}}}
    got = evaluate(result, threads=2)
    row = got["xmod_s4_decode_vs_same_active_dense@w128-t128"]
    assert (row["value"], row["pass"], row["threads"]) == (0.95, True, 2)
    assert row["other_threads"] == {"1": {"value": 0.8, "pass": False}}
    assert got["xmod_s4_decode_vs_same_active_dense@bench"]["value"] is None
    assert got["xmod_s4_decode_vs_same_active_dense@bench"]["pass"] is None
    assert got["xmod_s8_vs_dense@w512-t512"]["pass"] is True
    assert got["xmod_s4_vs_dense@w512-t512"]["value"] is None
    assert got["law_fit_s"]["pass"] is False
    assert evaluate({**result, "quick": True}, threads=2)["law_fit_s"]["pass"] is None
    assert main_threads([1, 2], default=2) == 2 and main_threads([1], default=2) == 1


def test_bench_step_is_the_trainers_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench times xmodlm.train.trainer.train_step, not a copy of it."""
    from xmodlm.bench import step as bench_step
    from xmodlm.train import trainer

    calls = []

    def counting(*args: object, **kwargs: object) -> dict:
        calls.append(kwargs["grad_clip"])
        return trainer.train_step(*args, **kwargs)

    monkeypatch.setattr(bench_step, "train_step", counting)
    cfg = tiny_model_cfg()
    for kind in bench_step.KINDS:
        case = bench_step.make_case(kind, cfg, 2, torch.device("cpu"), kind)
        before = [p.detach().clone() for p in case.model.parameters()]
        record = case.step()
        assert math.isfinite(record["loss"]) and record["grad_norm"] > 0
        after = list(case.model.parameters())
        assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)), kind
    assert calls == [1.0] * len(bench_step.KINDS)


def test_compiled_cases_share_the_eager_model_and_run_eager_outside_their_step() -> None:
    """A model's modes share one copy of its weights, optimiser and batch (the bench's
    memory: three copies of the bench size's models were 7 GB), and its per-block
    compile is switched on only inside the compiled case's step: the eager case, run
    after it, runs eager."""
    from xmodlm.bench import step as bench_step
    from xmodlm.bench.compile import CompiledBlocks

    cfg = tiny_model_cfg()
    for kind in ("ours", "gpt2"):
        eager = bench_step.make_case(kind, cfg, 2, torch.device("cpu"), kind)
        for mode in ("compiled", "compiled_model"):
            case = bench_step.make_case(kind, cfg, 2, torch.device("cpu"), kind, mode=mode,
                                        base=eager)
            assert case.model is eager.model and case.opt is eager.opt, (kind, mode)
            assert case.batch is eager.batch and case.mode == mode
    switch = CompiledBlocks(eager.model)
    blocks = list(eager.model.blocks)
    assert switch.mode == "compiled" and len(switch.compiled) == len(blocks)
    with switch.active():
        assert all(b._compiled_call_impl is not None for b in blocks)
    assert all(b._compiled_call_impl is None for b in blocks)
    with pytest.raises(RuntimeError), switch.active():
        raise RuntimeError  # left by an exception: still switched off
    assert all(b._compiled_call_impl is None for b in blocks)


def test_gpt2_reference_is_gpt2_shaped() -> None:
    """Tied embedding and head, learned positions, LayerNorm, 4x GELU MLP; its analytic
    counts match the module and its FLOPs are within a few % of our dense model's."""
    cfg = tiny_model_cfg()
    model = GPT2Reference(cfg)
    assert model.head.weight is model.tok_embed.weight
    assert model.pos_embed.weight.shape == (cfg.context, cfg.d_model)
    assert isinstance(model.blocks[0].ln1, torch.nn.LayerNorm)
    assert model.blocks[0].fc.out_features == 4 * cfg.d_model
    assert sum(p.numel() for p in model.parameters()) == gpt2_counts(cfg).params_total
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.context))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, cfg.context, cfg.vocab_size)
    loss.backward()
    assert model.pos_embed.weight.grad is not None and model.pos_embed.weight.grad.abs().sum() > 0
    # positions matter: the same token at two positions gets two different outputs
    same = torch.full((1, 8), 5)
    out, _ = model(same)
    assert not torch.allclose(out[0, 0], out[0, 7])
    for name in SIZES:
        dense = size_named(name).dense()
        ours, gpt2 = flops.count(dense).flops_train, gpt2_counts(dense).flops_train
        assert abs(gpt2 / ours - 1) < 0.05, name


def test_named_sizes_resolve() -> None:
    shapes = {name: size_named(name).dense() for name in SIZES}
    got = {n: (c.d_model, c.n_heads, c.context, c.vocab_size) for n, c in shapes.items()}
    assert got == {
        "bench": (512, 8, 1024, 4096),
        "w128-t128": (128, 4, 128, 4096),
        "w128-t512": (128, 4, 512, 4096),
        "w256-t256": (256, 4, 256, 4096),
    }
    quick = size_named("bench", quick=True)
    assert quick.dense().d_model == 128 and quick.timing.budget_s is None
    assert parse_sizes(None) == list(SIZES) and parse_sizes(None, quick=True) == ["bench"]
    assert parse_sizes("w128-t128, bench,w128-t128") == ["w128-t128", "bench"]
    assert parse_sizes("all") == list(SIZES)
    assert parse_threads("1,2", default=4) == [1, 2] and parse_threads(None, default=4) == [4]
    for bad in ("huge", ",", "bench,w64"):
        with pytest.raises(UserError):
            parse_sizes(bad)
    for bad_threads in ("0", "a", "1,-2", ""):
        with pytest.raises(UserError):
            parse_threads(bad_threads, default=1)


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [("--sizes", "huge", "unknown size 'huge'"), ("--sizes", ",", "--sizes"),
     ("--threads", "0", "--threads"), ("--threads", "two", "--threads"),
     ("--compile-modes", "jit", "compile modes jit"), ("--compile-modes", ",", "(none)")],
)
def test_bad_sizes_and_threads_exit_2_with_one_line(
    flag: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from xmodlm.cli import main

    assert main(["bench", "--quick", "--json", flag, value]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and says in captured.err, captured.err


def test_bench_configs_are_what_the_bench_says() -> None:
    cfgs = bench_configs()
    dense = cfgs["dense"]
    assert (dense.d_model, dense.n_layers, dense.context) == (512, 4, 1024)
    assert cfgs["xmod_s4_c0125"].block_layout == "DsssDsssDsss"
    assert cfgs["dense_same_params"] == dataclasses.replace(dense, n_layers=12)
    assert cfgs["moe"].expert_dim == dense.ffn_dim // 2
    assert cfgs["mod"].gating == "logit" and cfgs["mod"].stride == 2
    for name in SIZES:
        cfgs = family_configs(size_named(name).dense())
        for fam in ("mod", "xmod_s4_c0125", "xmod_s8_c0125", "moe"):
            gap = flops.count(cfgs[fam]).flops_train / flops.count(cfgs["dense"]).flops_train - 1
            assert abs(gap) < 0.15, (name, fam)


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


def test_faster_mode_picks_the_fastest_of_three_and_eager_on_ties() -> None:
    from xmodlm.bench.compile import faster_mode, parse_modes

    assert faster_mode({"eager": 3.0, "compiled": 2.0, "compiled_model": 1.5}) == "compiled_model"
    assert faster_mode({"eager": 3.0, "compiled": 2.0}) == "compiled"
    assert faster_mode({"eager": 2.0, "compiled": 2.0, "compiled_model": 2.0}) == "eager"
    assert parse_modes("compiled_model, compiled") == ("compiled", "compiled_model")
    assert parse_modes(None) == ("compiled", "compiled_model")


def test_law_fit_is_timed_in_a_fresh_process() -> None:
    """The law-fit figure comes from a child process (what ``xmod law fit`` runs in),
    so what the bench ran before cannot slow it; the child's timing comes back."""
    from xmodlm.bench.run import QUICK_LAW_FIT, law_fit

    got = law_fit(quick=True)
    assert got["process"] == "fresh" and got["n_boot"] == QUICK_LAW_FIT["n_boot"]
    assert 0 < got["seconds"] < 600


def test_bench_lets_one_process_compile_every_model() -> None:
    """One size compiles the same forward for six models at each thread count; with
    dynamo's default limit of 8 variants some fell back to eager mid-bench."""
    import torch._dynamo as dynamo

    from xmodlm.bench import compile as bench_compile

    before = dynamo.config.recompile_limit
    try:
        dynamo.config.recompile_limit = 8
        bench_compile.reset()
        assert dynamo.config.recompile_limit >= bench_compile.RECOMPILE_LIMIT >= 2 * 6
    finally:
        dynamo.config.recompile_limit = before


def test_bench_defaults_to_the_quick_set_and_talks_on_stderr(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --sizes the bench is the smoke set (the full one takes 30-60 minutes);
    naming sizes asks for the full bench; progress goes to stderr unless --quiet,
    --json or not (stdout carries only the JSON)."""
    import xmodlm.bench
    from xmodlm.cli import main

    seen: list[dict] = []
    monkeypatch.setattr(xmodlm.bench, "run_bench", lambda **kw: seen.append(kw) or {"ok": 1})
    assert main(["bench", "--json"]) == 0
    assert seen[-1]["quick"] and seen[-1]["progress"] and seen[-1]["sizes"] is None
    assert "--sizes all" in capsys.readouterr().err
    assert main(["bench", "--sizes", "all", "--json", "--quiet"]) == 0
    assert not seen[-1]["quick"] and not seen[-1]["progress"] and seen[-1]["sizes"] == "all"
    out = capsys.readouterr()
    assert out.err == "" and '"ok": 1' in out.out
