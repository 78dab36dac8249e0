"""Transformer blocks: the plain block (dense or MoE MLP) and the routed sparse block.

Every block exposes ``branch(x)``: its output *minus* its input (attention plus
MLP contributions). A dense block adds the branch to every token; a routed block
adds ``gate(r) * branch`` to the tokens it selected and leaves the others alone,
so the residual is counted exactly once either way.

For decoding with a KV cache every block also exposes ``prefill`` (a right-padded
batch of prompts in one pass) and ``step`` (one token per sequence), each taking
its own :class:`~xmodlm.model.kv_cache.BlockCache`; the decoder only loops over
blocks (:mod:`xmodlm.model.generate` describes the batch rules).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from xmodlm.config import ModelConfig
from xmodlm.flops import capacity_tokens
from xmodlm.model import routing
from xmodlm.model.depth_router import DepthRouter
from xmodlm.model.kv_cache import BlockCache
from xmodlm.model.layers import Attention, RMSNorm, Rotary, SwiGLU, attention, matmul_dtype
from xmodlm.model.moe import EXPERT_LOAD, MoEMLP


class Block(nn.Module):
    """Pre-norm block: attention then MLP (SwiGLU or MoE)."""

    def __init__(self, cfg: ModelConfig, moe: bool = False) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(
            cfg.d_model, cfg.n_heads, cfg.attn_kv_heads, cfg.attn_head_dim, cfg.qk_norm,
            cfg.norm_eps,
        )
        self.norm2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp: nn.Module
        if moe:
            self.mlp = MoEMLP(
                cfg.d_model, cfg.expert_dim, cfg.n_experts, cfg.moe_top_k,
                router=cfg.moe_router, n_shared=cfg.moe_shared, bias_rate=cfg.moe_bias_rate,
            )
        else:
            self.mlp = SwiGLU(cfg.d_model, cfg.ffn_dim)

    def branch(
        self,
        x_BTD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask_BTT: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Branch output f = block(x) - x, and the MLP's auxiliary losses (MoE only)."""
        a, m, aux = self.branch_parts(x_BTD, cos, sin, mask_BTT)
        return a + m, aux

    def branch_parts(
        self,
        x_BTD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask_BTT: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The branch as its two residual contributions (a, f): attention and MLP (a
        gate may scale them apart, as MoD's does), and the MLP's auxiliary losses."""
        a = self.attn(self.norm1(x_BTD, matmul_dtype(x_BTD)), cos, sin, mask_BTT)
        m, aux = self.mlp_out(x_BTD + a)
        return a, m, aux

    def branch_with(
        self,
        x_BTD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The branch with attention supplied by the caller: (a, f, k, v), its
        attention and MLP contributions and the keys and values.

        ``attend(q, k, v)`` gets this block's rotated queries (B, H, T, hd), keys and
        values (B, G, T, hd: its key/value heads) and returns the attention output;
        incremental decoding uses it to attend over cached keys, and stores the
        returned ``k``, ``v``.
        """
        q, k, v = self.attn.project_qkv(self.norm1(x_BTD, matmul_dtype(x_BTD)), cos, sin)
        a = self.attn.output(attend(q, k, v))
        m, _ = self.mlp_out(x_BTD + a)
        return a, m, k, v

    def cached_branch(
        self, x_B1D: torch.Tensor, step: DecodeStep, cache: BlockCache,
        rows: list[int] | None = None, rows_R: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The branch (a, f) of one new token per sequence, attending over the cached
        keys (which it appends to); ``rows``: the sequences (of the batch) these are."""
        pos_B, cos, sin = step.pos_B, step.cos, step.sin
        if rows_R is not None:
            pos_B, cos, sin = pos_B[rows_R], cos[rows_R], sin[rows_R]

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys, values, mask = cache.step(k, v, pos_B, rows, rows_R)
            return attention(q, keys, values, mask)

        return self.branch_with(x_B1D, cos, sin, attend)[:2]

    def mlp_out(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The MLP's contribution f, given the post-attention stream x + a."""
        if isinstance(self.mlp, MoEMLP):  # its router reads the norm's output in fp32
            return self.mlp(self.norm2(x_BTD))
        return self.mlp(self.norm2(x_BTD, matmul_dtype(x_BTD))), {}


@dataclass
class Prompts:
    """A right-padded batch of prompts, as every block's ``prefill`` needs it."""

    rope: Rotary
    pos_T: torch.Tensor  # 0 .. T-1
    cos: torch.Tensor  # rotary tables at pos_T
    sin: torch.Tensor
    valid_BT: torch.Tensor  # True on prompt tokens, False on padding
    lens: list[int]  # each prompt's length
    lens_B: torch.Tensor


@dataclass
class DecodeStep:
    """One new token per sequence, each at its own position."""

    pos_B: torch.Tensor
    cos: torch.Tensor  # rotary tables at pos_B, (B, 1, head_dim)
    sin: torch.Tensor


@dataclass
class BlockOutput:
    """What a block returns besides the new residual stream."""

    aux: dict[str, torch.Tensor] = field(default_factory=dict)
    r_BT: torch.Tensor | None = None  # router logits (fp32), sparse blocks only
    topk_BT: torch.Tensor | None = None  # top-k membership
    causal_BT: torch.Tensor | None = None  # causal decision
    processed_BT: torch.Tensor | None = None  # tokens actually processed in this pass
    expert_load_E: torch.Tensor | None = None  # assignments per expert, MoE blocks only


class DenseBlock(nn.Module):
    """An anchor (``D``) or MoE (``E``) block: every token goes through.

    ``aux_weights``: the weight in the total loss of each auxiliary loss this
    block returns (every block declares its own; the stack only sums).
    """

    def __init__(self, cfg: ModelConfig, moe: bool = False) -> None:
        super().__init__()
        self.block = Block(cfg, moe=moe)
        self.aux_weights = (
            {"moe_balance": cfg.moe_aux_coef, "moe_z": cfg.moe_z_coef} if moe else {}
        )

    def forward(
        self,
        x_BTD: torch.Tensor,
        rope: Rotary,
        pos_T: torch.Tensor,
        mode: str,
        rot: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, BlockOutput]:
        """``rot``: the (cos, sin) tables at ``pos_T``, when the caller computed them once."""
        cos, sin = rope(pos_T) if rot is None else rot
        f, aux = self.block.branch(x_BTD, cos, sin)
        load_E = aux.pop(EXPERT_LOAD, None)  # a statistic, not a loss
        return x_BTD + f, BlockOutput(aux=aux, expert_load_E=load_E)

    def prefill(self, x_BTD: torch.Tensor, prompts: Prompts, cache: BlockCache) -> torch.Tensor:
        """Every prompt token through the block; keys and values of real tokens cached."""
        a, f, k, v = self.block.branch_with(
            x_BTD, prompts.cos, prompts.sin, lambda q, k, v: attention(q, k, v, causal=True)
        )
        B, T = prompts.valid_BT.shape
        cache.prefill(k, v, prompts.pos_T.expand(B, T), prompts.lens, prompts.lens_B)
        return x_BTD + (a + f)

    def step(self, x_B1D: torch.Tensor, step: DecodeStep, cache: BlockCache) -> torch.Tensor:
        a, f = self.block.cached_branch(x_B1D, step, cache)
        return x_B1D + (a + f)


class RoutedBlock(nn.Module):
    """A sparse (``s``) block: processes only k = round(L / K) tokens per sequence.

    ``mode="topk"`` (training): expert-choice top-k of the router logits (less the
    token-choice bias, :class:`routing.TokenBias`), gathered in causal order with
    their original rotary positions, block run on the k tokens only, gated branch
    scattered back.

    ``mode="causal"`` (inference): a token is processed iff its router's causal
    decision says so (:class:`~xmodlm.model.depth_router.DepthRouter`). The number
    of tokens then varies by sequence, so this path runs the block on all tokens
    with attention restricted to the selected keys and discards unselected
    outputs. It gives exactly what token-by-token decoding computes and also
    serves as the reference implementation that the gather path is tested against.

    The gate multiplies the whole routed residual, ``x + g (a + f)`` (``gate_scope``
    block: the paper's X-MoD, Eq. 7), or the MLP's alone, ``x + a + g f`` (ffn: the
    paper's MoD baseline, Eq. 6).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.block = Block(cfg)
        self.capacity = cfg.depth.capacity
        self.gating = cfg.gating
        self.ffn_only = cfg.gate_scope == "ffn"
        self.router = DepthRouter(cfg.d_model, cfg.causal_router, cfg.causal_threshold)
        self.aux_weights = {"causal_bce": cfg.causal_coef}  # see DenseBlock
        self.gamma: nn.Parameter | None = None
        if cfg.gating == "variance_scaled":
            # neutral until the stack calibrates it (Transformer.init_gates_);
            # shape (1,), not a 0-d scalar: FSDP2 shards parameters along dim 0
            self.gamma = nn.Parameter(torch.full((1,), routing.NEUTRAL_GAMMA))
        self._register_load_state_dict_pre_hook(_upgrade_router_state)

    def gate(self, r: torch.Tensor) -> torch.Tensor:
        return routing.gate(r, self.gating, self.gamma)

    def gated(self, g: torch.Tensor, a: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        """The routed residual update of tokens with gate ``g`` (one value per token)."""
        g = g.unsqueeze(-1)
        return a + g * f if self.ffn_only else g * (a + f)

    def forward(
        self,
        x_BTD: torch.Tensor,
        rope: Rotary,
        pos_T: torch.Tensor,
        mode: str,
        rot: tuple[torch.Tensor, torch.Tensor] | None = None,
        shift_BT: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, BlockOutput]:
        """``rot``: the (cos, sin) tables at ``pos_T``, when the caller computed them once;
        ``shift_BT``: the token-choice bias tau b of each token (None: 0)."""
        B, T, _ = x_BTD.shape
        if mode == "topk":
            # router, top-k and gather in one autograd node (router_logits' numbers)
            k = capacity_tokens(self.capacity, T)
            r_BT, idx_BK, x_BKD = routing.route(x_BTD, self.router.weight, k, shift_BT=shift_BT)
            d_BT = self.router.decision_logits(x_BTD, r_BT, shift_BT)
            causal_BT = self.router.decide(d_BT)
            topk_BT = routing.selection_mask(idx_BK, T)
            cos_T, sin_T = rope(pos_T) if rot is None else rot
            a_BKD, f_BKD, _ = self.block.branch_parts(x_BKD, cos_T[idx_BK], sin_T[idx_BK])
            if self.ffn_only:  # x + a + g f: attention in ungated, the MLP through the gate
                x_BTD = routing.scatter_add_tokens(x_BTD, idx_BK, a_BKD)
            else:
                f_BKD = a_BKD + f_BKD
            x_BTD = routing.gated_scatter(x_BTD, f_BKD, r_BT, idx_BK, self.gating, self.gamma)
            processed = topk_BT
        elif mode == "causal":
            r_BT = self._logits(x_BTD, shift_BT)
            causal_BT = self.router.route(x_BTD, r_BT, shift_BT)
            topk_BT = None
            x_BTD = self.ragged_forward(x_BTD, r_BT, causal_BT, rope, pos_T=pos_T)
            processed = causal_BT
        elif mode == "calibrate":  # fit the threshold to this batch, then route by it
            r_BT = self._logits(x_BTD, shift_BT)
            d_BT = self.router.decision_logits(x_BTD, r_BT, shift_BT)
            self.router.calibrate_(d_BT, capacity_tokens(self.capacity, T) / T)
            causal_BT = routing.causal_decision(d_BT, self.router.threshold)
            topk_BT = None
            x_BTD = self.ragged_forward(x_BTD, r_BT, causal_BT, rope)
            processed = causal_BT
        else:
            raise AssertionError(f"unknown routing mode {mode!r}")
        aux = {}
        if topk_BT is not None:
            aux["causal_bce"] = routing.causal_bce_loss(d_BT, topk_BT)
        out = BlockOutput(aux, r_BT, topk_BT, causal_BT, processed)
        return x_BTD, out

    def _logits(self, x: torch.Tensor, shift: torch.Tensor | None) -> torch.Tensor:
        """Router logits less the token-choice bias, if any."""
        r = self.router.logits(x)
        return r if shift is None else r - shift

    def prefill(
        self, x_BTD: torch.Tensor, prompts: Prompts, cache: BlockCache,
        shift_BT: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed prompt tokens only (causal decision, never padding), gathered per
        sequence in causal order at their own positions; their keys and values cached.
        Returns the stream and the tokens routed (for the token-choice bias)."""
        r_BT = self._logits(x_BTD, shift_BT)
        sel_BT = self.router.route(x_BTD, r_BT, shift_BT) & prompts.valid_BT
        return self.ragged_forward(x_BTD, r_BT, sel_BT, prompts.rope, cache), sel_BT

    def ragged_forward(
        self,
        x_BTD: torch.Tensor,
        r_BT: torch.Tensor,
        sel_BT: torch.Tensor,
        rope: Rotary,
        cache: BlockCache | None = None,
        pos_T: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The block on the tokens ``sel`` marks only, a varying number per sequence.

        Each sequence's routed tokens are gathered in causal order at their own
        positions (``pos_T`` at their index; without it the index itself: windows or
        right-padded prompts start at position 0) and padded to the most any
        sequence routes; the block runs on those, so the cost follows the routed
        fraction (unlike :meth:`masked_forward`, the reference it equals). Keys and
        values of the routed tokens go to ``cache``, if given. Causal routing and
        calibration run this way: a block that routes 1/16 of the tokens costs
        about 1/16 of a dense one at evaluation too.
        """
        counts_B = sel_BT.sum(1)
        counts = counts_B.tolist()
        kmax = max(counts)
        if kmax == 0:
            return x_BTD
        # routed tokens first, each sequence's in causal order; then (padding) the rest
        idx_BK = torch.sort((~sel_BT).to(torch.int32), dim=1, stable=True).indices[:, :kmax]
        valid_BK = torch.arange(kmax, device=x_BTD.device).unsqueeze(0) < counts_B.unsqueeze(1)
        mask = None
        if min(counts) != kmax:  # padding queries see themselves; outputs zeroed below
            mask = routing.routed_attention_mask(valid_BK).unsqueeze(1)
        x_BKD = routing.gather_tokens(x_BTD, idx_BK)
        cos, sin = rope(idx_BK if pos_T is None else pos_T[idx_BK])
        a_BKD, f_BKD, k, v = self.block.branch_with(
            x_BKD, cos, sin, lambda q, k, v: attention(q, k, v, mask, causal=True)
        )
        g_BK = self.gate(torch.gather(r_BT, 1, idx_BK))
        update_BKD = self.gated(g_BK, a_BKD, f_BKD) * valid_BK.unsqueeze(-1)
        if cache is not None:
            cache.prefill(k, v, idx_BK, counts, counts_B)
        return routing.scatter_add_tokens(x_BTD, idx_BK, update_BKD)

    def step(
        self, x_B1D: torch.Tensor, step: DecodeStep, cache: BlockCache,
        shift_B1: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[bool]]:
        """The new tokens whose causal decision routes them (one host sync to know
        which); the block is skipped when none does, and runs on just those rows.
        Returns the stream and each sequence's decision (for the token-choice bias)."""
        r_B1 = self._logits(x_B1D, shift_B1)
        sel = self.router.route(x_B1D, r_B1, shift_B1)[:, 0].tolist()
        return self.step_decided(x_B1D, step, cache, r_B1, sel), sel

    def step_decided(
        self, x_B1D: torch.Tensor, step: DecodeStep, cache: BlockCache,
        r_B1: torch.Tensor, sel: list[bool],
    ) -> torch.Tensor:
        """:meth:`step` with the router logits (bias subtracted) and decisions already
        known (a decoder that scored a run of sparse blocks at once: ``Decoder``)."""
        if all(sel):
            a, f = self.block.cached_branch(x_B1D, step, cache)
            return x_B1D + self.gated(self.gate(r_B1), a, f).to(x_B1D.dtype)
        if not any(sel):
            return x_B1D
        rows = [b for b, s in enumerate(sel) if s]
        rows_R = torch.tensor(rows, dtype=torch.long, device=x_B1D.device)
        a, f = self.block.cached_branch(x_B1D[rows_R], step, cache, rows, rows_R)
        update = self.gated(self.gate(r_B1[rows_R]), a, f)
        return x_B1D.index_add(0, rows_R, update.to(x_B1D.dtype))

    def masked_forward(
        self,
        x_BTD: torch.Tensor,
        r_BT: torch.Tensor,
        sel_BT: torch.Tensor,
        rope: Rotary,
        pos_T: torch.Tensor,
    ) -> torch.Tensor:
        """Reference path: full-length compute, attention over selected keys only."""
        mask_BTT = routing.routed_attention_mask(sel_BT)
        cos, sin = rope(pos_T)
        a_BTD, f_BTD, _ = self.block.branch_parts(x_BTD, cos, sin, mask_BTT)
        update_BTD = self.gated(self.gate(r_BT), a_BTD, f_BTD) * sel_BT.unsqueeze(-1)
        return x_BTD + update_BTD.to(x_BTD.dtype)


def _upgrade_router_state(
    state_dict: dict[str, torch.Tensor], prefix: str, *args: object
) -> None:
    """Checkpoints from before the depth-router seam load unchanged.

    The predictor's weights were ``predictor.*`` on the block, now ``router.head.*``;
    a checkpoint without thresholds was never calibrated: it gets threshold 0 and
    ``calibrated`` false, so it says it uses the ``half`` rule until calibrated.
    """
    old = prefix + "predictor."
    for key in [k for k in state_dict if k.startswith(old)]:
        state_dict[prefix + "router.head." + key[len(old):]] = state_dict.pop(key)
    if prefix + "router.weight" in state_dict:
        state_dict.setdefault(prefix + "router.threshold", torch.zeros(1))
        state_dict.setdefault(prefix + "router.calibrated", torch.zeros(1, dtype=torch.bool))
