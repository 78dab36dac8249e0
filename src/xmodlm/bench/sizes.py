"""The sizes ``xmod bench`` measures, the model family at each, and how long to time them.

A size is a dense reference shape (width, heads, context, vocabulary, batch),
taken from a shipped preset. At every size the same family is built
(:func:`family_configs`): the dense reference, MoD, X-MoD at S = 4 and S = 8
with c = 1/8, and MoE, each FLOP-matched to the dense model as the sweeps do,
plus dense with X-MoD(S=4)'s depth (same total parameters).

``bench`` is the original benchmark size (width 512, context 1024, the
``bench-dense`` preset): large enough that a CPU step is dominated by matmuls.
The ``w*-t*`` sizes are the shapes the sweeps and studies actually train
(``micro`` and ``dense-tiny`` presets), where fixed per-op costs weigh more.

Time budgets, rounds and probe sizes are settings here, not numbers in the
code that runs them: :data:`SIZES` for each size, :data:`QUICK` for the smoke
mode, :data:`DEVICE_PEAK_N` for the matmul-peak probe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from xmodlm import flops, record
from xmodlm.config import ModelConfig, load_config
from xmodlm.errors import UserError

CAPACITY = 0.125  # c of every routed family in the bench
XMOD_STRIDES = (4, 8)


@dataclass(frozen=True)
class Timing:
    """How one size is timed.

    ``reps`` interleaved rounds at most; once ``budget_s`` seconds have passed
    since the first round started, stop after ``min_reps``. ``warmup`` untimed
    steps per model first (the first of a compiled model compiles it).
    """

    reps: int
    min_reps: int
    budget_s: float | None
    warmup: int = 1


@dataclass(frozen=True)
class BenchSize:
    """One size: a preset, the overrides that make the shape, the batch, the timing."""

    name: str
    preset: str
    overrides: tuple[str, ...]
    batch: int
    timing: Timing
    what: str

    def dense(self) -> ModelConfig:
        """The dense reference config of this size."""
        return load_config(self.preset, list(self.overrides)).model


# Budgets are sized so that a default run (every size, eager and compiled, one thread
# count) stays within about ten minutes on 2 CPU cores: at the bench size one round of
# all models takes about half a minute, at the small sizes a few seconds.
SIZES: dict[str, BenchSize] = {
    "bench": BenchSize(
        "bench", "bench-dense", (), batch=4,
        timing=Timing(reps=5, min_reps=3, budget_s=120.0),
        what="width 512, 8 heads, context 1024, batch 4 (preset bench-dense)",
    ),
    "w128-t128": BenchSize(
        "w128-t128", "micro", (), batch=16,
        timing=Timing(reps=10, min_reps=5, budget_s=20.0, warmup=2),
        what="width 128, 4 heads, context 128, batch 16 (preset micro: the sweeps' size)",
    ),
    "w128-t512": BenchSize(
        "w128-t512", "micro", ("model.context=512",), batch=4,
        timing=Timing(reps=10, min_reps=5, budget_s=20.0, warmup=2),
        what="width 128, 4 heads, context 512, batch 4 (preset micro at T = 512)",
    ),
    "w256-t256": BenchSize(
        "w256-t256", "dense-tiny", (), batch=8,
        timing=Timing(reps=8, min_reps=4, budget_s=30.0, warmup=2),
        what="width 256, 4 heads, context 256, batch 8 (preset dense-tiny)",
    ),
}
DEFAULT_SIZES = ("bench", "w128-t128", "w128-t512", "w256-t256")

# Smoke mode: the bench size shrinks to this shape and batch; every size takes a
# few rounds with no time budget and no compile.
QUICK_SHRINK = ("model.d_model=128", "model.n_heads=4", "model.context=256",
                "model.vocab_size=1024")
QUICK_BATCH = 2
QUICK = Timing(reps=3, min_reps=2, budget_s=None)
QUICK_SIZES = ("bench",)

# Matmul-peak probe: n x n x n, per round, in the dtype the steps run in.
DEVICE_PEAK_N = {"cuda": 8192, "cpu": 1024}
QUICK_PEAK_N = 512


def size_named(name: str, quick: bool = False) -> BenchSize:
    """The size called ``name``; in quick mode ``bench`` is shrunk to the smoke shape."""
    if name not in SIZES:
        raise UserError(f"unknown bench size {name!r}: choose from {', '.join(SIZES)}")
    size = SIZES[name]
    if quick and name == "bench":
        size = dataclasses.replace(
            size, overrides=QUICK_SHRINK, batch=QUICK_BATCH,
            what="quick: width 128, context 256, vocabulary 1024, batch 2",
        )
    if quick:
        size = dataclasses.replace(size, timing=QUICK)
    return size


def parse_sizes(text: str | Iterable[str] | None, quick: bool = False) -> list[str]:
    """Size names from ``"bench,w128-t128"`` (or a list); ``all`` means every size.

    None gives the default: every size, or only ``bench`` (shrunk) in quick mode.
    """
    if text is None:
        return list(QUICK_SIZES if quick else DEFAULT_SIZES)
    names = [s.strip() for s in (text.split(",") if isinstance(text, str) else text)]
    names = [n for n in names if n]
    if names == ["all"]:
        return list(SIZES)
    if not names:
        raise UserError(f"--sizes {text!r}: give one or more of {', '.join(SIZES)} (or all)")
    bad = [n for n in names if n not in SIZES]
    if bad:
        raise UserError(f"--sizes: unknown size {bad[0]!r}; choose from {', '.join(SIZES)}, all")
    return list(dict.fromkeys(names))


def parse_threads(text: str | Iterable[int] | None, default: int) -> list[int]:
    """Thread counts from ``"1,2"`` (or a list of ints); None gives ``[default]``."""
    if text is None:
        return [default]
    parts = text.split(",") if isinstance(text, str) else list(text)
    out: list[int] = []
    for part in parts:
        try:
            n = int(str(part).strip())
        except ValueError:
            n = 0
        if isinstance(part, bool) or n < 1:
            raise UserError(f"--threads {text!r}: give positive thread counts, e.g. 1,2")
        out.append(n)
    if not out:
        raise UserError(f"--threads {text!r}: give positive thread counts, e.g. 1,2")
    return list(dict.fromkeys(out))


def family_configs(dense: ModelConfig) -> dict[str, ModelConfig]:
    """The model family at ``dense``'s shape, keyed by the names used in the output.

    ``mod`` (record.MOD_RECIPE) and ``xmod_s{S}_c0125`` get the depth that
    FLOP-matches the dense model (:func:`flops.flop_match`); ``moe`` is the dense
    model with record.MOE_DEFAULTS experts, each of the width that keeps its
    active MLP FLOPs the dense MLP's; ``dense_same_params`` is the dense model
    with X-MoD(S=4)'s depth.
    """
    out = {"dense": dense}
    out["mod"], _ = flops.flop_match(dense, **record.MOD_RECIPE)
    for stride in XMOD_STRIDES:
        out[f"xmod_s{stride}_c0125"], _ = flops.flop_match(
            dense, stride=stride, capacity=CAPACITY, **record.XMOD_DEFAULTS
        )
    moe = dataclasses.replace(
        dense, mlp="moe", **record.MOE_DEFAULTS,
        moe_d_ff=record.moe_expert_dim(dense.ffn_dim, record.MOE_DEFAULTS["moe_top_k"]),
    )
    moe.validate()
    out["moe"] = moe
    out["dense_same_params"] = dataclasses.replace(dense, n_layers=out["xmod_s4_c0125"].n_layers)
    return out


def bench_configs(quick: bool = False) -> dict[str, ModelConfig]:
    """The model family at the ``bench`` size (shrunk in quick mode)."""
    return family_configs(size_named("bench", quick).dense())
