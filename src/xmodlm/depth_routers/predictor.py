"""``predictor``: a small MLP on stop-gradient inputs makes the causal decision.

A classifier d_model -> d_model / 4 -> 1 (SiLU) reads the block's input with its
gradient stopped and is trained with BCE toward top-k membership, so it never
touches the LM loss or the router; the price is its parameters and the FLOPs it
runs on every token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from xmodlm.depth_routers import DepthRouterKind

if TYPE_CHECKING:
    from torch import Tensor, nn

HIDDEN_DIV = 4  # the hidden width is d_model / 4


class Predictor(DepthRouterKind):
    name = "predictor"

    @property
    def hidden(self) -> int:
        return max(1, self.d_model // HIDDEN_DIV)

    def extra_params(self) -> int:
        return self.d_model * self.hidden + self.hidden + self.hidden + 1

    def extra_flops(self) -> float:
        return 2.0 * self.d_model * self.hidden + 2.0 * self.hidden

    def build_head(self) -> nn.Module:
        from torch import nn  # here, not at load: FLOP accounting reads this module

        head = nn.Sequential(
            nn.Linear(self.d_model, self.hidden), nn.SiLU(), nn.Linear(self.hidden, 1)
        )
        for layer in head:  # weights: the model's normal init; biases start at zero
            if isinstance(layer, nn.Linear):
                nn.init.zeros_(layer.bias)
        return head

    def decision_logits(self, head: Any, x_BTD: Tensor, r_BT: Tensor) -> Tensor:
        return head(x_BTD.detach().float()).squeeze(-1)

    def decays(self, local_name: str, ndim: int) -> bool:
        """The MLP's matrices decay like any MLP's (a classifier whose scale gates
        nothing); its biases and the router vector do not."""
        return local_name.startswith("head.") and ndim >= 2
