"""One writer per run directory: ``RUN_DIR/.lock``.

The lock is an exclusive ``flock`` on ``RUN_DIR/.lock``, held for as long as
the writer runs; the file records the holder's pid and host. The kernel drops
the ``flock`` when its process dies however it dies (kill -9 included), so a
lock file left behind by a dead writer is *stale*: the next writer takes it
over and says so. A second live writer is refused with a :class:`UserError`
naming the holder's pid and host.

On systems without ``fcntl`` (Windows) the pid in the file decides instead:
a lock whose pid is not running on this host is stale.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from xmodlm.errors import UserError

try:
    import fcntl
except ImportError:  # pragma: no cover (not POSIX)
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = ".lock"


def _holder(path: Path) -> dict[str, Any]:
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def _describe(info: dict[str, Any]) -> str:
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')}"


def _refuse(run: Path, info: dict[str, Any]) -> UserError:
    return UserError(
        f"run directory {str(run)!r} is in use by another writer ({_describe(info)}):"
        " wait for it to finish, or choose another --out"
    )


@contextlib.contextmanager
def run_lock(run_dir: str | Path, note: Callable[[str], None] = print) -> Iterator[None]:
    """Hold the writer's lock of ``run_dir`` (created if missing) for the ``with`` body."""
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    path = run / LOCK_FILE
    me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
    fd = _acquire(run, path, note)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(me) + "\n").encode())
        yield
    finally:
        with contextlib.suppress(OSError):
            if _same_file(fd, path):
                path.unlink()
        os.close(fd)  # releases the flock


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except OSError:
        return False


def _acquire(run: Path, path: Path, note: Callable[[str], None]) -> int:
    for _ in range(10):  # retried only if the file is replaced between open and flock
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        if fcntl is None:  # pragma: no cover
            return _acquire_by_pid(run, path, fd, note)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            info = _holder(path)
            os.close(fd)
            raise _refuse(run, info) from None
        except OSError:  # a file system without flock: the pid decides
            return _acquire_by_pid(run, path, fd, note)
        if not _same_file(fd, path):  # the previous holder removed it as we opened it
            os.close(fd)
            continue
        info = _holder(path)
        if info:
            note(f"{path}: taking over a stale lock of {_describe(info)} (no longer running)")
        return fd
    raise UserError(f"run directory {str(run)!r}: could not take {path} (it keeps changing)")


def _acquire_by_pid(run: Path, path: Path, fd: int, note: Callable[[str], None]) -> int:
    info = _holder(path)
    if info and info.get("pid") != os.getpid():
        if info.get("host") != socket.gethostname() or _pid_alive(info.get("pid")):
            os.close(fd)
            raise _refuse(run, info)
        note(f"{path}: taking over a stale lock of {_describe(info)} (no longer running)")
    return fd
