"""MoE dispatch: the sorted path against the per-expert loop reference, forward + backward.

Why :class:`xmodlm.model.moe.MoEMLP` dispatches by sorting the assignments by
expert (one gather, contiguous slices, one ``index_add``) rather than looping over
experts with a mask each: with fine-grained experts (E = 64, top 6) the loop pays
E mask-and-nonzero passes and E scatters per layer. Both paths run the same
expert matmuls. Paired, interleaved rounds on one layer of width d, fine router,
2 shared experts, expert width d / 2 (G = 8 of a 4d-wide FFN); medians in ms.
``python benchmarks/moe_dispatch.py [--widths 128 256] [--tokens 4096] [--dtype bf16]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from xmodlm.model.moe import MoEMLP


def step_seconds(layer: MoEMLP, x: torch.Tensor, dispatch: str, dtype: torch.dtype) -> float:
    """Seconds of one forward and backward of ``layer`` through ``dispatch``."""
    layer.dispatch = dispatch
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        y, aux = layer(x)
        loss = y.float().pow(2).mean() + aux["moe_balance"]
    loss.backward()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per step (B T)")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    args = parser.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    print(f"threads {torch.get_num_threads()}, {args.tokens} tokens, E {args.experts}"
          f" top {args.top_k} + 2 shared, {args.dtype}")
    print(f"{'width':>6} {'d_e':>5} {'sorted ms':>10} {'loop ms':>9} {'loop/sorted':>12}")
    for d in args.widths:
        torch.manual_seed(0)
        layer = MoEMLP(d, d // 2, args.experts, args.top_k, router="fine", n_shared=2,
                       bias_rate=1e-3)
        x = torch.randn(1, args.tokens, d, requires_grad=True)
        times: dict[str, list[float]] = {"sorted": [], "loop": []}
        for i in range(args.rounds + 2):
            for name in (("sorted", "loop") if i % 2 else ("loop", "sorted")):
                t = step_seconds(layer, x, name, dtype)
                if i >= 2:  # two warm-up rounds
                    times[name].append(t)
        s, lp = (1e3 * statistics.median(times[k]) for k in ("sorted", "loop"))
        print(f"{d:>6} {d // 2:>5} {s:>10.1f} {lp:>9.1f} {lp / s:>12.2f}")


if __name__ == "__main__":
    main()
