"""The model's vocabulary and the corpus's tokenizer: taken from the corpus unless set,
and any mismatch refused at train time in one line, before a run directory is made."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from xmodlm.cli import main
from xmodlm.config import load_config
from xmodlm.data import load_manifest
from xmodlm.sweep.spec import run_id

TINY = ["model.d_model=32", "model.n_heads=2", "model.n_layers=4", "model.stride=2",
        "model.capacity=0.5", "model.context=32", "train.batch_size=2", "train.dtype=fp32",
        "train.warmup_steps=1", "data.val_batches=1", "train.max_steps=1"]


def _train(data: Path, out: Path, *extra: str) -> list[str]:
    sets = [a for kv in [f"data.dir={data}", *TINY, *extra] for a in ("--set", kv)]
    return ["train", "xmod-tiny", "--out", str(out), "--quiet", *sets]


def test_vocab_comes_from_the_corpus_unless_the_config_sets_it(
    tiny_data_dir: Path, tmp_path: Path
) -> None:
    data = [f"data.dir={tiny_data_dir}"]
    vocab = load_manifest(tiny_data_dir)["vocab_size"]
    assert load_config("xmod-tiny", data, vocab_from_data=True).model.vocab_size == vocab
    assert load_config("xmod-tiny", data).model.vocab_size == 4096  # the library: as written
    set_here = load_config("xmod-tiny", [*data, "model.vocab_size=512"], vocab_from_data=True)
    assert set_here.model.vocab_size == 512
    assert load_config("bench-dense", data, vocab_from_data=True).model.vocab_size == 4096
    own = tmp_path / "own.yaml"
    own.write_text("base: xmod-tiny\nmodel:\n  vocab_size: 640\n")
    assert load_config(own, data, vocab_from_data=True).model.vocab_size == 640
    nowhere = ["data.dir=" + str(tmp_path / "nowhere")]  # no corpus yet: as written
    assert load_config("xmod-tiny", nowhere, vocab_from_data=True).model.vocab_size == 4096


def test_a_preset_on_a_corpus_of_its_own_vocabulary_keeps_its_run_id(
    tiny_data_dir: Path, tmp_path: Path
) -> None:
    """Presets leave vocab_size at 4096 (stated or not) and the default corpus has 4096
    tokens: resolving from it must give the very config, so committed run ids hold."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    manifest = {**load_manifest(tiny_data_dir), "vocab_size": 4096}
    (corpus / "manifest.json").write_text(json.dumps(manifest))
    for preset in ("xmod-tiny", "micro", "dense-tiny"):
        sets = [f"data.dir={corpus}"]
        resolved = load_config(preset, sets, vocab_from_data=True)
        assert resolved.to_dict() == load_config(preset, sets).to_dict()
        assert run_id(resolved) == run_id(load_config(preset, sets))


def test_train_refuses_a_model_vocabulary_other_than_the_corpus(
    tiny_data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    vocab = load_manifest(tiny_data_dir)["vocab_size"]
    for wrong in (vocab + 20, vocab - 20):  # larger trains rows no token selects; smaller fails
        out = tmp_path / f"run{wrong}"
        assert main(_train(tiny_data_dir, out, f"model.vocab_size={wrong}")) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and f"set model.vocab_size={vocab}" in err, err
        assert not (out / "config.yaml").exists()


def test_train_refuses_a_tokenizer_the_tokens_were_not_made_with(
    tiny_data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    shutil.copytree(tiny_data_dir, data)
    tok = json.loads((data / "tokenizer.json").read_text())
    tok["model"]["vocab"] = {t: (i + 1) % len(tok["model"]["vocab"])  # ids shuffled
                             for t, i in tok["model"]["vocab"].items()}
    (data / "tokenizer.json").write_text(json.dumps(tok))
    assert main(_train(data, tmp_path / "run")) == 2
    err = capsys.readouterr().err
    assert "was tokenized with another tokenizer than" in err and "tokenizer.json" in err


def test_a_resumed_run_keeps_its_tokenizer(
    tiny_data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    assert main(_train(tiny_data_dir, run)) == 0
    kept = run / "tokenizer.json"
    assert kept.read_bytes() == (tiny_data_dir / "tokenizer.json").read_bytes()
    kept.write_text(kept.read_text() + " ")  # the run was trained with another tokenizer
    capsys.readouterr()
    assert main(_train(tiny_data_dir, run)) == 2
    err = capsys.readouterr().err
    assert f"tokenized with another tokenizer than {kept}" in err, err
