"""Grouped-query attention, a free head dim and QK-norm (DESIGN 6)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model_cfg
from xmodlm.errors import UserError
from xmodlm.flops import kv_bytes_formula
from xmodlm.model import Transformer
from xmodlm.model.kv_cache import KVCache
from xmodlm.model.layers import Attention, Rotary

GQA = {"n_kv_heads": 2, "head_dim": 12, "qk_norm": True}  # 4 query heads of 12 on d = 32


def _rope(head_dim: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    return Rotary(head_dim, T)(torch.arange(T))


def test_explicit_multi_head_equals_the_default() -> None:
    """n_kv_heads = n_heads at head dim d / n_heads is the multi-head model: the same
    parameters (names and shapes), drawn in the same order, the same logits."""
    torch.manual_seed(0)
    plain = Transformer(tiny_model_cfg())
    torch.manual_seed(0)
    spelled = Transformer(tiny_model_cfg(n_kv_heads=4, head_dim=8))
    a, b = plain.state_dict(), spelled.state_dict()
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert a["blocks.0.block.attn.qkv.weight"].shape == (3 * 32, 32)
    x = torch.randint(0, 97, (2, 32))
    assert torch.equal(plain(x).logits, spelled(x).logits)


def test_fused_multi_head_path_equals_the_split_path() -> None:
    """The one-node rotary of multi-head attention and the general path (grouped
    heads, QK-norm) compute the same queries, keys and values, bit for bit, and the
    same gradients."""
    attn = Attention(32, 4)
    cos, sin = _rope(8, 16)
    x = torch.randn(2, 16, 32, requires_grad=True)
    fused = attn.project_qkv(x, cos, sin)
    split = attn.split_heads(attn.qkv(x), cos, sin)
    for f, s in zip(fused, split, strict=True):
        assert f.shape == s.shape == (2, 4, 16, 8) and torch.equal(f, s)
    w = [torch.randn_like(t) for t in fused]

    def grad(outs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.autograd.grad(sum((t * wi).sum() for t, wi in zip(outs, w, strict=True)), x)[0]

    g_fused, g_split = grad(fused), grad(split)
    torch.testing.assert_close(g_fused, g_split, rtol=1e-6, atol=1e-6)


def test_grouped_query_equals_multi_head_with_shared_key_value_heads() -> None:
    """Query head h reads key/value head h // (H / G): grouped-query attention is
    multi-head attention whose key and value weights repeat over each group."""
    H, G, K, d = 4, 2, 12, 32
    gqa, mha = Attention(d, H, G, K), Attention(d, H, H, K)
    q_w, k_w, v_w = gqa.qkv.weight.detach().split((H * K, G * K, G * K))

    def repeat(w: torch.Tensor) -> torch.Tensor:
        return w.view(G, K, d).repeat_interleave(H // G, 0).reshape(H * K, d)

    with torch.no_grad():
        mha.qkv.weight.copy_(torch.cat((q_w, repeat(k_w), repeat(v_w))))
        mha.proj.weight.copy_(gqa.proj.weight)
    cos, sin = _rope(K, 16)
    x = torch.randn(2, 16, d)
    mask = torch.rand(2, 16, 16) > 0.5
    mask |= torch.eye(16, dtype=torch.bool)
    for m in (None, mask):
        torch.testing.assert_close(gqa(x, cos, sin, m), mha(x, cos, sin, m), rtol=1e-5, atol=1e-6)


def test_qk_norm_makes_attention_blind_to_query_and_key_scale() -> None:
    """Each query and key head is RMS-normalised before rotary, so scaling the query
    and key projections leaves the output unchanged (without it, it sharpens)."""
    cos, sin = _rope(12, 16)
    x = torch.randn(2, 16, 32)
    for qk_norm in (True, False):
        attn = Attention(32, 4, 2, 12, qk_norm=qk_norm)
        before = attn(x, cos, sin)
        with torch.no_grad():
            attn.qkv.weight[: (4 + 2) * 12] *= 5.0
        after = attn(x, cos, sin)
        assert torch.allclose(before, after, rtol=1e-4, atol=1e-5) == qk_norm


def test_cache_holds_key_value_heads_only() -> None:
    """The point of grouped queries at inference: the cache is n_kv_heads / n_heads
    of multi-head attention's, and its analytic size says so."""
    cfg = tiny_model_cfg(n_kv_heads=2, head_dim=12)
    cache = KVCache(cfg, batch=2, max_len=8)
    assert cache.blocks[0].k.shape == (2, 2, 8, 12)
    assert cache.blocks[0].token_bytes() == 2 * 2 * 12 * 4
    assert kv_bytes_formula(cfg, 10) == 4 * 10 * 2 * 2 * 12 * 4
    mha = tiny_model_cfg(head_dim=12)
    assert kv_bytes_formula(cfg, 10) == kv_bytes_formula(mha, 10) / 2


def test_grouped_model_trains_and_traces_to_one_graph() -> None:
    """A grouped-query X-MoD with QK-norm takes a training step with no graph break."""
    torch._dynamo.reset()
    cfg = tiny_model_cfg(n_layers=8, stride=4, capacity=0.25, **GQA)
    model = Transformer(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.context))
    model(x, x).total_loss.backward()
    assert model.blocks[0].block.attn.q_norm.weight.grad is not None
    explained = torch._dynamo.explain(lambda a, b: model(a, b).total_loss)(x, x)
    assert explained.graph_break_count == 0, [str(r.reason)[:200] for r in explained.break_reasons]


@pytest.mark.parametrize(("changes", "needle"), [
    ({"n_kv_heads": 3}, "n_kv_heads"),
    ({"n_kv_heads": 8}, "n_kv_heads"),
    ({"n_kv_heads": -1}, "n_kv_heads"),
    ({"head_dim": 7}, "head_dim=7"),
    ({"d_model": 30}, "divisible"),
])
def test_bad_head_shapes_are_user_errors(changes: dict, needle: str) -> None:
    with pytest.raises(UserError, match=needle):
        tiny_model_cfg(**changes)


def test_head_dim_frees_width_from_heads() -> None:
    """With head_dim set, d_model need not divide by n_heads."""
    cfg = tiny_model_cfg(d_model=30, head_dim=8, n_kv_heads=1)
    assert (cfg.attn_head_dim, cfg.attn_kv_heads) == (8, 1)
    model = Transformer(cfg)
    x = torch.randint(0, cfg.vocab_size, (1, 8))
    assert model(x).logits.shape == (1, 8, cfg.vocab_size)
