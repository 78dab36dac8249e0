"""``bce``: the router's own logit is the causal decision (the default).

The router logit r that ranks tokens for top-k is also taught, with BCE, to say
from each token alone whether top-k would pick it. Nothing is added: the
decision costs no parameter and no FLOP beyond the router every sparse block
already runs. The BCE shares the router with the LM loss (it shapes the gate's
input too), which is why its coefficient is small.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from xmodlm.depth_routers import DepthRouterKind

if TYPE_CHECKING:
    from torch import Tensor


class RouterLogit(DepthRouterKind):
    name = "bce"
    decides_by_router_logit = True

    def decision_logits(self, head: Any, x_BTD: Tensor, r_BT: Tensor) -> Tensor:
        return r_BT

    def decays(self, local_name: str, ndim: int) -> bool:
        """The router vector never decays: its logit *is* the gate's input, so decay
        would shrink (``logit`` gate) or flatten toward 1/2 (``sigmoid``) the gate
        and blur the top-k ranking."""
        return False
