"""Export and load: safetensors + config.json + tokenizer, no pickles, transformers offline."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

import xmodlm
from xmodlm.cli import main
from xmodlm.config import load_config
from xmodlm.errors import UserError
from xmodlm.export import export_run, generate_from_run
from xmodlm.model.generate import generate
from xmodlm.train import checkpoint as ckpt_io
from xmodlm.train.trainer import train

PROMPT = "The whale"


@pytest.fixture(scope="module")
def run_dir(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-block X-MoD model (layout DsDs) trained 2 steps."""
    cfg = load_config("xmod-tiny", [
        f"data.dir={tiny_data_dir}", "data.val_batches=1", "model.vocab_size=300",
        "model.d_model=32", "model.n_heads=2", "model.n_layers=4", "model.stride=2",
        "model.capacity=0.5", "model.context=32", "train.batch_size=2", "train.dtype=fp32",
        "train.max_steps=2", "train.warmup_steps=1",
    ])
    run = tmp_path_factory.mktemp("export") / "run"
    torch.manual_seed(0)
    train(cfg, run, progress=False)
    return run


@pytest.fixture(scope="module")
def exported(run_dir: Path) -> Path:
    out = run_dir.parent / "exported"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    return out


def test_export_writes_a_self_contained_directory(run_dir: Path, exported: Path) -> None:
    for name in ("model.safetensors", "config.json", "tokenizer.json", "modeling_xmod.py",
                 "tokenizer_config.json", "generation_config.json"):
        assert (exported / name).is_file(), name
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "xmodlm" and config["format"] == "xmodlm-export"
    assert config["xmod"]["n_layers"] == 4 and config["layout"] == "DsDs"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_xmod.XModForCausalLM"
    assert config["threshold_rule"] == "calibrated" and config["use_cache"] is True
    assert config["source"]["step"] == 2 and config["source"]["run"] == "run"
    assert not list(exported.glob("*.pt")) and not list(exported.glob("*.bin"))


def test_load_pretrained_export_equals_run(run_dir: Path, exported: Path) -> None:
    from_run, tok_run = xmodlm.load_pretrained(run_dir)
    from_export, tok_exp = xmodlm.load_pretrained(exported)
    assert not from_export.training
    idx = torch.tensor([tok_run.encode("the whale and the sea")])
    for mode in ("topk", "causal"):
        a = from_run(idx, routing_mode=mode).logits
        b = from_export(idx, routing_mode=mode).logits
        assert torch.equal(a, b), mode
    assert tok_exp.encode(PROMPT) == tok_run.encode(PROMPT)
    if from_export.cfg.tie_embeddings:  # re-tied on load, as in training
        assert from_export.head.weight is from_export.embed.weight


def test_model_loading_never_unpickles(
    run_dir: Path, exported: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_pickles(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.load on the model load path")

    monkeypatch.setattr(torch, "load", no_pickles)
    xmodlm.load_pretrained(exported)
    xmodlm.load_pretrained(run_dir)


class _Evil:
    def __reduce__(self):  # noqa: ANN204
        return (Path.touch, (Path(_Evil.target),))

    target = ""


def test_resume_state_is_read_weights_only(tmp_path: Path) -> None:
    """A crafted state.pt cannot run code: load_state refuses arbitrary objects."""
    _Evil.target = str(tmp_path / "pwned")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    torch.save({"optimizer": _Evil()}, ckpt / "state.pt")
    with pytest.raises(UserError, match="cannot be read"):
        ckpt_io.load_state(ckpt)
    assert not (tmp_path / "pwned").exists()


def test_export_and_load_errors(
    run_dir: Path, exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(UserError, match="neither an exported model"):
        xmodlm.load_pretrained(tmp_path)
    with pytest.raises(UserError, match="already an exported"):
        export_run(exported, tmp_path / "again")
    with pytest.raises(UserError, match="is the run directory"):
        export_run(run_dir, run_dir)
    assert main(["export", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(
        {"format": "xmodlm-export", "format_version": 99, "xmod": {}}))
    with pytest.raises(UserError, match="upgrade"):
        xmodlm.load_pretrained(bad)
    # a key given twice in an edited config.json is refused, not resolved to the last
    text = (exported / "config.json").read_text()
    (bad / "config.json").write_text(text.replace('"gating":', '"gating": "logit", "gating":', 1))
    with pytest.raises(UserError, match="'gating' given twice"):
        xmodlm.load_pretrained(bad)
    (bad / "config.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="neither an exported model"):
        xmodlm.load_pretrained(bad)


def test_transformers_loads_export_and_generates_like_xmod(
    run_dir: Path, exported: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    transformers = pytest.importorskip("transformers")

    hf = transformers.AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True)
    hf_tok = transformers.AutoTokenizer.from_pretrained(exported, trust_remote_code=True)
    model, tok = xmodlm.load_pretrained(run_dir)
    ids = tok.encode(PROMPT)
    assert hf_tok(PROMPT)["input_ids"] == ids
    idx = torch.tensor([ids + tok.encode(" and the sea")])
    # causal routing: the logits of a causal forward, unchanged by later tokens
    with torch.no_grad():
        logits = hf(idx).logits
        ours = model(idx, routing_mode="causal").logits[..., : tok.vocab_size]
        assert torch.allclose(logits[..., : tok.vocab_size], ours, atol=1e-5)
        changed = idx.clone()
        changed[0, -1] = (changed[0, -1] + 1) % tok.vocab_size
        assert torch.allclose(hf(changed).logits[0, :-1], logits[0, :-1], atol=1e-5)
    # greedy generation: the same tokens as xmod generate
    n = 6
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    hf_new = out[0, len(ids):].tolist()
    want = generate(model, [ids], n, temperature=0, eot_id=tok.eot_id,
                    vocab_limit=tok.vocab_size)[0]
    assert hf_new == want
    text = generate_from_run(run_dir, [PROMPT], max_new_tokens=n, temperature=0)[0]
    assert tok.decode([t for t in hf_new if t != tok.eot_id]) == text


# --- the standalone transformers model ----------------------------------------------------


def test_model_type_resolves_to_no_transformers_model(exported: Path) -> None:
    """Without trust_remote_code the export must not load as some built-in model
    (transformers' own X-MOD once took "xmod" and returned random weights)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from xmodlm.export import model_type

    name = json.loads((exported / "config.json").read_text())["model_type"]
    assert name == model_type() == "xmodlm"
    assert name not in CONFIG_MAPPING_NAMES
    with pytest.raises(ValueError, match="trust_remote_code"):
        transformers.AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=False)


def test_modeling_file_imports_only_torch_transformers_and_stdlib(exported: Path) -> None:
    import ast
    import sys

    tree = ast.parse((exported / "modeling_xmod.py").read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import does not travel with one file"
            roots.add(node.module.split(".")[0])
    assert "xmodlm" not in roots
    assert roots - set(sys.stdlib_module_names) == {"torch", "transformers"}


def test_modeling_file_runs_every_depth_router_kind() -> None:
    """A new decision kind must be taught to the standalone file too."""
    pytest.importorskip("transformers")
    from xmodlm.depth_routers import kinds
    from xmodlm.hf import DECISIONS

    assert set(DECISIONS) == set(kinds())


def _twin(model: torch.nn.Module, tokenizer_vocab: int | None = None) -> torch.nn.Module:
    """The transformers model of ``model`` (same weights), built in-process."""
    from xmodlm.export import transformers_model

    return transformers_model(model, tokenizer_vocab)


def _varied(**changes: object) -> torch.nn.Module:
    """A random model whose sparse blocks route some tokens and skip others (weights
    large enough that greedy decoding does not repeat one token), thresholds
    calibrated as after training."""
    from conftest import tiny_model_cfg
    from xmodlm.model import Transformer

    cfg = tiny_model_cfg(**{"layout": "DsDs", "capacity": 0.5, "stride": 2, **changes})
    torch.manual_seed(1)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.25)
        model.calibrate_thresholds_(torch.randint(0, cfg.vocab_size, (4, cfg.context)))
    return model


VARIANTS = {
    "xmod": {},
    "predictor": {"causal_router": "predictor"},
    "logit-gate-half-rule": {"gating": "logit", "causal_threshold": "half"},
    "sigmoid-gate": {"gating": "sigmoid"},
    "moe": {"layout": "EsEs", "mlp": "moe", "n_experts": 4, "moe_top_k": 2},
    "dense": {"layout": "DDDD", "capacity": 1.0, "stride": 1},
    "gqa-qk-norm": {"n_kv_heads": 2, "head_dim": 12, "qk_norm": True},
    # the paper's construction: stages of four sparse blocks, a strong token-choice bias
    "token-bias": {"layout": "", "stride": 1, "capacity": 1.0, "active_layers": 3,
                   "dense_prefix": 1, "sparsity": 4, "anchor_stride": 1, "token_bias_tau": 2.0},
    "token-bias-predictor": {"layout": "", "stride": 1, "capacity": 1.0, "active_layers": 3,
                             "dense_prefix": 1, "sparsity": 4, "anchor_stride": 1,
                             "token_bias_tau": 2.0, "causal_router": "predictor"},
    "mod-ffn-gate": {"gating": "sigmoid", "gate_scope": "ffn", "balance": "none"},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_standalone_model_equals_causal_forward_and_its_cache(variant: str) -> None:
    pytest.importorskip("transformers")
    model = _varied(**VARIANTS[variant])
    hf = _twin(model)
    idx = torch.randint(0, model.cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(idx, routing_mode="causal", return_stats=True)
        full = hf(idx, use_cache=False).logits
        assert torch.allclose(full, want.logits, atol=1e-5, rtol=0)
        if "s" in model.layout:  # routing is exercised: some tokens taken, some skipped
            used = want.stats["capacity_used"]
            assert all(0.0 < u < 1.0 for u in used), used
        # prefill 7 tokens, then one at a time through the cache
        out = hf(idx[:, :7], use_cache=True)
        steps, cache = [out.logits], out.cache
        for t in range(7, 20):
            out = hf(idx[:, t : t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
        assert torch.allclose(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-4)
    per_layer = cache.tokens_per_layer()
    for letter, held in zip(model.layout, per_layer, strict=True):
        if letter == "s":  # a sparse layer holds only the tokens it routed
            assert 0 < held < 2 * 20
        else:
            assert held == 2 * 20


def test_padded_rows_compute_what_each_row_computes_alone() -> None:
    pytest.importorskip("transformers")
    model = _varied()
    hf = _twin(model)
    gen = torch.Generator().manual_seed(4)
    rows = [torch.randint(1, 97, (n,), generator=gen) for n in (12, 5, 9)]
    T = 12
    ids = torch.zeros(3, T, dtype=torch.long)
    mask = torch.zeros(3, T, dtype=torch.long)
    for b, r in enumerate(rows):  # left padding, pad id 0
        ids[b, T - len(r):], mask[b, T - len(r):] = r, 1
    with torch.no_grad():
        batch = hf(ids, attention_mask=mask, use_cache=False).logits
        for b, r in enumerate(rows):
            alone = model(r[None], routing_mode="causal").logits[0]
            assert torch.allclose(batch[b, T - len(r):], alone, atol=1e-5, rtol=0), b


def test_generate_with_cache_and_padding_equals_xmod_generate() -> None:
    pytest.importorskip("transformers")
    model = _varied()
    hf = _twin(model, tokenizer_vocab=90)
    prompts = [[5, 17, 33, 2, 60, 8], [41], [70, 3, 3, 12]]
    n = 12
    want = generate(model, prompts, n, temperature=0, vocab_limit=90)
    assert len({tuple(w) for w in want}) == 3 and all(len(set(w)) > 2 for w in want)
    T = max(map(len, prompts))
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    for use_cache in (True, False):
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                          do_sample=False, use_cache=use_cache, pad_token_id=0, eos_token_id=None)
        assert out[:, T:].tolist() == want, use_cache


def test_save_pretrained_round_trip_and_dtype(
    exported: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoModelForCausalLM
    hf = auto.from_pretrained(exported, trust_remote_code=True)
    assert hf.config.use_cache is True
    hf.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "modeling_xmod.py").is_file()
    again = auto.from_pretrained(tmp_path / "saved", trust_remote_code=True)
    idx = torch.tensor([[5, 9, 14, 2, 77, 31]])
    with torch.no_grad():
        assert torch.equal(again(idx).logits, hf(idx).logits)
        half = auto.from_pretrained(tmp_path / "saved", trust_remote_code=True,
                                    dtype=torch.bfloat16)
        assert half.head.weight.dtype == torch.bfloat16
        router = half.blocks[1].router  # decisions stay fp32: thresholds are not rounded
        assert router.weight.dtype == router.threshold.dtype == torch.float32
        assert router.threshold.item() == hf.blocks[1].router.threshold.item()
        V = hf.config.tokenizer_vocab_size
        assert torch.allclose(half(idx).logits[..., :V], hf(idx).logits[..., :V], atol=0.1)


def test_grouped_query_qk_norm_export_round_trips(
    tiny_data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A grouped-query model with a free head dim and QK-norm, trained, exported,
    read back by xmod-lm and by transformers (logits, cache, greedy tokens), saved
    by transformers and read again."""
    cfg = load_config("xmod-tiny", [
        f"data.dir={tiny_data_dir}", "data.val_batches=1", "model.vocab_size=300",
        "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=12",
        "model.qk_norm=true", "model.n_layers=4", "model.stride=2", "model.capacity=0.5",
        "model.context=32", "train.batch_size=2", "train.dtype=fp32", "train.max_steps=2",
        "train.warmup_steps=1",
    ])
    run, out = tmp_path / "run", tmp_path / "exported"
    torch.manual_seed(0)
    train(cfg, run, progress=False)
    assert main(["export", str(run), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["num_key_value_heads"], config["head_dim"], config["qk_norm"]) == (2, 12, True)
    model, tok = xmodlm.load_pretrained(run)
    again, _ = xmodlm.load_pretrained(out)
    idx = torch.tensor([tok.encode("the whale and the sea")])
    with torch.no_grad():
        want = model(idx, routing_mode="causal").logits
        assert torch.equal(again(idx, routing_mode="causal").logits, want)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoModelForCausalLM
    hf = auto.from_pretrained(out, trust_remote_code=True)
    V = tok.vocab_size
    with torch.no_grad():
        got = hf(idx).logits
        assert torch.allclose(got[..., :V], want[..., :V], atol=1e-5)
        hf.save_pretrained(tmp_path / "saved")
        saved = auto.from_pretrained(tmp_path / "saved", trust_remote_code=True)
        assert torch.equal(saved(idx).logits, got)
    ids = idx[0].tolist()
    generated = hf.generate(idx, max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    want_ids = generate(model, [ids], 6, temperature=0, eot_id=tok.eot_id, vocab_limit=V)[0]
    assert generated == want_ids


def test_export_dtype_writes_half_weights_that_load_back(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors import safe_open

    out = tmp_path / "bf16"
    assert main(["export", str(run_dir), "--out", str(out), "--dtype", "bfloat16"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118
    assert dtypes["head.weight"] == dtypes["blocks.0.block.attn.qkv.weight"] == torch.bfloat16
    assert dtypes["blocks.1.router.weight"] == dtypes["blocks.1.router.threshold"] == torch.float32
    model, _ = xmodlm.load_pretrained(out)  # xmod-lm reads it too
    assert model.embed.weight.dtype == torch.float32
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True,
                                                           dtype="auto")
    assert hf.embed.weight.dtype == torch.bfloat16


def test_model_card_is_written_from_the_run_record(run_dir: Path, exported: Path) -> None:
    card = (exported / "README.md").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    for heading in ("## Architecture", "## Routing", "## Training data", "## Losses",
                    "## Evaluation", "trust_remote_code=True"):
        assert heading in card, heading
    assert "`DsDs`" in card and "`variance_scaled`" in card and "`calibrated`" in card
    assert f"{summary['final_val_loss']:.4g}" in card
    assert f"{summary['tokens']:,}" in card
    model, _ = xmodlm.load_pretrained(run_dir)
    for block in model.routed_blocks():
        assert f"{float(block.router.threshold):.4g}" in card
    assert "doc" not in card or "src" in card  # the corpus is named from its manifest
    assert str(run_dir) not in card and str(run_dir.parent) not in card


# --- export safety ---------------------------------------------------------------------


def _one_line_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_export_refuses_a_folder_holding_something_else(
    run_dir: Path, exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llama"}')
    (other / "model.safetensors").write_bytes(b"another model")
    err = _one_line_exit_2(["export", str(run_dir), "--out", str(other)], capsys)
    assert "not an xmod export" in err and "--force" in err
    assert (other / "model.safetensors").read_bytes() == b"another model"
    # an export of another run (its config differs) is refused too
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    for f in exported.iterdir():
        (foreign / f.name).write_bytes(f.read_bytes())
    config = json.loads((foreign / "config.json").read_text())
    config["source"]["run_config_sha256"] = "f" * 64
    (foreign / "config.json").write_text(json.dumps(config))
    weights = (foreign / "model.safetensors").read_bytes()
    err = _one_line_exit_2(["export", str(run_dir), "--out", str(foreign)], capsys)
    assert "another run" in err
    assert (foreign / "model.safetensors").read_bytes() == weights
    # the same run again is fine; --force writes over anything
    assert main(["export", str(run_dir), "--out", str(exported)]) == 0
    assert main(["export", str(run_dir), "--out", str(other), "--force"]) == 0
    assert xmodlm.load_pretrained(other)[0] is not None


def test_export_never_writes_through_a_symlink(
    run_dir: Path, exported: Path, tmp_path: Path
) -> None:
    out = tmp_path / "linked"
    out.mkdir()
    for f in exported.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    outside = tmp_path / "precious"
    outside.mkdir()
    targets = {}
    for name in ("tokenizer.json", "modeling_xmod.py", "model.safetensors"):
        target = outside / name
        target.write_text(f"keep {name}")
        (out / name).unlink()
        (out / name).symlink_to(target)
        targets[name] = target
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    for name, target in targets.items():
        assert target.read_text() == f"keep {name}", name
        assert not (out / name).is_symlink() and (out / name).stat().st_size > 20
    xmodlm.load_pretrained(out)


def test_export_config_has_no_path_and_files_have_plain_modes(
    run_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "modes"
    old = os.umask(0o022)
    try:
        assert main(["export", str(run_dir), "--out", str(out)]) == 0
    finally:
        os.umask(old)
    text = (out / "config.json").read_text()
    assert str(run_dir.parent) not in text and str(tmp_path) not in text

    def strings(value: object) -> list[str]:
        if isinstance(value, dict):
            return [s for v in value.values() for s in strings(v)]
        if isinstance(value, list):
            return [s for v in value for s in strings(v)]
        return [value] if isinstance(value, str) else []

    assert not [s for s in strings(json.loads(text)) if s.startswith("/")]
    files = sorted(out.iterdir())
    assert [f.name for f in files if f.name.startswith(".")] == []  # no temporary left
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f.name


def test_export_on_a_full_disk_is_one_line_and_keeps_the_old_export(
    run_dir: Path, exported: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import safetensors.torch
    from safetensors import SafetensorError

    out = tmp_path / "full"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    before = {f.name: f.read_bytes() for f in out.iterdir()}

    def no_space(tensors: object, filename: str, metadata: object = None) -> None:
        Path(filename).write_bytes(b"half a fi")
        raise SafetensorError("Error while serializing: IoError(No space left on device)")

    monkeypatch.setattr(safetensors.torch, "save_file", no_space)
    err = _one_line_exit_2(["export", str(run_dir), "--out", str(out)], capsys)
    assert "No space left on device" in err and "full" in err
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before


# --- an export on a machine without xmod-lm -------------------------------------------------

CLEAN_VENV_SCRIPT = """
import importlib.util, json, sys
assert importlib.util.find_spec("xmodlm") is None, "xmod-lm is importable here"
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
path, result, n, prompts = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
name = json.load(open(path + "/config.json"))["model_type"]
try:
    AutoModelForCausalLM.from_pretrained(path, trust_remote_code=False)
    without_trust = "loaded"
except ValueError:
    without_trust = "refused"
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
tok = AutoTokenizer.from_pretrained(path, padding_side="left", trust_remote_code=True)
batch = tok(prompts, return_tensors="pt", padding=True)
out = model.generate(**batch, max_new_tokens=n, do_sample=False, use_cache=True)
eot = model.config.eos_token_id
texts = []
for row in out[:, batch["input_ids"].shape[1]:].tolist():
    texts.append(tok.decode(row[: row.index(eot)] if eot in row else row))
with open(result, "w") as f:  # not stdout: transformers prompts there
    json.dump({"builtin": name in CONFIG_MAPPING_NAMES, "without_trust": without_trust,
               "texts": texts}, f)
"""


def _varied_export(exported: Path, out: Path) -> Path:
    """A copy of ``exported`` with random weights that route some tokens and not others
    and decode without repeating (the 2-step model repeats one pair of tokens)."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(exported, out)
    model, tok = xmodlm.load_pretrained(out)
    torch.manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.25)
        model.calibrate_thresholds_(torch.randint(0, tok.vocab_size, (4, model.cfg.context)))
    weights = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(out / "model.safetensors"))
    return out


@pytest.mark.slow
def test_export_generates_like_xmod_in_a_venv_without_xmodlm(
    exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A clean virtual environment with torch (CPU) and transformers only, as on a
    hub user's machine: the export loads, is never taken for a built-in model,
    and greedy generation of a padded batch gives `xmod generate`'s text."""
    import subprocess
    import sys

    transformers = pytest.importorskip("transformers")
    model_dir = _varied_export(exported, tmp_path / "model")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", f"torch=={torch.__version__.split('+')[0]}",
         f"transformers=={transformers.__version__}"],
        capture_output=True, text=True,
    )
    if pip.returncode != 0:
        pytest.skip(f"cannot install torch and transformers: {pip.stderr.strip()[-300:]}")
    prompts, n = ["The whale", "A ship of the king was"], 16
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf")}
    result = tmp_path / "result.json"
    run = subprocess.run(
        [str(venv / "bin" / "python"), "-c", CLEAN_VENV_SCRIPT, str(model_dir), str(result),
         str(n), *prompts],
        capture_output=True, text=True, env=env, cwd=tmp_path, stdin=subprocess.DEVNULL,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    there = json.loads(result.read_text())
    assert there["builtin"] is False and there["without_trust"] == "refused"
    argv = ["generate", str(model_dir), "--max-new-tokens", str(n), "--temperature", "0", "--json"]
    for prompt in prompts:
        argv += ["--prompt", prompt]
    assert main(argv) == 0
    here = [json.loads(line)["completion"] for line in capsys.readouterr().out.splitlines()]
    assert there["texts"] == here
    assert all(len(set(text)) > 5 for text in here)  # varied, not one token repeated
