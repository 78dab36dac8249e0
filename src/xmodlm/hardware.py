"""What machine a run is on: device choice, measured matmul peak, environment record.

MFU is reported against the matmul throughput *measured* on this machine, not a
datasheet number, so CPU and GPU figures mean the same thing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        from xmodlm.errors import UserError

        raise UserError(f"device {name!r} requested but CUDA is not available: use cpu or auto")
    return torch.device(name)


def autocast_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def autocast_context(
    device: torch.device, dtype: str
) -> contextlib.AbstractContextManager[Any]:
    """Autocast to ``dtype`` (``bf16``/``fp32``, already resolved) on ``device``;
    nothing for fp32 (weights are fp32 anyway)."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=autocast_dtype(dtype))


NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 AVX-512/AMX, Arm


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (from /proc/cpuinfo; False if unknown).

    Without it, bf16 matmuls are emulated: on an AVX2-only CPU a bf16 1024^3
    matmul runs near 1 GFLOP/s against 150+ in fp32, and bf16 autocast training
    about 10x slower than fp32.
    """
    try:
        return native_bf16_in_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return False


def native_bf16_in_cpuinfo(text: str) -> bool:
    """Whether a /proc/cpuinfo text's first flags (x86) or Features (Arm) line names
    a native bf16 instruction set."""
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return any(flag in line.split(":", 1)[1].split() for flag in NATIVE_BF16_CPU_FLAGS)
    return False


def resolve_dtype(name: str, device: torch.device) -> str:
    """``auto``: bf16 where the device multiplies it natively, else fp32."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return "bf16" if cpu_has_native_bf16() else "fp32"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_gflops(
    dtype: torch.dtype, device: torch.device, n: int, tries: int, warmup: int = 1
) -> float:
    """Best of ``tries`` timed n x n matmuls after ``warmup`` untimed ones, in GFLOP/s."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(warmup):
        torch.mm(a, b)
    _sync(device)
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


@functools.lru_cache(maxsize=8)
def matmul_peak_gflops(dtype: str = "bf16", device: str = "cpu", n: int = 1024) -> float:
    """Best-of-several n x n matmul throughput in GFLOP/s (cached per process)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        n = max(n, 8192)
    tries = 10 if dev.type == "cuda" else 5
    return measure_matmul_gflops(_DTYPES[dtype], dev, n, tries=tries, warmup=3)


class GitState(NamedTuple):
    """The source tree this package runs from: its commit, whether tracked files
    differ from it, and the tree's root."""

    commit: str
    dirty: bool
    root: str


def git_state() -> GitState | None:
    """The git state of the tree this package is imported from; None where it is
    not a git checkout (an installed wheel) or git cannot say. Untracked files do
    not count: they are not the code a run imports."""
    src = str(Path(__file__).resolve().parent)

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", "-C", src, *args], capture_output=True, text=True, timeout=5)

    try:
        head, root = git("rev-parse", "HEAD"), git("rev-parse", "--show-toplevel")
        status = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0 or status.returncode != 0:
        return None
    return GitState(head.stdout.strip(), bool(status.stdout.strip()), root.stdout.strip())


def _git_commit() -> str | None:
    """The commit a run records: ``<sha>``, or ``<sha>-dirty`` where tracked files
    differ from it."""
    state = git_state()
    if state is None:
        return None
    return state.commit + ("-dirty" if state.dirty else "")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


KIND_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # what sets a CPU's kernels


def cpu_kind(cpuinfo: str | None = None) -> str:
    """The kind of CPU a run's numbers depend on: model name, x86 family and model,
    and the vector and matrix instruction sets that pick the kernels.

    The same config and seed differ by as much as the effects studied (0.037
    nats) on two CPU kinds, so runs are paired only within one kind; the model
    name alone ("AMD EPYC") names CPUs of different kinds.
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return platform.processor() or platform.machine()
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor only
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name", platform.processor() or platform.machine())
    flags = set(fields.get("flags", fields.get("Features", "")).split())
    have = " ".join(f for f in KIND_FLAGS if f in flags)
    where = f"family {fields['cpu family']} model {fields['model']}" if "cpu family" in fields else ""
    return f"{name} ({'; '.join(x for x in (where, have) if x)})"


def environment_record() -> dict[str, Any]:
    """Everything needed to reproduce a figure: code version, packages, hardware."""
    import numpy

    from xmodlm.version import __version__

    record: dict[str, Any] = {
        "xmodlm": __version__,
        "git_commit": _git_commit(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_kind": cpu_kind(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "argv": sys.argv,
        "cuda": None,
    }
    if torch.cuda.is_available():
        record["cuda"] = {
            "device": torch.cuda.get_device_name(0),
            "count": torch.cuda.device_count(),
            "version": torch.version.cuda,
        }
    return record


def retain_freed_memory() -> str | None:
    """Make glibc keep freed memory for reuse instead of returning it to the OS.

    By default glibc serves every allocation above its mmap threshold (at most
    32 MiB) with a fresh ``mmap`` and unmaps it on free, and trims the heap top;
    a training step that allocates and frees the same large activations each
    step then page-faults them all in again, every step. On this project's VMs
    that cost about 9% of a bench-dense step (0.3-0.5 GiB of faults per step)
    and 20% of a 12-block dense step (1.2 GiB), and nothing for X-MoD, whose
    tensors are small. Raising the mmap threshold to 1 GiB and the trim
    threshold to 2 GiB makes the heap behave like the caching allocator CUDA
    uses. Process-wide; returns a description, or None where it does not apply
    (not glibc Linux).
    """
    if not sys.platform.startswith("linux"):
        return None
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc <malloc.h>
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = (
            libc.mallopt(m_mmap_threshold, 1 << 30) == 1
            and libc.mallopt(m_trim_threshold, 2**31 - 1) == 1
        )
    except (OSError, AttributeError):
        return None
    if not ok:
        return None
    return "glibc mallopt: M_MMAP_THRESHOLD 1 GiB, M_TRIM_THRESHOLD 2 GiB (freed memory reused)"
