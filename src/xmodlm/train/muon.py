"""Muon: momentum SGD whose update matrix is orthogonalised (Newton-Schulz) before
it is applied, for the hidden layers' weight matrices.

The update rule is ``torch.optim.Muon``'s with ``adjust_lr_fn="match_rms_adamw"``
(the paper's Table 5 setting): ``B = mu B + (1 - mu) g``; Nesterov ``u = (1 - mu) g
+ mu B``; ``O = NS_k(u)``; ``W <- W (1 - lr wd) - lr rms sqrt(max(A, B)) O``, so an
update's RMS is about ``rms`` x lr, what AdamW's typically is, and one learning rate
and weight decay serve both optimisers. A test holds this class to torch's on 2-D
matrices. It is its own class rather than torch's because torch's does not fit
three things this project needs:

* stacked weights: torch's takes 2-D parameters only; here the last two dimensions
  are the matrix and any leading ones a batch, so an ``(E, d, f)`` expert tensor is
  E matrices, each orthogonalised and scaled on its own;
* FSDP2: a sharded parameter's gradient is a DTensor shard. Newton-Schulz on it
  would redistribute inside every matmul and round differently from one process;
  here each matrix is gathered once, orthogonalised whole (identically on every
  rank) and each rank keeps its own shard of the result, so a sharded run makes the
  unsharded run's update;
* ``train.muon_rms_match`` and the iteration's precision are settings (torch fixes
  0.2 and bf16). Newton-Schulz runs in bf16 when the run trains in bf16 (the usual
  choice: fast, and the iteration tolerates it) and in fp32 when it trains in fp32,
  where exactness is the point.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic: chosen for the steepest slope at zero, so that five steps
bring every singular value into a band around 1 (not exactly to 1, which Muon does
not need)."""


def orthogonalise(g: torch.Tensor, steps: int, dtype: torch.dtype, eps: float = 1e-7) -> torch.Tensor:
    """About ``U V^T`` for each matrix ``U S V^T`` of ``g`` (its last two dimensions), by
    ``steps`` quintic Newton-Schulz iterations in ``dtype``; same shape as ``g``.

    Each matrix is first divided by its Frobenius norm, which bounds its spectral
    norm by 1, where the iteration converges. It runs on the wide orientation
    (rows <= columns), so the Gram matrix is the small one.
    """
    shape = g.shape
    x = g.to(dtype)
    tall = shape[-2] > shape[-1]
    if tall:
        x = x.mT
    flat = x.dim() > 2
    if flat:  # any leading dimensions: one batch of matrices
        x = x.reshape(-1, *x.shape[-2:])
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    mm = torch.baddbmm if flat else torch.addmm
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.mT
        poly = mm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2
        x = mm(x, poly, x, beta=a)  # a X + (b G + c G^2) X
    if flat:
        x = x.reshape(*shape[:-2], *x.shape[-2:])
    return x.mT if tall else x


def _orthogonalise_whole(u: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """:func:`orthogonalise` of the whole matrix, also when ``u`` is a DTensor shard
    (FSDP2): gathered once, orthogonalised on every rank alike, this rank's shard kept."""
    if type(u).__name__ != "DTensor":  # (torch.distributed may be absent: no import)
        return orthogonalise(u, steps, dtype)
    from torch.distributed.tensor import distribute_tensor

    whole = orthogonalise(u.full_tensor(), steps, dtype)
    return distribute_tensor(whole, u.device_mesh, u.placements, src_data_rank=None)


class Muon(torch.optim.Optimizer):
    """Muon for parameters of two or more dimensions (the last two: the matrix).

    ``lr`` and ``weight_decay`` mean what they mean for AdamW (decoupled decay
    ``W <- W (1 - lr wd)``); ``rms_match`` scales each matrix's update to an RMS of
    ``rms_match x lr``; ``ns_dtype`` is the Newton-Schulz precision.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        rms_match: float = 0.2,
        ns_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, rms_match=rms_match)
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            for p in group["params"]:
                assert p.dim() >= 2, f"Muon trains matrices, got a parameter of shape {tuple(p.shape)}"

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, mu = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                u = p.grad.lerp(buf, mu) if group["nesterov"] else buf
                o = _orthogonalise_whole(u, group["ns_steps"], self.ns_dtype)
                scale = group["rms_match"] * math.sqrt(max(p.shape[-2], p.shape[-1]))
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(o, alpha=-lr * scale)
        return loss
