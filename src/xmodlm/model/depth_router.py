"""A sparse block's depth router: the router weight, the causal decision and its threshold.

The router logit r = x . w (fp32) ranks a sequence's tokens for top-k in training
and feeds the gate. At inference a token is processed iff its *decision logit*
exceeds the block's threshold; what the decision logit is (the router's own
logit, a predictor's...) is the router's kind (:mod:`xmodlm.depth_routers`),
which also says what weights it adds, how they decay and what they cost.

The threshold rule (``model.causal_threshold``):

* ``calibrated`` (default): the threshold is set by :meth:`DepthRouter.calibrate_`
  so that the block routes exactly the fraction c of a calibration text, the
  capacity it was trained at (the stack calibrates block by block under causal
  routing: ``Transformer.calibrate_thresholds_``). The threshold is a buffer, so
  it travels in every checkpoint and export. Until a router is calibrated its
  threshold is 0, the ``half`` rule.
* ``half``: decision logit > 0, i.e. sigmoid(r) > 1/2 for the router's own logit.
  Trained toward top-k membership with BCE, that routes more than c (14.5-28% at
  c = 12.5% in the reference study), so inference spends more than training
  budgeted.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from xmodlm.config import CAUSAL_THRESHOLDS
from xmodlm.depth_routers import DepthRouterKind, make_kind
from xmodlm.model import routing


class DepthRouter(nn.Module):
    """Router weight, the kind's decision head, and the calibrated threshold."""

    def __init__(self, d_model: int, kind: str, rule: str) -> None:
        super().__init__()
        assert rule in CAUSAL_THRESHOLDS, rule
        self.kind: DepthRouterKind = make_kind(kind, d_model)
        self.rule = rule
        # (1, d) like the nn.Linear(d, 1) it replaces, initialised the same way (the
        # stack re-initialises it; the same draws keep model init unchanged)
        self.weight = nn.Parameter(torch.empty(1, d_model))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.head = self.kind.build_head()
        # shape (1,), not 0-d: FSDP2 shards along dim 0
        self.register_buffer("threshold", torch.zeros(1))
        self.register_buffer("calibrated", torch.zeros(1, dtype=torch.bool))

    def logits(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """r = x . w in fp32, whatever the autocast dtype (:func:`routing.router_logits`)."""
        return routing.router_logits(x_BTD, self.weight)

    def decision_logits(
        self, x_BTD: torch.Tensor, r_BT: torch.Tensor, shift_BT: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The kind's (B, T) decision logit, in fp32. ``r_BT`` already carries the
        token-choice bias ``shift_BT`` (:class:`routing.TokenBias`); a kind that
        decides by a head of its own gets the same bias subtracted, so that the
        causal decision learns the biased top-k and meets the same bias at inference."""
        with routing.fp32_region(x_BTD):
            d_BT = self.kind.decision_logits(self.head, x_BTD, r_BT)
        if shift_BT is not None and not self.kind.decides_by_router_logit:
            d_BT = d_BT - shift_BT
        return d_BT

    def decide(self, d_BT: torch.Tensor) -> torch.Tensor:
        """The causal decision from decision logits: above the rule's threshold."""
        return routing.causal_decision(d_BT, self.effective_threshold())

    def effective_threshold(self) -> torch.Tensor | float:
        """The threshold the rule in effect compares decision logits with."""
        return self.threshold if self.rule == "calibrated" else 0.0

    def route(
        self, x_BTD: torch.Tensor, r_BT: torch.Tensor | None = None,
        shift_BT: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The causal decision of every token of ``x`` (``r``: its router logits less
        the token-choice bias ``shift``, if known)."""
        if r_BT is None:
            r_BT = self.logits(x_BTD) if shift_BT is None else self.logits(x_BTD) - shift_BT
        return self.decide(self.decision_logits(x_BTD, r_BT, shift_BT))

    @torch.no_grad()
    def calibrate_(self, d_N: torch.Tensor, capacity: float) -> float:
        """Set the threshold so that the fraction ``capacity`` of ``d_N`` lies above it;
        returns the threshold."""
        value = routing.threshold_for_fraction(d_N, capacity)
        self.threshold.fill_(value)
        self.calibrated.fill_(True)
        return value

    def is_calibrated(self) -> bool:
        return bool(self.calibrated.item())

    def decays(self, local_name: str, p: torch.Tensor) -> bool:
        """The kind's weight-decay rule for this router's parameter ``local_name``."""
        return self.kind.decays(local_name, p.dim())
