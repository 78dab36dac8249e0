"""Data for real use: a small text file, a user's tokenizer, uint32 ids, Hugging Face
arguments (offline: ``datasets.load_dataset`` is replaced), a tokenizer mismatch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from xmodlm.cli import main
from xmodlm.data import EOT, Tokenizer, load_manifest, load_split, prepare
from xmodlm.data.batches import check_tokenizer
from xmodlm.data.prepare import token_dtype
from xmodlm.errors import UserError

SENTENCE = "The old sailor looked across the harbour at night and spoke quietly. "


def test_single_small_text_file_is_cut_into_documents(tmp_path: Path) -> None:
    text = "\n\n".join(f"Paragraph {i}. " + SENTENCE * 3 for i in range(12))
    path = tmp_path / "small.txt"
    path.write_text(text, encoding="utf-8")
    assert len(text.encode()) < 64 * 1024
    manifest = prepare(tmp_path / "out", vocab_size=300, texts=[path])
    splits = manifest["splits"]
    assert all(splits[s]["documents"] >= 1 for s in ("train", "val", "test"))
    assert sum(splits[s]["documents"] for s in splits) >= 3


def test_too_little_text_says_how_to_pass_it(tmp_path: Path) -> None:
    path = tmp_path / "two.txt"
    path.write_text("one line\nand another", encoding="utf-8")
    with pytest.raises(UserError, match="at least 3 lines, more files, or JSONL"):
        prepare(tmp_path / "out", vocab_size=300, texts=[path])


def test_token_dtype_widens_past_uint16() -> None:
    assert token_dtype(65_536) == np.uint16
    assert token_dtype(65_537) == np.uint32


def _word_tokenizer(path: Path, n_words: int, with_eot: bool) -> Path:
    vocab = {f"w{i}": i for i in range(n_words)}
    vocab["[UNK]"] = n_words
    if with_eot:
        vocab[EOT] = n_words + 1
    hf = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if with_eot:
        hf.add_special_tokens([EOT])
    hf.save(str(path))
    return path


def test_own_tokenizer_with_a_vocabulary_over_65536_stores_uint32(tmp_path: Path) -> None:
    tok_file = _word_tokenizer(tmp_path / "tokenizer.json", 70_000, with_eot=True)
    docs = [" ".join(f"w{(i * 7919 + j * 104_729) % 70_000}" for j in range(200)) for i in range(30)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "out"
    manifest = prepare(out, jsonl=[tmp_path / "docs.jsonl"], tokenizer=tok_file)
    assert manifest["dtype"] == "uint32" and manifest["vocab_size"] == 70_002
    assert "tokenizer_sha256" in manifest["request"]
    tok = Tokenizer.load(out)
    train = load_split(out, "train")  # the reader follows the manifest's dtype
    ids = np.asarray(train.tokens)
    assert ids.max() >= 65_536
    first_doc = ids[1 : 1 + 200].tolist()  # after the leading <|endoftext|>
    assert tok.decode(first_doc) in docs  # ids above 65,535 came back whole
    assert prepare(out, jsonl=[tmp_path / "docs.jsonl"], tokenizer=tok_file) == manifest  # verified


def test_own_tokenizer_without_eot_gets_one(tmp_path: Path) -> None:
    tok_file = _word_tokenizer(tmp_path / "tokenizer.json", 50, with_eot=False)
    docs = [" ".join(f"w{(i + j) % 50}" for j in range(40)) for i in range(10)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    manifest = prepare(tmp_path / "out", jsonl=[tmp_path / "docs.jsonl"], tokenizer=tok_file)
    assert manifest["dtype"] == "uint16"
    assert manifest["eot_id"] == 51 and manifest["vocab_size"] == 52


class _Rows:
    """A stand-in for a (non-streamed) datasets.Dataset: column names and rows."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self.column_names = list(rows[0])

    def __iter__(self) -> Any:
        return iter(self.rows)


def _fake_datasets(monkeypatch: pytest.MonkeyPatch, streamed: bool) -> list[dict[str, Any]]:
    import datasets

    calls: list[dict[str, Any]] = []
    rows = [{"content": f"Row {i}. " + SENTENCE * 4, "id": i} for i in range(40)]

    def load_dataset(name: str, config: str | None = None, **kwargs: Any) -> Any:
        calls.append({"name": name, "config": config, **kwargs})
        return iter(rows) if streamed else _Rows(rows)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_hf_arguments_reach_load_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_datasets(monkeypatch, streamed=True)
    out = tmp_path / "out"
    args = ["data", "prepare", "--out", str(out), "--vocab-size", "300", "--quiet",
            "--hf-dataset", "someone/corpus:en", "--hf-split", "validation",
            "--hf-column", "content", "--hf-streaming", "--hf-limit", "30"]
    assert main(args) == 0
    assert calls == [{"name": "someone/corpus", "config": "en", "split": "validation",
                      "streaming": True}]
    manifest = load_manifest(out)
    assert manifest["request"]["sources"] == [{
        "kind": "hf", "name": "someone/corpus:en", "sha256": None,
        "options": {"split": "validation", "column": "content", "streaming": True, "limit": 30},
    }]
    assert sum(manifest["splits"][s]["documents"] for s in manifest["splits"]) == 30


def test_hf_defaults_and_a_missing_column(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = _fake_datasets(monkeypatch, streamed=False)
    out = str(tmp_path / "out")
    assert main(["data", "prepare", "--out", out, "--hf-dataset", "corpus", "--quiet"]) == 2
    assert calls == [{"name": "corpus", "config": None, "split": "train", "streaming": False}]
    err = capsys.readouterr().err
    assert "no column 'text'" in err and "content, id" in err and "--hf-column" in err
    assert main(["data", "prepare", "--out", out, "--hf-split", "test"]) == 2
    assert "--hf-split applies to --hf-dataset" in capsys.readouterr().err


def test_data_from_another_tokenizer_is_refused(tmp_path: Path) -> None:
    docs = [f"Document {i}. " + SENTENCE * (2 + i % 3) for i in range(12)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    a = prepare(tmp_path / "a", vocab_size=300, jsonl=[tmp_path / "docs.jsonl"])
    prepare(tmp_path / "b", vocab_size=320, jsonl=[tmp_path / "docs.jsonl"])
    check_tokenizer(tmp_path / "a" / "tokenizer.json", a, tmp_path / "a")  # its own: fine
    with pytest.raises(UserError, match="another tokenizer.*--tokenizer"):
        check_tokenizer(tmp_path / "b" / "tokenizer.json", a, tmp_path / "a")


def test_jsonl_documents_from_a_named_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    docs = [f"Document {i}. " + SENTENCE * (2 + i % 3) for i in range(12)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs)))
    with pytest.raises(UserError, match=r'no string field "text" \(its fields: body, id\).*'
                                        r"--jsonl-field"):
        prepare(tmp_path / "a", vocab_size=300, jsonl=[path])
    manifest = prepare(tmp_path / "b", vocab_size=300, jsonl=[path], jsonl_field="body")
    assert manifest["request"]["sources"][0]["options"] == {"field": "body"}
    assert sum(s["documents"] for s in manifest["splits"].values()) == len(docs)
    with pytest.raises(UserError, match='no string field "id"'):  # a number is no document
        prepare(tmp_path / "c", vocab_size=300, jsonl=[path], jsonl_field="id")
    plain = tmp_path / "plain.jsonl"  # the default field leaves the request as it was
    plain.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    source = prepare(tmp_path / "d", vocab_size=300, jsonl=[plain])["request"]["sources"][0]
    assert "options" not in source
    out = str(tmp_path / "e")
    assert main(["data", "prepare", "--out", out, "--jsonl", str(path), "--jsonl-field", "body",
                 "--vocab-size", "300", "--quiet"]) == 0
    assert main(["data", "prepare", "--out", str(tmp_path / "f"), "--text", str(plain),
                 "--jsonl-field", "body"]) == 2
    assert "--jsonl-field 'body' names a field of --jsonl files" in capsys.readouterr().err
