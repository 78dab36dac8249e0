"""The timed training step, and the interleaved rounds that time it.

A bench step *is* the trainer's step: :func:`xmodlm.train.trainer.train_step`
(forward and backward under the ``auto`` dtype on the total loss, auxiliary
losses included; gradient clipping; AdamW; ``zero_grad(set_to_none=True)``), on
one fixed batch of random tokens. So a speed-up measured here is one training
gets, and a change to the step shows up here without a second copy to update.
The reference models return ``(logits, loss)``; :class:`_AsModelOutput` hands
the trainer the output record it reads.

Rounds (:func:`interleave`) time one step of every model, plus a matmul-peak
probe, with the order reversed every other round (A B C, C B A, ...), so that
models listed next to each other are timed next to each other and a slow drift
in the machine's load cancels out of their ratio. Every figure is then the
median over rounds, with min and max; every ratio is the median of the
per-round ratios (a paired comparison), not a ratio of medians.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from xmodlm import flops
from xmodlm.bench.compile import MODES, CompiledBlocks, compile_model
from xmodlm.bench.gpt2 import GPT2Reference, gpt2_counts
from xmodlm.bench.reference_gpt import ReferenceGPT, reference_optimizer
from xmodlm.config import ModelConfig, TrainConfig
from xmodlm.hardware import measure_matmul_gflops, resolve_dtype
from xmodlm.model import Transformer
from xmodlm.model.transformer import ModelOutput
from xmodlm.train.optim import build_optimizer
from xmodlm.train.trainer import train_step

LR = 1e-4  # small: timings must not depend on the random-data run diverging
KINDS = ("ours", "gpt2", "reference")  # which model class a case builds


class _AsModelOutput(nn.Module):
    """A reference model's ``(logits, loss)`` as the :class:`ModelOutput` the trainer reads."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.blocks = model.blocks  # so that CompiledBlocks finds them

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> ModelOutput:
        logits, loss = self.model(x, y)
        # the output contract of ours (Transformer.forward): with targets, logits detached
        return ModelOutput(logits=logits.detach(), loss=loss)


@dataclasses.dataclass
class Case:
    """One model being timed: its step, what it costs analytically, its times."""

    name: str
    cfg: ModelConfig
    model: nn.Module
    step: Callable[[], dict[str, Any]]
    flops_per_token: float
    params_total: int
    tokens_per_step: int
    mode: str = "eager"
    opt: torch.optim.Optimizer | None = None  # shared by the model's cases in every mode
    batch: tuple[torch.Tensor, torch.Tensor] | None = None  # (x, y), shared likewise
    first_step_s: float | None = None  # the first (warm-up) step: compiles, when compiled
    times: list[float] = dataclasses.field(default_factory=list)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def make_case(
    name: str,
    cfg: ModelConfig,
    batch: int,
    device: torch.device,
    kind: str = "ours",
    mode: str = "eager",
    base: Case | None = None,
) -> Case:
    """Build one model of ``kind`` (:data:`KINDS`) in ``mode`` (:data:`~xmodlm.bench.compile.MODES`)
    with its optimiser and a fixed batch.

    ``ours`` is :class:`Transformer` with the trainer's optimiser; ``gpt2`` the
    GPT-2 reference with the same optimiser (so that the comparison is of
    architectures); ``reference`` the plain :class:`ReferenceGPT` with its plain
    AdamW, always eager. Weights and tokens are seeded, so every case of one
    config starts identical.

    ``base``, the eager case of the same model: a compiled case then runs *its*
    model, optimiser and batch rather than a copy. A step costs the same either way,
    and the bench holds one copy of each model's state, not one per mode: at the
    bench size the models with AdamW's two moments are about 3 GB a copy.
    """
    assert kind in KINDS and mode in MODES, (kind, mode)
    if base is None:
        model, opt, fpt, params = _build(cfg, kind, device)
        gen = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.context + 1), generator=gen)
        xy = tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)
    else:
        assert base.mode == "eager" and base.tokens_per_step == batch * cfg.context, base
        model, opt, xy = base.model, base.opt, base.batch
        fpt, params = base.flops_per_token, base.params_total
    runs, switch = model, None
    if mode == "compiled":
        switch = CompiledBlocks(model)  # says so if some blocks (MoE) stay eager
        mode = switch.mode
    elif mode == "compiled_model":
        runs = compile_model(model)  # the optimiser holds the same parameters
    dtype = resolve_dtype("auto", device)
    grad_clip = TrainConfig(lr=LR).grad_clip

    def step() -> dict[str, Any]:
        with switch.active() if switch is not None else contextlib.nullcontext():
            return train_step(runs, opt, lambda _: xy, 1, dtype=dtype, grad_clip=grad_clip,
                              device=device)

    return Case(name=name, cfg=cfg, model=model, step=step, flops_per_token=fpt,
                params_total=params, tokens_per_step=batch * cfg.context, mode=mode,
                opt=opt, batch=xy)


def _build(cfg: ModelConfig, kind: str, device: torch.device
           ) -> tuple[nn.Module, torch.optim.Optimizer, float, int]:
    """A fresh seeded model of ``kind``, its optimiser, FLOPs per token and parameters."""
    torch.manual_seed(0)
    model: nn.Module
    if kind == "ours":
        model = Transformer(cfg).to(device)
        opt = build_optimizer(model, TrainConfig(lr=LR))
        return model, opt, flops.count(cfg).flops_train, flops.count(cfg).params_total
    if kind == "gpt2":
        model = _AsModelOutput(GPT2Reference(cfg).to(device))
        opt = build_optimizer(model.model, TrainConfig(lr=LR))
        counts = gpt2_counts(cfg)
        return model, opt, counts.flops_train, counts.params_total
    model = _AsModelOutput(ReferenceGPT(cfg).to(device))
    opt = reference_optimizer(model.model, lr=LR)
    return model, opt, flops.count(cfg).flops_train, flops.count(cfg).params_total


def _timed(case: Case, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    case.step()
    sync(device)
    return time.perf_counter() - t0


def interleave(
    cases: list[Case],
    device: torch.device,
    *,
    reps: int,
    min_reps: int,
    warmup: int,
    peak_n: int,
    budget_s: float | None,
) -> tuple[list[float], list[float]]:
    """Warm up every case, then up to ``reps`` rounds over all of them.

    Rounds alternate the order forwards and backwards. Once ``budget_s``
    seconds have passed since the first round began, stops after ``min_reps``
    rounds. Returns the per-round bf16 and fp32 matmul throughputs (GFLOP/s);
    bf16 is measured only where the steps run in bf16 (emulated bf16 takes
    seconds a matmul, and the list is empty then). A case's first warm-up step
    is kept as ``first_step_s`` (for a compiled case, its compile time).
    """
    with_bf16 = resolve_dtype("auto", device) == "bf16"
    for case in cases:
        case.times.clear()
        for i in range(warmup):
            t = _timed(case, device)
            if i == 0 and case.first_step_s is None:
                case.first_step_s = t
    peak_bf16: list[float] = []
    peak_fp32: list[float] = []
    t_start = time.perf_counter()
    for r in range(reps):
        order = cases if r % 2 == 0 else cases[::-1]
        if with_bf16:
            peak_bf16.append(measure_matmul_gflops(torch.bfloat16, device, peak_n, tries=3))
        for case in order:
            case.times.append(_timed(case, device))
        peak_fp32.append(measure_matmul_gflops(torch.float32, device, peak_n, tries=3))
        if budget_s is not None and r + 1 >= min_reps and time.perf_counter() - t_start > budget_s:
            break
    return peak_bf16, peak_fp32


def step_figures(case: Case, peak: list[float]) -> dict[str, Any]:
    """Time, throughput and MFU of ``case`` against ``peak``, the per-round matmul
    peak (GFLOP/s) in the dtype the steps run in."""
    tok_s = [case.tokens_per_step / t for t in case.times]
    mfu = [
        case.flops_per_token * case.tokens_per_step / t / (p * 1e9)
        for t, p in zip(case.times, peak, strict=True)
    ]
    return {
        "mode": case.mode,
        "ms": summary([1000 * t for t in case.times]),
        "tokens_per_s": statistics.median(tok_s),
        "mfu": summary(mfu),
        "reps": len(case.times),
    }


def ratio(num: Case, den: Case) -> dict[str, float]:
    """Per-round time ratio num / den, summarised."""
    return summary([a / b for a, b in zip(num.times, den.times, strict=True)])


def versus(num: Case, den: Case) -> dict[str, Any]:
    """``num`` against ``den``: paired time ratio, FLOP ratio, and time per FLOP.

    ``time_per_flop_ratio`` is the time ratio over the FLOP ratio: above 1, a
    FLOP of ``num`` costs more time than one of ``den``.
    """
    flop_ratio = num.flops_per_token / den.flops_per_token
    times = ratio(num, den)
    return {
        "time_ratio": times,
        "flop_ratio": flop_ratio,
        "time_per_flop_ratio": {k: v / flop_ratio for k, v in times.items()},
        "params_ratio": num.params_total / den.params_total,
        "modes": {num.name: num.mode, den.name: den.mode},
    }
