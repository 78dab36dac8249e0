"""Token-choice top-k mixture-of-experts MLP, its router, and the router's
auxiliary losses as pure functions.

A router is an object of its own (:class:`TopKRouter`): it maps tokens to
(expert, weight) pairs and returns its auxiliary losses, and the MLP's dispatch
does not depend on how the pairs were chosen. A new routing rule (sigmoid
scores, a bias-balanced router, expert choice) is one new class here with the
same ``forward`` contract, plus what lies outside the MLP: a config field to
choose it (:class:`MoEMLP` builds a ``TopKRouter``), the weights of any loss of
its own (the block's ``aux_weights``), FLOP accounting where the rule changes
the experts a token runs (``flops`` counts top_k per token), and the exported
model (``hf.py`` restates top-k routing).
"""

from __future__ import annotations

import math
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from xmodlm.model.layers import SwiGLU, matmul_dtype

# On a CPU, a bf16 (or fp16) matmul runs through oneDNN, which builds and JIT-compiles
# a kernel for every new operand shape and keeps a bounded cache of them. An
# expert's row count changes every step, so unpadded dispatch pays that build
# (about 2 ms a matmul at width 128) over and over. Padding each expert's rows to a
# multiple of this keeps the shapes to a few dozen that stay cached; fp32 CPU
# matmuls and GPU matmuls have no per-shape cost and are not padded.
CPU_LOW_PRECISION_ROWS_MULTIPLE = 32

IntOrTensor = TypeVar("IntOrTensor", int, torch.Tensor)


def expert_counts(expert_NK: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Assignments per expert, (E,). A one-hot sum, not ``bincount``: its output
    shape is static, so ``torch.compile`` traces it instead of breaking the graph."""
    return F.one_hot(expert_NK.flatten(), n_experts).sum(0)


def load_balancing_loss(probs_NE: torch.Tensor, expert_NK: torch.Tensor) -> torch.Tensor:
    """Switch-style balance loss: E * sum_e (fraction routed to e) * (mean prob of e).

    Equals 1 under perfectly uniform routing, whatever E and top-k.
    """
    n_experts = probs_NE.shape[-1]
    frac_E = expert_counts(expert_NK, n_experts).to(probs_NE.dtype) / expert_NK.numel()
    return n_experts * (frac_E * probs_NE.mean(0)).sum()


def router_z_loss(logits_NE: torch.Tensor) -> torch.Tensor:
    """Mean squared log-partition: keeps router logits small and fp32 routing stable."""
    return torch.logsumexp(logits_NE, dim=-1).pow(2).mean()


class TopKRouter(nn.Module):
    """Token choice: softmax scores in fp32, each token's top-k experts, weights
    renormalised over the k; Switch balance loss and router z-loss.

    ``forward(x_ND) -> (weight_NK, expert_NK, aux)``. The weight is a (E, D)
    parameter named ``weight`` and initialised as ``nn.Linear``'s, so checkpoints
    and random streams are those of a plain linear router.
    """

    def __init__(self, d_model: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(
        self, x_ND: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        with torch.autocast(device_type=x_ND.device.type, enabled=False):
            logits_NE = F.linear(x_ND.float(), self.weight.float())
        probs_NE = logits_NE.softmax(-1)
        weight_NK, expert_NK = probs_NE.topk(self.top_k, dim=-1)
        weight_NK = weight_NK / weight_NK.sum(-1, keepdim=True)
        aux = {
            "moe_balance": load_balancing_loss(probs_NE, expert_NK),
            "moe_z": router_z_loss(logits_NE),
        }
        return weight_NK, expert_NK, aux


class MoEMLP(nn.Module):
    """Dropless token-choice MoE: each token picks its top-k experts (router in fp32).

    Tokens are sorted by expert and each expert runs once on its contiguous slice,
    so compute is exactly top_k expert MLPs per token, plus, for low-precision
    matmuls on a CPU, rows that pad each slice to a multiple of
    :data:`CPU_LOW_PRECISION_ROWS_MULTIPLE` (copies of token 0 whose outputs are
    weighted by zero, so they add nothing, forward or backward; the FLOP count
    leaves them out). Under ``torch.compile`` the slice sizes
    (read on the host) are one graph break per MoE layer; after one recompile
    dynamo treats them as dynamic, so the experts stay compiled. With one expert
    and top_k = 1 the layer equals a plain SwiGLU with the same weights.
    """

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = TopKRouter(d_model, n_experts, top_k)
        self.experts = nn.ModuleList(SwiGLU(d_model, d_ff) for _ in range(n_experts))

    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        B, T, D = x_BTD.shape
        N = B * T
        x_ND = x_BTD.reshape(N, D)
        weight_NK, expert_NK, aux = self.router(x_ND)

        flat_expert = expert_NK.flatten()
        order = torch.argsort(flat_expert, stable=True)
        token_of = order // self.top_k
        weight_of = weight_NK.flatten()[order]
        counts_E = expert_counts(flat_expert, len(self.experts))
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
        y_ND = y_ND.index_add(0, token_of, y_sorted)
        return y_ND.view(B, T, D), aux


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
