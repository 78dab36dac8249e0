"""Small file helpers shared by the package: atomic writes and checksums.

Data files, checkpoints, configs, summaries, tables and figures are written through
:func:`atomic_open`, so a crash or a full disk leaves either the old file or the
new one, never half a file that a later run would mistake for finished work (nor a
truncated copy of a good earlier plot). No write follows a symbolic link: the
temporary file is opened with ``O_NOFOLLOW`` and the rename replaces a link at the
destination with a file instead of writing through it to wherever it pointed.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

_HASH_BLOCK = 1 << 20


@contextmanager
def atomic_open(path: Path, mode: str = "wb", **kwargs: Any) -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path``; on success fsync it and rename it over ``path``.

    The temporary file lives in the same directory so that ``os.replace`` is an
    atomic rename on the same file system. On any exception it is removed. Its name
    carries the process and thread, so two writers of one path never share it; it
    is created with mode 0666 less the umask (as ``open`` would) and never through a
    link planted at its name.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}-{threading.get_ident()}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    try:
        if tmp.is_symlink():
            tmp.unlink()
        fd = os.open(tmp, flags, 0o666)
        with os.fdopen(fd, mode, **kwargs) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file, fsync and rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "w") as f:
        f.write(text)


def atomic_write_json(path: Path, obj: Any) -> None:
    """:func:`atomic_write_text` of ``obj`` as indented JSON."""
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def atomic_savefig(fig: Any, path: Path, **kwargs: Any) -> Path:
    """Save a matplotlib figure to ``path`` through :func:`atomic_open`.

    ``savefig`` given a file name truncates it first, so a full disk mid-render
    would destroy the earlier good figure; here it renders into the temporary file
    and the format comes from the suffix (``.png``, ``.pdf``, ``.svg``).
    """
    path = Path(path)
    kwargs.setdefault("format", path.suffix.lstrip(".").lower() or "png")
    with atomic_open(path, "wb") as handle:
        fig.savefig(handle, **kwargs)
    return path


def cache_dir(preferred: Path, what: str) -> Path:
    """``preferred`` (made if absent) where it can be written, else a fresh temporary
    folder, with a note on stderr.

    A cache kept in a run folder must not fail a command that only reads the run: an
    evaluation on a read-only file system would otherwise compute everything and
    then stop on the cache. The cost of the fallback is building the cache again.
    """
    preferred = Path(preferred)
    try:
        preferred.mkdir(parents=True, exist_ok=True)
        if os.access(preferred, os.W_OK):
            return preferred
    except OSError:
        pass
    fallback = Path(tempfile.mkdtemp(prefix="xmod-cache-"))
    print(f"note: {preferred} cannot be written: {what} kept in {fallback} for this run",
          file=sys.stderr)
    return fallback


def fsync_dir(directory: Path) -> None:
    """Persist a rename: the directory entry must reach the disk too (POSIX only)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in blocks so large token files need little memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: Path, directory: bool = False) -> None:
    """Give ``path`` the mode a plain ``open``/``mkdir`` would (``mkdtemp`` makes 0700 and
    safetensors 0600 files, whatever the umask)."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_umask())
