"""Depth-router kinds: how a sparse block decides, causally, which tokens it processes.

Every sparse block has a router weight w (d -> 1). Its logit r = x . w ranks the
tokens of a sequence for expert-choice top-k in training and feeds the gate; that
part is the same for every kind. Top-k looks at future tokens, so inference needs
a decision made from each token alone: a *decision logit*, compared with the
block's threshold (:class:`~xmodlm.model.depth_router.DepthRouter`, which holds
the router weight and the threshold and runs the kind). A kind owns:

* its decision logit (:meth:`DepthRouterKind.decision_logits`), trained with BCE
  toward top-k membership;
* the weights it adds, if any (:meth:`DepthRouterKind.build_head`);
* its weight-decay rule (:meth:`DepthRouterKind.decays`);
* its cost: parameters and forward FLOPs per token beyond the router weight
  (:meth:`DepthRouterKind.extra_params`, :meth:`DepthRouterKind.extra_flops`).

Kinds are plain classes that import no torch at load time, so FLOP accounting
(``xmodlm.flops``, arithmetic on configs) can ask them for their cost; the
weights a kind adds are built on demand. A new kind is one module in this
package defining one subclass with a unique ``name``: it is found by
:func:`kinds` and selected with ``model.causal_router: NAME``.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from torch import Tensor, nn


class DepthRouterKind:
    """One way of making the causal routing decision (see the module docstring).

    An instance is bound to a model width ``d_model``.
    """

    name: ClassVar[str]
    # True when the decision logit is the router logit itself: a decoder can then
    # score a run of sparse blocks in one matmul (the stream is the same for every
    # block it skips)
    decides_by_router_logit: ClassVar[bool] = False

    def __init__(self, d_model: int) -> None:
        self.d_model = d_model

    def extra_params(self) -> int:
        """Parameters the kind adds to a sparse block, beyond the router weight."""
        return 0

    def extra_flops(self) -> float:
        """Forward FLOPs per token the kind adds (it runs on every token), beyond r = x . w."""
        return 0.0

    def build_head(self) -> nn.Module | None:
        """The weights the kind adds (None: the decision uses the router logit alone)."""
        return None

    def decision_logits(self, head: Any, x_BTD: Tensor, r_BT: Tensor) -> Tensor:
        """The (B, T) fp32 decision logit; the caller runs this with autocast off."""
        raise NotImplementedError

    def decays(self, local_name: str, ndim: int) -> bool:
        """Whether weight decay applies to the router's parameter ``local_name``
        (``weight``, the router vector, or ``head.*``)."""
        return False


def kinds() -> dict[str, type[DepthRouterKind]]:
    """Every kind in this package, by name (each module is imported once)."""
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
    found: dict[str, type[DepthRouterKind]] = {}
    stack = list(DepthRouterKind.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if "name" in cls.__dict__:
            assert cls.name not in found, f"two depth-router kinds are named {cls.name!r}"
            found[cls.name] = cls
    return found


def make_kind(name: str, d_model: int) -> DepthRouterKind:
    """The kind ``name`` bound to width ``d_model`` (config validation names the choices)."""
    return kinds()[name](d_model)
