"""Generation with the sparse KV cache (DESIGN 3: causal routing at inference)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model_cfg
from xmodlm.bench.decode import calibrate_untrained_, decode_benchmark
from xmodlm.config import Config
from xmodlm.errors import UserError
from xmodlm.export import generate_from_run
from xmodlm.flops import kv_bytes_formula
from xmodlm.model import Transformer, active_depth
from xmodlm.model.blocks import RoutedBlock
from xmodlm.model.generate import (
    Decoder,
    decode_logits,
    generate,
    sample_next,
)
from xmodlm.model.kv_cache import KVCache

FAMILIES = {
    "dense": {},
    "mod": dict(stride=2, capacity=0.25, gating="logit"),
    "xmod_bce": dict(n_layers=8, stride=4, capacity=0.25, gating="variance_scaled"),
    "xmod_predictor": dict(
        n_layers=8, stride=4, capacity=0.25, gating="variance_scaled", causal_router="predictor"
    ),
    "moe": dict(mlp="moe", n_experts=4, moe_top_k=2),
    # thresholds calibrated away from 0 (the half rule): decoding must use them too
    "xmod_calibrated": dict(n_layers=8, stride=4, capacity=0.25, calibrate=True),
    # the paper's construction: prefix, closed stages, a strong token-choice bias
    "paper_a1k4": dict(active_layers=5, dense_prefix=1, sparsity=4, anchor_stride=1,
                       token_bias_tau=2.0, calibrate=True),
    "paper_a1k4_predictor": dict(active_layers=5, dense_prefix=1, sparsity=4, anchor_stride=1,
                                 token_bias_tau=2.0, causal_router="predictor"),
    "paper_mod_ffn_gate": dict(active_layers=6, dense_prefix=1, sparsity=4, anchor_stride=0.25,
                               gating="sigmoid", gate_scope="ffn", balance="none"),
    "paper_no_anchors": dict(active_layers=4, dense_prefix=1, sparsity=4, anchor_stride=1,
                             anchors=False, token_bias_tau=2.0),
    # grouped queries (4 over 2 key/value heads), head dim 12 on width 32, QK-norm
    "dense_gqa": dict(n_kv_heads=2, head_dim=12, qk_norm=True),
    "xmod_gqa": dict(n_layers=8, stride=4, capacity=0.25, n_kv_heads=2, head_dim=12, qk_norm=True),
}


@pytest.fixture(autouse=True)
def _one_thread():  # noqa: ANN202
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine
    OpenMP barriers make them 10-60x slower; run this module single-threaded."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(**changes: object) -> Transformer:
    """A tiny model with O(1) logits and routers whose causal decisions are mixed
    (``calibrate``: thresholds calibrated on random tokens)."""
    calibrate = changes.pop("calibrate", False)
    model = Transformer(tiny_model_cfg(init_std=0.2, **changes)).eval()
    for block in model.blocks:
        if isinstance(block, RoutedBlock):
            torch.nn.init.normal_(block.router.weight, std=1.0)
            if block.router.head is not None:
                for layer in block.router.head:
                    if isinstance(layer, torch.nn.Linear):
                        torch.nn.init.normal_(layer.weight, std=1.0)
    if calibrate:
        gen = torch.Generator().manual_seed(7)
        thresholds = model.calibrate_thresholds_(
            torch.randint(0, model.cfg.vocab_size, (16, model.cfg.context), generator=gen)
        )
        assert min(abs(t) for t in thresholds) > 0.1, "thresholds should differ from 0"
    return model


def _causal_selections(model: Transformer, idx_BT: torch.Tensor) -> list[torch.Tensor]:
    """Per sparse block, the (B, T) tokens ``forward(mode="causal")`` processes."""
    T = idx_BT.shape[1]
    pos = torch.arange(T)
    x = model.embed(idx_BT)
    sel = []
    with torch.no_grad():
        for out in model.run_blocks(x, pos, "causal", model.rope(pos))[1]:
            if out.processed_BT is not None:
                sel.append(out.processed_BT)
    return sel


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cache_decoding_equals_causal_forward(family: str) -> None:
    model = _model(**FAMILIES[family])
    cfg = model.cfg
    B, T = 3, cfg.context
    idx = torch.randint(0, cfg.vocab_size, (B, T))
    with torch.no_grad():
        ref = model(idx, routing_mode="causal").logits
    for prefill in (1, 13, T):
        got, cache = decode_logits(model, idx, prefill=prefill, return_cache=True)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    # the decisions are non-trivial, and the cache holds exactly the routed tokens
    sel = _causal_selections(model, idx)
    assert len(sel) == cfg.block_layout.count("s")
    sparse_caches = [c for c in cache.blocks if c.sparse]
    for s_BT, c in zip(sel, sparse_caches, strict=True):
        assert 0 < int(s_BT.sum()) < B * T, "routing should be mixed for this test"
        for b in range(B):
            assert c.positions(b) == torch.nonzero(s_BT[b]).flatten().tolist()
    # used bytes follow the analytic formula at the observed per-block counts
    counts = cache.routed_tokens()
    fractions = [n / (B * T) for n in counts]
    assert cache.bytes_used() == kv_bytes_formula(cfg, B * T, fractions)
    assert cache.bytes_used() <= cache.bytes_allocated()


@pytest.mark.parametrize("family", ["dense", "xmod_bce", "xmod_predictor", "xmod_calibrated", "moe"])
def test_greedy_generation_follows_forward_argmax(family: str) -> None:
    model = _model(**FAMILIES[family])
    prompt = torch.randint(0, model.cfg.vocab_size, (9,)).tolist()
    (new,) = generate(model, [prompt], max_new_tokens=12, temperature=0)
    assert len(new) == 12
    seq = torch.tensor([prompt + new])
    with torch.no_grad():
        logits = model(seq, routing_mode="causal").logits[0]
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == new


@pytest.mark.parametrize("family", ["mod", "xmod_bce", "xmod_predictor", "moe"])
def test_batched_ragged_prompts_equal_each_alone(family: str) -> None:
    model = _model(**FAMILIES[family])
    V = model.cfg.vocab_size
    prompts = [torch.randint(0, V, (n,)).tolist() for n in (3, 17, 8, 1)]
    batched = generate(model, prompts, max_new_tokens=10, temperature=0)
    alone = [generate(model, [p], max_new_tokens=10, temperature=0)[0] for p in prompts]
    assert batched == alone
    # a stop token ends each sequence on its own (here: the 3rd token of sequence 1)
    eot = batched[1][2]
    stopped = generate(model, prompts, max_new_tokens=10, temperature=0, eot_id=eot)
    for full, out in zip(batched, stopped, strict=True):
        cut = full.index(eot) + 1 if eot in full else len(full)
        assert out == full[:cut]


def test_ragged_prefill_logits_equal_each_alone() -> None:
    """Padding is never attended, routed or cached: prefill logits match per prompt."""
    model = _model(**FAMILIES["xmod_bce"])
    V = model.cfg.vocab_size
    prompts = [torch.randint(0, V, (n,)).tolist() for n in (5, 20, 12)]
    dec = Decoder(model, len(prompts), 24)
    last = dec.prefill(prompts)
    for b, p in enumerate(prompts):
        with torch.no_grad():
            ref = model(torch.tensor([p]), routing_mode="causal").logits[0, -1]
        torch.testing.assert_close(last[b], ref, rtol=1e-4, atol=1e-4)
    anchors = [c for c in dec.cache.blocks if not c.sparse]
    assert all(c.lengths == [5, 20, 12] for c in anchors)


def test_generation_stops_at_context() -> None:
    model = _model(**FAMILIES["xmod_bce"])
    C = model.cfg.context
    prompts = [[1] * (C - 2), [2, 3]]
    out = generate(model, prompts, max_new_tokens=10, temperature=0)
    assert [len(o) for o in out] == [2, 10]


def test_seed_reproducible_and_filters() -> None:
    model = _model(**FAMILIES["xmod_bce"])
    prompts = [[5, 6, 7], [8]]
    a = generate(model, prompts, 16, temperature=1.0, seed=1)
    b = generate(model, prompts, 16, temperature=1.0, seed=1)
    c = generate(model, prompts, 16, temperature=1.0, seed=2)
    assert a == b
    assert a != c
    greedy = generate(model, prompts, 8, temperature=0)
    assert generate(model, prompts, 8, temperature=0.7, top_k=1, seed=3) == greedy
    assert generate(model, prompts, 8, temperature=0.7, top_p=1e-6, seed=3) == greedy
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(500, 1)
    gen = torch.Generator().manual_seed(0)
    drawn = sample_next(logits, 1.0, top_k=2, generator=gen)
    assert set(drawn.tolist()) == {2, 3}
    drawn = sample_next(logits, 1.0, top_p=0.7, generator=gen)  # p(3)=.64, p(2)=.24
    assert set(drawn.tolist()) == {2, 3}


def test_user_errors() -> None:
    model = _model(**FAMILIES["xmod_bce"])
    C = model.cfg.context
    with pytest.raises(UserError, match=rf"{C + 5} tokens.*context is {C}"):
        generate(model, [[1] * (C + 5)], 4)
    with pytest.raises(UserError, match="empty"):
        generate(model, [[1, 2], []], 4)
    with pytest.raises(UserError, match="no prompts"):
        generate(model, [], 4)
    with pytest.raises(UserError, match="vocabulary"):
        generate(model, [[model.cfg.vocab_size]], 4)
    for kwargs in (dict(temperature=-1.0), dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(UserError):
            generate(model, [[1]], 4, **kwargs)
    assert generate(model, [[1], [2, 3]], 0) == [[], []]


def test_sparse_allocation_policies_and_growth() -> None:
    model = _model(**FAMILIES["xmod_bce"])
    cfg = model.cfg
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.context))
    ref, cache = decode_logits(model, idx, prefill=4, return_cache=True)
    tight, tcache = decode_logits(model, idx, prefill=4, slack=0.05, return_cache=True)
    worst, wcache = decode_logits(
        model, idx, prefill=4, sparse_alloc="worst_case", return_cache=True
    )
    torch.testing.assert_close(tight, ref)
    torch.testing.assert_close(worst, ref)
    assert tcache.n_grows() > 0 and wcache.n_grows() == 0
    assert cache.bytes_used() == tcache.bytes_used() == wcache.bytes_used()
    full = KVCache(cfg, 2, cfg.context, sparse_alloc="worst_case")
    assert wcache.bytes_allocated() == full.bytes_allocated()
    assert cache.bytes_allocated() < wcache.bytes_allocated()
    with pytest.raises(UserError):
        KVCache(cfg, 1, 8, sparse_alloc="lazy")


def test_kv_formula_ratio_is_active_depth_fraction() -> None:
    xmod = tiny_model_cfg(n_layers=8, stride=4, capacity=0.25)
    dense = tiny_model_cfg(n_layers=8)
    ratio = kv_bytes_formula(xmod, 1000) / kv_bytes_formula(dense, 1000)
    assert ratio == pytest.approx(active_depth(xmod) / 8)
    assert kv_bytes_formula(dense, 10) == 8 * 10 * 2 * 32 * 4
    per_block = [1.0, 0.5, 0.5, 0.5, 1.0, 0.0, 0.0, 0.0]
    assert kv_bytes_formula(xmod, 10, per_block) == kv_bytes_formula(xmod, 10, [0.5] * 3 + [0] * 3)
    with pytest.raises(UserError):
        kv_bytes_formula(xmod, 10, [0.5, 0.5])


def test_calibrated_routers_and_benchmark() -> None:
    model = Transformer(tiny_model_cfg(n_layers=8, stride=4, capacity=0.25, context=64)).eval()
    reached = calibrate_untrained_(model)
    assert len(reached) == 6 and all(abs(f - 0.25) < 0.05 for f in reached)
    res = decode_benchmark(model, batch=2, prompt_len=16, new_tokens=8, repeats=1)
    assert res["tokens_per_s"] > 0 and 0 < res["routed_fraction"] < 1
    assert 0 < res["kv_bytes_used"] <= res["kv_bytes_allocated"]
    with pytest.raises(UserError, match="context"):
        decode_benchmark(model, prompt_len=60, new_tokens=8)


# --- from a run directory ------------------------------------------------------------


def _make_run(path, model_cfg, tokenizer=True):  # noqa: ANN001, ANN202
    from xmodlm.data.tokenizer import train_tokenizer
    from xmodlm.train.checkpoint import save_checkpoint

    path.mkdir(parents=True)
    (path / "config.yaml").write_text(Config(name="gen-test", model=model_cfg).to_yaml())
    save_checkpoint(path, 3, Transformer(model_cfg), state={}, meta={}, keep_last=1)
    if tokenizer:
        texts = ["the quick brown fox jumps over the lazy dog"] * 20 + ["hello world, again"] * 20
        tok = train_tokenizer(texts, vocab_size=300)
        (path / "tokenizer.json").write_text(tok.to_str())
    return path


def test_generate_from_run(tmp_path) -> None:  # noqa: ANN001
    cfg = tiny_model_cfg(vocab_size=300, n_layers=4, stride=2, capacity=0.5)
    run = _make_run(tmp_path / "run", cfg)
    texts = generate_from_run(run, ["the quick", "hello"], max_new_tokens=5, seed=0)
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    again = generate_from_run(run, ["the quick", "hello"], max_new_tokens=5, seed=0)
    assert texts == again
    greedy = generate_from_run(run, ["<|endoftext|>"], max_new_tokens=4, temperature=0)
    # greedy text is the argmax chain of full causal-routing forward passes of the
    # checkpoint's model, with nothing but the tokenizer between
    from xmodlm.export import load_pretrained

    model, tok = load_pretrained(run)
    ids = [tok.eot_id]
    with torch.no_grad():
        for _ in range(4):
            logits = model(torch.tensor([ids]), routing_mode="causal").logits[0, -1]
            ids.append(int(logits[: tok.vocab_size].argmax()))
    new = ids[1:]
    new = new[: new.index(tok.eot_id)] if tok.eot_id in new else new
    assert greedy == [tok.decode(new)]
    with pytest.raises(UserError, match="empty"):
        generate_from_run(run, [""], max_new_tokens=4)
    with pytest.raises(UserError, match="context is 32"):
        generate_from_run(run, ["the quick brown fox " * 20], max_new_tokens=4)
    with pytest.raises(UserError, match="not found"):
        generate_from_run(tmp_path / "nowhere", ["hi"])
    # a checkpoint of another configuration
    other = _make_run(tmp_path / "other", cfg)
    wide = Config(name="gen-test", model=tiny_model_cfg(vocab_size=300, d_model=64))
    (other / "config.yaml").write_text(wide.to_yaml())
    with pytest.raises(UserError, match="does not match"):
        generate_from_run(other, ["hi"])
    notok = _make_run(tmp_path / "notok", cfg, tokenizer=False)
    with pytest.raises(UserError, match="tokenizer"):
        generate_from_run(notok, ["hi"])
