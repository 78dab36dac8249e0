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


def clip_and_step(opt: torch.optim.Optimizer, params: list[torch.Tensor], max_norm: float) -> float:
    """Clip the gradients to global norm ``max_norm`` and take the optimiser step.

    Returns the norm before clipping; where it is not finite no step is taken
    (the caller skips the step). Fused AdamW divides every gradient by its
    ``grad_scale`` inside its one kernel, so there the clip's factor goes in as
    that scale instead of a separate pass over every gradient; other optimisers
    (and sharded gradients) are clipped in place first
    (``torch.nn.utils.clip_grads_with_norm_``). The same update up to round-off
    (a division by 1 / f instead of a product by f).
    """
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    total = float(norm)
    if not math.isfinite(total):
        return total
    coef = max_norm / (total + 1e-6)  # as torch.nn.utils.clip_grads_with_norm_ computes it
    # sharded (FSDP2) gradients are DTensors: those are clipped in place
    fused = bool(opt.defaults.get("fused")) and type(grads[0]).__name__ != "DTensor"
    if coef >= 1.0:
        pass
    elif fused:
        opt.grad_scale = torch.tensor(1.0 / coef, dtype=torch.float32, device=grads[0].device)
    else:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    try:
        opt.step()
    finally:
        opt.__dict__.pop("grad_scale", None)
    return total


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
