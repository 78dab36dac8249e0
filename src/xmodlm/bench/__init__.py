"""``xmod bench``: speed figures of the model family, measured side by side in one run.

Everything is a ratio or a rate measured *in the same process, interleaved*,
at several sizes: the ``bench`` size (width 512, context 1024) and the small
sizes the sweeps train (``w128-t128``, ``w128-t512``, ``w256-t256``). At each
size, the dense model, MoD, X-MoD (S = 4 and 8, c = 1/8) and MoE, FLOP-matched
to dense, the GPT-2 reference and the plain reference GPT take one full
training step each per round, eager, with their blocks compiled and compiled
whole (as ``train.compile=on`` runs), at each
thread count asked for. Ratios are medians of per-round ratios.

The package, by responsibility:

* :mod:`~xmodlm.bench.sizes`: the sizes, the family at each, time budgets;
* :mod:`~xmodlm.bench.step`: the timed step (the trainer's own) and the rounds;
* :mod:`~xmodlm.bench.compile`: per-block and whole-model ``torch.compile`` and which mode won;
* :mod:`~xmodlm.bench.gpt2`: the GPT-2-architecture reference model;
* :mod:`~xmodlm.bench.reference_gpt`: the plain reference GPT, written the textbook way;
* :mod:`~xmodlm.bench.overhead`: the profiler's share of a step spent routing;
* :mod:`~xmodlm.bench.decode`: decode speed and the router calibration it needs;
* :mod:`~xmodlm.bench.law_fit`: seconds for one full law fit on synthetic runs;
* :mod:`~xmodlm.bench.targets`: what the figures should reach;
* :mod:`~xmodlm.bench.run`: :func:`run_bench`, which puts them together.

The method, the machine and the figures measured on it are in ``docs/benchmarks.md``.
"""

from __future__ import annotations

from xmodlm.bench.compile import CompiledBlocks
from xmodlm.bench.decode import calibrate_untrained_, decode_benchmark
from xmodlm.bench.gpt2 import GPT2Reference, gpt2_counts
from xmodlm.bench.run import run_bench
from xmodlm.bench.sizes import SIZES, bench_configs, family_configs, parse_sizes, parse_threads
from xmodlm.bench.targets import TARGETS

__all__ = [
    "SIZES",
    "TARGETS",
    "GPT2Reference",
    "bench_configs",
    "calibrate_untrained_",
    "CompiledBlocks",
    "decode_benchmark",
    "family_configs",
    "gpt2_counts",
    "parse_sizes",
    "parse_threads",
    "run_bench",
]
