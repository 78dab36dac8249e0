"""Token-choice top-k mixture-of-experts MLP, its routers, and the routers'
auxiliary losses as pure functions.

A router is an object of its own: it maps tokens to (expert, weight) pairs and
returns its auxiliary losses, and the MLP's dispatch does not depend on how the
pairs were chosen. Two kinds (``model.moe_router``):

* ``switch`` (:class:`TopKRouter`): softmax scores, top-k renormalised, Switch
  balance loss plus router z-loss: the original baseline, kept bit for bit;
* ``fine`` (:class:`BiasedSigmoidRouter`): the paper's fine-grained MoE, as
  DeepSeek-V3 routes: sigmoid scores, a per-expert bias added for *selection
  only* and nudged after every optimiser step toward even load (auxiliary-loss-
  free balancing), combine weights the unbiased scores of the chosen experts
  normalised to sum 1, and the balance loss beside it; no z-loss.

A new routing rule is one new class here with the same ``forward`` contract, plus
what lies outside the MLP: a name in ``config.MOE_ROUTERS`` (validated there), the
weights of any loss of its own (the block's ``aux_weights``), FLOP accounting
where the rule changes the experts a token runs (``flops`` counts top_k per
token), and the exported model (``hf.py`` restates the switch router only).

Shared experts (``model.moe_shared``) see every token with weight 1. n shared
experts of width d_e are one SwiGLU of width n * d_e (the hidden units of
separate experts concatenate, and their down projections sum), so they run as one
matmul pair: same parameters, same FLOPs, one launch.
"""

from __future__ import annotations

import math
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from xmodlm.model.layers import SwiGLU, matmul_dtype

EXPERT_LOAD = "expert_load"
"""Key under which :class:`MoEMLP` hands back its per-expert assignment counts (a
statistic, not a loss: the block moves it out of the auxiliary losses)."""

# On a CPU, a bf16 (or fp16) matmul runs through oneDNN, which builds and JIT-compiles
# a kernel for every new operand shape and keeps a bounded cache of them. An
# expert's row count changes every step, so unpadded dispatch pays that build
# (about 2 ms a matmul at width 128) over and over. Padding each expert's rows to a
# multiple of this keeps the shapes to a few dozen that stay cached; fp32 CPU
# matmuls and GPU matmuls have no per-shape cost and are not padded.
CPU_LOW_PRECISION_ROWS_MULTIPLE = 32

IntOrTensor = TypeVar("IntOrTensor", int, torch.Tensor)


def expert_counts(expert_NK: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Assignments per expert, (E,) int64. A scatter-add, not ``bincount``: its output
    shape is static, so ``torch.compile`` traces it instead of breaking the graph
    (and unlike a one-hot sum it needs no (N k, E) temporary when E is 64 or more)."""
    flat = expert_NK.flatten()
    counts_E = torch.zeros(n_experts, dtype=torch.long, device=flat.device)
    return counts_E.scatter_add(0, flat, torch.ones_like(flat))


def load_balancing_loss(probs_NE: torch.Tensor, expert_NK: torch.Tensor) -> torch.Tensor:
    """Switch-style balance loss: E * sum_e (fraction routed to e) * (mean prob of e).

    Equals 1 under perfectly uniform routing, whatever E and top-k. With the
    ``fine`` router's normalised sigmoid scores as ``probs`` it is DeepSeek-V3's
    balance loss, here over the whole batch rather than per sequence.
    """
    n_experts = probs_NE.shape[-1]
    frac_E = expert_counts(expert_NK, n_experts).to(probs_NE.dtype) / expert_NK.numel()
    return n_experts * (frac_E * probs_NE.mean(0)).sum()


def router_z_loss(logits_NE: torch.Tensor) -> torch.Tensor:
    """Mean squared log-partition: keeps router logits small and fp32 routing stable."""
    return torch.logsumexp(logits_NE, dim=-1).pow(2).mean()


def load_imbalance(counts_E: torch.Tensor) -> float:
    """max / mean of per-expert assignment counts: 1 is perfectly even, E means every
    assignment went to one expert. What evaluation reports per MoE layer."""
    counts_E = counts_E.float()
    return float(counts_E.max() / counts_E.mean().clamp_min(1e-9))


def _router_logits(x_ND: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
    """x W^T in fp32 whatever the autocast dtype: routing decisions are discrete, and
    bf16 round-off flips near-ties."""
    with torch.autocast(device_type=x_ND.device.type, enabled=False):
        return F.linear(x_ND.float(), weight_ED.float())


def _router_weight(d_model: int, n_experts: int) -> nn.Parameter:
    """A (E, D) parameter initialised as ``nn.Linear``'s, so checkpoints and random
    streams are those of a plain linear router."""
    weight = nn.Parameter(torch.empty(n_experts, d_model))
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    return weight


class TopKRouter(nn.Module):
    """Token choice (``switch``): softmax scores in fp32, each token's top-k experts,
    weights renormalised over the k; Switch balance loss and router z-loss.

    ``forward(x_ND) -> (weight_NK, expert_NK, aux)``.
    """

    def __init__(self, d_model: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = _router_weight(d_model, n_experts)

    def forward(
        self, x_ND: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        logits_NE = _router_logits(x_ND, self.weight)
        probs_NE = logits_NE.softmax(-1)
        weight_NK, expert_NK = probs_NE.topk(self.top_k, dim=-1)
        weight_NK = weight_NK / weight_NK.sum(-1, keepdim=True)
        aux = {
            "moe_balance": load_balancing_loss(probs_NE, expert_NK),
            "moe_z": router_z_loss(logits_NE),
        }
        return weight_NK, expert_NK, aux


class BiasedSigmoidRouter(nn.Module):
    """Token choice (``fine``): sigmoid scores s in fp32; each token's top-k experts by
    s + b, b a per-expert bias that only selects; combine weights the chosen
    unbiased scores normalised to sum 1; the balance loss on s normalised per token.

    Sigmoid rather than softmax because each expert's score then does not depend
    on the others': the bias moves one expert's rank without rescaling every
    weight, which is why DeepSeek-V3 pairs the two. ``bias_E`` is a buffer (no
    gradient; saved in checkpoints, since routing depends on it). Training forwards
    (grad enabled, ``training`` set) add their assignments to ``load_E``, and
    :meth:`update_bias`, called once after each optimiser step, moves every bias by
    ``bias_rate`` toward even load: b_e += rate * sign(mean load - load_e). The
    counts accumulate in a buffer by an in-place add, so a compiled forward keeps
    them without a graph break.
    """

    def __init__(self, d_model: int, n_experts: int, top_k: int, bias_rate: float) -> None:
        super().__init__()
        self.top_k = top_k
        self.bias_rate = bias_rate
        self.weight = _router_weight(d_model, n_experts)
        self.register_buffer("bias_E", torch.zeros(n_experts))
        self.register_buffer("load_E", torch.zeros(n_experts), persistent=False)

    def forward(
        self, x_ND: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        scores_NE = _router_logits(x_ND, self.weight).sigmoid()
        expert_NK = (scores_NE + self.bias_E).topk(self.top_k, dim=-1).indices
        weight_NK = scores_NE.gather(-1, expert_NK)
        weight_NK = weight_NK / weight_NK.sum(-1, keepdim=True)
        probs_NE = scores_NE / scores_NE.sum(-1, keepdim=True)
        if self.bias_rate > 0 and self.training and torch.is_grad_enabled():
            self.load_E += expert_counts(expert_NK, self.load_E.numel())
        return weight_NK, expert_NK, {"moe_balance": load_balancing_loss(probs_NE, expert_NK)}

    @torch.no_grad()
    def update_bias(self) -> None:
        """One loss-free balancing step on the loads counted since the last call (over
        every rank, so all ranks keep the same bias), then reset the counts."""
        if self.bias_rate == 0:
            return
        load_E = self.load_E
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(load_E)
        self.bias_E += self.bias_rate * torch.sign(load_E.mean() - load_E)
        load_E.zero_()


def make_router(
    kind: str, d_model: int, n_experts: int, top_k: int, bias_rate: float = 0.0
) -> nn.Module:
    """The router named ``kind`` (one of ``config.MOE_ROUTERS``)."""
    if kind == "switch":
        return TopKRouter(d_model, n_experts, top_k)
    assert kind == "fine", kind
    return BiasedSigmoidRouter(d_model, n_experts, top_k, bias_rate)


class MoEMLP(nn.Module):
    """Dropless token-choice MoE: each token picks its top-k routed experts (router in
    fp32), plus ``n_shared`` always-on shared experts; no capacity limit.

    Two dispatches compute the same thing. ``sorted`` (the default): tokens are
    sorted by expert and each expert runs once on its contiguous slice, so compute
    is exactly top_k expert MLPs per token, plus, for low-precision matmuls on a
    CPU, rows that pad each slice to a multiple of
    :data:`CPU_LOW_PRECISION_ROWS_MULTIPLE` (copies of token 0 whose outputs are
    weighted by zero, so they add nothing, forward or backward; the FLOP count
    leaves them out). Under ``torch.compile`` the slice sizes (read on the host)
    are one graph break per MoE layer; after one recompile dynamo treats them as
    dynamic, so the experts stay compiled. ``loop`` is the reference: per expert,
    a mask of its tokens, a gather and an ``index_add``. With one expert, top_k = 1
    and no shared expert the layer equals a plain SwiGLU with the same weights.

    ``forward`` returns ``(y, aux)``: the router's auxiliary losses, and under
    :data:`EXPERT_LOAD` the step's assignment count per expert (detached).
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        n_experts: int,
        top_k: int,
        router: str = "switch",
        n_shared: int = 0,
        bias_rate: float = 0.0,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = make_router(router, d_model, n_experts, top_k, bias_rate)
        self.experts = nn.ModuleList(SwiGLU(d_model, d_ff) for _ in range(n_experts))
        self.shared = SwiGLU(d_model, n_shared * d_ff) if n_shared > 0 else None
        self.dispatch = "sorted"  # or "loop": the reference the tests compare against

    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        weight_NK, expert_NK, aux = self.router(x_ND)
        counts_E = expert_counts(expert_NK, len(self.experts))
        if self.dispatch == "sorted":
            y_ND = self._dispatch_sorted(x_ND, weight_NK, expert_NK, counts_E)
        else:
            y_ND = self._dispatch_loop(x_ND, weight_NK, expert_NK)
        if self.shared is not None:
            y_ND = y_ND + self.shared(x_ND)
        aux[EXPERT_LOAD] = counts_E.detach()
        return y_ND.view(B, T, D), aux

    def _dispatch_sorted(
        self,
        x_ND: torch.Tensor,
        weight_NK: torch.Tensor,
        expert_NK: torch.Tensor,
        counts_E: torch.Tensor,
    ) -> torch.Tensor:
        """Routed experts' weighted sum, by sorting the assignments by expert."""
        N, D = x_ND.shape
        flat_expert = expert_NK.flatten()
        order = torch.argsort(flat_expert, stable=True)
        token_of = order // self.top_k
        weight_of = weight_NK.flatten()[order]
        multiple = rows_multiple(x_ND)
        # the one host read, of the raw counts: each changes every step, so under
        # torch.compile all turn dynamic at the first recompile (padded sizes, which
        # change less often, would specialise and recompile one by one)
        counts = counts_E.tolist()
        rows = [round_up(n, multiple) for n in counts]
        if multiple > 1:  # padding rows: copies of token 0 that weigh nothing
            slot = padded_slots(flat_expert[order], counts_E, round_up(counts_E, multiple))
            token_of = token_of.new_zeros(sum(rows)).index_put((slot,), token_of)
            weight_of = weight_of.new_zeros(sum(rows)).index_put((slot,), weight_of)
        x_sorted = x_ND[token_of]
        outs = [
            expert(chunk)
            for expert, chunk in zip(self.experts, x_sorted.split(rows), strict=True)
            if chunk.shape[0] > 0
        ]
        y_sorted = torch.cat(outs) * weight_of.unsqueeze(-1).to(outs[0].dtype)
        y_ND = torch.zeros(N, D, dtype=y_sorted.dtype, device=x_ND.device)
        return y_ND.index_add(0, token_of, y_sorted)

    def _dispatch_loop(
        self, x_ND: torch.Tensor, weight_NK: torch.Tensor, expert_NK: torch.Tensor
    ) -> torch.Tensor:
        """The reference: each expert gathers its own tokens, runs, and adds back."""
        y_ND: torch.Tensor | None = None
        for e, expert in enumerate(self.experts):
            token_M, slot_M = (expert_NK == e).nonzero(as_tuple=True)
            if token_M.numel() == 0:
                continue
            out_MD = expert(x_ND[token_M])
            out_MD = out_MD * weight_NK[token_M, slot_M].unsqueeze(-1).to(out_MD.dtype)
            if y_ND is None:
                y_ND = torch.zeros(x_ND.shape, dtype=out_MD.dtype, device=x_ND.device)
            y_ND = y_ND.index_add(0, token_M, out_MD)
        assert y_ND is not None, "every token picks top_k >= 1 experts"
        return y_ND

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """The router's balancing step, if it has one (``fine``): call once per
        optimiser step, after ``step()``."""
        update = getattr(self.router, "update_bias", None)
        if update is not None:
            update()


def rows_multiple(x_ND: torch.Tensor) -> int:
    """The multiple each expert's row count is padded to (1: none); see the module constant."""
    if x_ND.device.type == "cpu" and matmul_dtype(x_ND) in (torch.bfloat16, torch.float16):
        return CPU_LOW_PRECISION_ROWS_MULTIPLE
    return 1


def round_up(n: IntOrTensor, multiple: int) -> IntOrTensor:
    """``n`` rounded up to a multiple of ``multiple``: the padded row count of an expert
    (a host int for the split, or the (E,) counts on the device for the slots)."""
    return -(-n // multiple) * multiple


def padded_slots(
    expert_sorted: torch.Tensor, counts_E: torch.Tensor, rows_E: torch.Tensor
) -> torch.Tensor:
    """Where each expert-sorted assignment goes when expert e's ``counts_E[e]``
    assignments start a block of ``rows_E[e]`` rows: its rank within its expert
    plus the block's start."""
    first_E = counts_E.cumsum(0) - counts_E
    start_E = rows_E.cumsum(0) - rows_E
    rank = torch.arange(expert_sorted.numel(), device=expert_sorted.device)
    return rank - first_E[expert_sorted] + start_E[expert_sorted]
