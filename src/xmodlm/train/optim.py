"""AdamW with decay / no-decay groups, and learning-rate schedules."""

from __future__ import annotations

import math

import torch
from torch import nn

from xmodlm.config import TrainConfig
from xmodlm.model.depth_router import DepthRouter

NO_DECAY_SUFFIXES = ("embed.weight", "mlp.router.weight")


def decays(name: str, p: torch.Tensor) -> bool:
    """Whether weight decay applies to parameter ``name`` (outside a depth router,
    which states its own rule: :meth:`DepthRouter.decays`).

    Weight matrices decay. Not decayed, because decay would shrink a scale the
    model needs rather than regularise a map:

    * vectors and scalars: norm gains, biases, the variance-scaled gates' gamma
      (decay would pull every sparse branch toward zero);
    * the embedding table (rows of rare tokens would decay to nothing);
    * the MoE router, whose logits the z-loss keeps small.
    """
    return p.dim() >= 2 and not name.endswith(NO_DECAY_SUFFIXES)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    """Two AdamW groups, decayed and not: each depth router's parameters by its own
    rule, every other parameter by :func:`decays`."""
    router_rule: dict[int, bool] = {}
    for module in model.modules():
        if isinstance(module, DepthRouter):
            for local, p in module.named_parameters():
                router_rule[id(p)] = module.decays(local, p)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if router_rule.get(id(p), decays(name, p)):
            decay.append(p)
        else:
            no_decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW, fused where the platform supports it (one kernel over all parameters)."""
    groups = param_groups(model, cfg.weight_decay)
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, foreach=True, **kwargs)


def lr_at(step: int, total_steps: int, cfg: TrainConfig) -> float:
    """Learning rate for optimiser step ``step`` (0-based) of ``total_steps``.

    Linear warmup, then ``cosine`` decay to ``min_lr_ratio * lr``, or ``wsd``
    (warmup-stable-decay: constant, then a linear cooldown over the last
    ``cooldown_frac`` of the steps), or ``constant``.
    """
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    warmup = min(cfg.warmup_steps, max(0, total_steps - 1))
    if step < warmup:
        return peak * (step + 1) / warmup
    if cfg.schedule == "constant":
        return peak
    if cfg.schedule == "cosine":
        span = max(1, total_steps - warmup)
        progress = min(1.0, (step - warmup) / span)
        return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))
    cooldown = max(1, round(cfg.cooldown_frac * total_steps))
    start = total_steps - cooldown
    if step < start:
        return peak
    progress = min(1.0, (step - start + 1) / cooldown)
    return peak + (floor - peak) * progress
