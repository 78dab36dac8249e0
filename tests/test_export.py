"""Export and load: safetensors + config.json + tokenizer, no pickles, transformers offline."""

from __future__ import annotations

import json
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
        f"data.dir={tiny_data_dir}", "data.val_batches=1", "model.vocab_size=320",
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
    assert config["model_type"] == "xmod" and config["format"] == "xmodlm-export"
    assert config["xmod"]["n_layers"] == 4 and config["layout"] == "DsDs"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_xmod.XModForCausalLM"
    assert config["routing_mode"] == "causal"
    assert config["source"]["step"] == 2
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


def test_transformers_loads_export_and_generates_like_xmod(
    run_dir: Path, exported: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    transformers = pytest.importorskip("transformers")

    hf = transformers.AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True)
    hf_tok = transformers.AutoTokenizer.from_pretrained(exported)
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
