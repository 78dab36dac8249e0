"""The optimiser (AdamW with decay / no-decay groups, or Muon with AdamW), gradient
clipping and learning-rate schedules."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from xmodlm.config import TrainConfig
from xmodlm.model.depth_router import DepthRouter
from xmodlm.train.muon import Muon

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


def param_groups(
    model: nn.Module, weight_decay: float, skip: frozenset[int] = frozenset()
) -> list[dict[str, object]]:
    """Two AdamW groups, decayed and not: each depth router's parameters by its own
    rule, every other parameter by :func:`decays`; parameters whose ``id`` is in
    ``skip`` (Muon's) are left out."""
    router_rule: dict[int, bool] = {}
    for module in model.modules():
        if isinstance(module, DepthRouter):
            for local, p in module.named_parameters():
                router_rule[id(p)] = module.decays(local, p)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in skip:
            continue
        if router_rule.get(id(p), decays(name, p)):
            decay.append(p)
        else:
            no_decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def trained_by_muon(name: str, p: torch.Tensor) -> bool:
    """Whether ``train.optimizer=muon`` gives parameter ``name`` to Muon (else AdamW).

    Muon orthogonalises an update matrix: right for the hidden layers' weight
    matrices (attention q/k/v/o, the MLP's and each expert's), which map one hidden
    space to another. AdamW keeps the rest, as in the paper:

    * the token embedding and the LM head: a lookup and a per-token readout, whose
      rows are updated (or matter) one token at a time, not as one linear map;
    * norm gains, gate gammas, biases: vectors and scalars, no matrix;
    * routers of any kind, every parameter under a module named ``router`` (the
      depth routers ``blocks.*.router.*`` with their heads, the MoE's
      ``mlp.router.*``): each row scores a token or an expert, and orthogonalising
      would equalise exactly the scales routing decides by.
    """
    parts = name.split(".")
    return p.dim() >= 2 and parts[0] == "blocks" and "router" not in parts[:-1]


def build_optimizer(
    model: nn.Module, cfg: TrainConfig, ns_dtype: torch.dtype = torch.bfloat16
) -> torch.optim.Optimizer | MuonAdamW:
    """AdamW (``train.optimizer=adamw``), or Muon on the parameters
    :func:`trained_by_muon` picks and AdamW on the rest (``muon``; ``ns_dtype``:
    its Newton-Schulz precision). Peak learning rates: :func:`peak_lrs`."""
    if cfg.optimizer == "adamw":
        return _adamw(param_groups(model, cfg.weight_decay), cfg, cfg.lr)
    hidden = [p for n, p in model.named_parameters() if p.requires_grad and trained_by_muon(n, p)]
    muon = Muon(
        hidden, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum,
        nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps, rms_match=cfg.muon_rms_match,
        ns_dtype=ns_dtype,
    )
    rest = param_groups(model, cfg.weight_decay, skip=frozenset(id(p) for p in hidden))
    return MuonAdamW(muon, _adamw(rest, cfg, peak_lrs(cfg)[1]))


def _adamw(groups: list[dict[str, Any]], cfg: TrainConfig, lr: float) -> torch.optim.AdamW:
    """AdamW, fused where the platform supports it (one kernel over all parameters)."""
    kwargs = dict(lr=lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, foreach=True, **kwargs)


def peak_lrs(cfg: TrainConfig) -> tuple[float, float]:
    """(Muon's, AdamW's) peak learning rates under ``train.optimizer=muon``.

    Muon's is ``train.lr``; AdamW's is ``train.adamw_lr``, or ``train.lr`` when that
    is 0. The paper does not give AdamW's; the same value is the natural default
    because Muon's update is scaled to AdamW's RMS (``muon_rms_match``), which is
    what lets one learning rate (and one weight decay) serve both.
    """
    return cfg.lr, cfg.adamw_lr or cfg.lr


class MuonAdamW:
    """Muon and AdamW as the one optimiser the trainer, the checkpoints and the
    schedule see: one ``step``, ``zero_grad``, ``param_groups`` (Muon's first) and
    state dict (``{"muon": ..., "adamw": ...}``), so a resumed run restores both.

    Iterating yields the two optimisers, which is how
    ``torch.distributed.checkpoint`` takes several (the FSDP2 state by name).
    """

    def __init__(self, muon: Muon, adamw: torch.optim.AdamW) -> None:
        self.muon, self.adamw = muon, adamw

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter((self.muon, self.adamw))

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.muon.param_groups + self.adamw.param_groups

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if set(saved) != {"muon", "adamw"}:
            raise ValueError("its optimizer state is not train.optimizer=muon's")
        self.muon.load_state_dict(saved["muon"])
        self.adamw.load_state_dict(saved["adamw"])


def clip_and_step(
    opt: torch.optim.Optimizer | MuonAdamW, params: list[torch.Tensor], max_norm: float
) -> float:
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
    fused = isinstance(opt, torch.optim.Optimizer) and bool(opt.defaults.get("fused"))
    fused = fused and type(grads[0]).__name__ != "DTensor"
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


def set_lr(opt: torch.optim.Optimizer | MuonAdamW, step: int, total_steps: int,
           cfg: TrainConfig) -> float:
    """Set every group's learning rate for ``step``: one schedule, each optimiser
    scaled to its own peak (:func:`peak_lrs`). Returns ``train.lr``'s (the logged one)."""
    parts = zip(opt, peak_lrs(cfg), strict=True) if isinstance(opt, MuonAdamW) else [(opt, cfg.lr)]
    for part, peak in parts:
        lr = lr_at(step, total_steps, cfg, peak)
        for group in part.param_groups:
            group["lr"] = lr
    return lr_at(step, total_steps, cfg)


def lr_at(step: int, total_steps: int, cfg: TrainConfig, peak: float | None = None) -> float:
    """Learning rate for optimiser step ``step`` (0-based) of ``total_steps``, peaking
    at ``peak`` (default ``train.lr``).

    Linear warmup (:meth:`TrainConfig.warmup` steps), then ``cosine`` decay to
    ``min_lr_ratio * peak``, or ``wsd`` (warmup-stable-decay: constant, then a linear
    cooldown over the last ``cooldown_frac`` of the steps), or ``constant``.
    """
    peak = cfg.lr if peak is None else peak
    floor = peak * cfg.min_lr_ratio
    warmup = min(cfg.warmup(total_steps), max(0, total_steps - 1))
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
