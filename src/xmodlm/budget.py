"""How long a run trains and what batch makes a step, from its resolved config.

Above :mod:`xmodlm.config` and :mod:`xmodlm.flops`: a compute budget turns into
tokens through the model's FLOPs per token, so the rule reads both, and the trainer
and a sweep's plan (which must count the same steps) both read it here.
"""

from __future__ import annotations

from dataclasses import dataclass

from xmodlm import flops
from xmodlm.config import Config, TrainConfig
from xmodlm.errors import UserError


@dataclass
class Budget:
    """How long a run trains: its optimiser steps, the tokens each step takes (on all
    ranks) and which setting set them (max_steps, tokens or compute), and the batch
    that makes a step: ``batch_size`` sequences per micro-batch, ``grad_accum``
    micro-batches, per rank."""

    total_steps: int
    tokens_per_step: int
    source: str
    batch_size: int = 1
    grad_accum: int = 1


def resolve_budget(cfg: Config, world_size: int) -> Budget:
    """Steps from train.max_steps, else the token budget, else compute C (D = C / F);
    the batch from train.batch_tokens (:func:`step_batch`). Here, beside the settings
    it reads, because the trainer and a sweep's plan must count the same steps."""

    t = cfg.train
    batch_size, grad_accum = step_batch(t, cfg.model.context, world_size)
    per_step = batch_size * grad_accum * world_size * cfg.model.context
    if t.max_steps > 0:
        return Budget(t.max_steps, per_step, "max_steps", batch_size, grad_accum)
    if t.tokens > 0:
        tokens, source = float(t.tokens), "tokens"
    elif t.compute > 0:
        tokens, source = t.compute / flops.count(cfg.model).flops_train, "compute"
    else:
        raise UserError(
            "no training budget: set train.max_steps, train.tokens or train.compute (FLOPs)"
        )
    steps = int(tokens // per_step)
    if steps < 1:
        raise UserError(
            f"train.{source} gives {tokens:.3g} tokens, less than one batch of {per_step} tokens"
            " (batch_size x grad_accum x ranks x context): raise the budget or shrink the batch"
        )
    return Budget(steps, per_step, source, batch_size, grad_accum)


def step_batch(t: TrainConfig, context: int, world_size: int) -> tuple[int, int]:
    """(sequences per micro-batch, micro-batches) per rank for one optimiser step.

    Without ``batch_tokens``: ``batch_size`` and ``grad_accum`` as given. With it, a
    step holds ``batch_tokens / context`` sequences whatever the context (the paper
    keeps about 2.5M tokens per step at every L), split evenly over the ranks; the
    micro-batch is the largest divisor of a rank's share that is at most
    ``batch_size`` (the memory cap), and ``grad_accum`` makes up the rest.
    """
    if t.batch_tokens <= 0:
        return t.batch_size, t.grad_accum
    per_rank, left = divmod(t.batch_tokens, context * world_size)
    if left or not per_rank:
        raise UserError(
            f"train.batch_tokens={t.batch_tokens} is not a multiple of context x ranks ="
            f" {context} x {world_size}: choose a multiple of {context * world_size}"
        )
    micro = max(d for d in range(1, min(t.batch_size, per_rank) + 1) if per_rank % d == 0)
    return micro, per_rank // micro
