"""CPU SDPA in bf16: flash vs math backend vs flash in fp32, forward and backward, by length.

Why the model keeps SDPA's default (flash) backend on CPU even for a sparse
block's short sequences: on a quiet 2-core machine the math backend is faster
below about 200 tokens (the flash backward has a fixed cost of several ms), but
it runs several times more ops, and on a shared machine, where every parallel
op waits on an OpenMP barrier, it is 2-3x slower (docs/benchmarks.md). And why
bf16 attention over at most 128 keys runs in fp32 (``layers.attention``): the
``flash_fp32`` column (bf16 inputs cast up, fp32 flash, cast back) is
1.8-10x faster than bf16 flash there. Paired, interleaved rounds; medians in ms.
``python benchmarks/sdpa_backends.py [--lengths 16 64 128 256 512 1024] [--head-dim 64]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH,
            "flash_fp32": SDPBackend.FLASH_ATTENTION}


def time_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, name: str):
    """(forward, backward) seconds of one causal attention with ``name``'s backend."""
    with sdpa_kernel(BACKENDS[name]):
        t0 = time.perf_counter()
        if name == "flash_fp32":
            y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
            y = y.to(q.dtype)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        t1 = time.perf_counter()
        y.backward(torch.ones_like(y))
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 192, 256, 512, 1024])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=12)
    args = parser.parse_args()
    print(f"batch {args.batch}, {args.heads} heads of {args.head_dim}, bf16,"
          f" {torch.get_num_threads()} threads")
    print("T      backend     fwd_ms  bwd_ms  total_ms")
    for T in args.lengths:
        shape = (args.batch, args.heads, T, args.head_dim)
        q, k, v = (torch.randn(shape, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        for n in BACKENDS:
            time_backend(q, k, v, n)
        res: dict[str, list[tuple[float, float]]] = {n: [] for n in BACKENDS}
        names = list(BACKENDS)
        for r in range(args.reps):
            for n in names if r % 2 == 0 else names[::-1]:
                res[n].append(time_backend(q, k, v, n))
        for n, runs in res.items():
            fwd = 1000 * statistics.median(a for a, _ in runs)
            bwd = 1000 * statistics.median(b for _, b in runs)
            print(f"{T:<6} {n:<11} {fwd:7.2f} {bwd:7.2f} {fwd + bwd:8.2f}")


if __name__ == "__main__":
    main()
