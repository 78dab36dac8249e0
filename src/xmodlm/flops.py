"""Analytic parameters and FLOPs per token, KV-cache bytes, and FLOP matching.

Conventions (one for every family, so comparisons are fair):

* matmul FLOPs are 2 m n k; everything else (norms, rotary, softmax, gathers) is
  not counted; embeddings cost 0;
* attention with grouped queries: the Q and output projections are
  d x (n_heads head_dim), K and V d x (n_kv_heads head_dim); scores and weighted
  values over all T keys cost 4 T n_heads head_dim per query (every query head
  attends, whatever heads it shares), what SDPA computes in a training forward
  pass;
* the LM head (2 d V) is counted in the forward FLOPs and also reported on its
  own (``lm_head``): the paper's Table 6 counts the forward without it;
* a sparse block runs on k = max(1, round(c T)) tokens per sequence: its linear
  part scales with k/T and its attention with (k/T)^2; the router (2 d) runs on
  every token, and so does its depth-router kind's decision head, if it has one
  (the kind states its cost: :mod:`xmodlm.depth_routers`);
* an MoE block runs its router (2 d E) on every token, top_k routed expert MLPs
  and its shared experts (:func:`moe_mlp_flops`);
* training = 3 x forward.

This module is arithmetic on configs and imports no torch: the model, the law
and the recommender all read the rules above from here.

Parameters: ``total`` counts every weight; ``non_embedding`` leaves out the token
embedding and the LM head (unless tied, then the shared matrix once);
``active`` (N_ae) is the non-embedding parameters a token touches on average:
anchors fully, sparse block weights with probability k/T (routers always), MoE
routed experts top_k / E (shared experts and the router always).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from xmodlm import depth
from xmodlm.config import ModelConfig
from xmodlm.depth_routers import DepthRouterKind, make_kind
from xmodlm.errors import UserError


def capacity_tokens(capacity: float, seq_len: int) -> int:
    """k = max(1, round(c * T)): the exact number of tokens a sparse block takes."""
    return max(1, min(seq_len, round(capacity * seq_len)))


def routed_fraction(cfg: ModelConfig, context: int | None = None) -> float:
    """k / T: the fraction of each sequence a sparse block of ``cfg`` processes at
    ``context`` (default: cfg.context), with k rounded as executed."""
    T = context or cfg.context
    return capacity_tokens(cfg.depth.capacity, T) / T


def active_depth(cfg: ModelConfig, context: int | None = None) -> float:
    """Active-equivalent depth (:func:`xmodlm.depth.active_depth`) of ``cfg``'s layout."""
    return depth.active_depth(cfg.block_layout, routed_fraction(cfg, context))


def expansion_ratio(cfg: ModelConfig, context: int | None = None) -> float:
    """rho = L / L_active of ``cfg`` (:func:`xmodlm.depth.expansion_ratio`)."""
    return depth.expansion_ratio(cfg.block_layout, routed_fraction(cfg, context))


@dataclass(frozen=True)
class Counts:
    params_total: int
    params_non_embedding: int
    params_active: float
    flops_forward: float  # per token, at the given context, LM head included
    flops_train: float
    context: int
    flops_lm_head: float  # the LM head's share of flops_forward (2 d V)

    def as_dict(self) -> dict[str, object]:
        return {
            "params_total": self.params_total,
            "params_non_embedding": self.params_non_embedding,
            "params_active": self.params_active,
            "flops_per_token": {
                "forward": self.flops_forward, "train": self.flops_train,
                "lm_head": self.flops_lm_head,
            },
            "context": self.context,
        }


def _router_kind(cfg: ModelConfig) -> DepthRouterKind:
    return make_kind(cfg.causal_router, cfg.d_model)


def attention_params(cfg: ModelConfig) -> int:
    """Weights of one attention layer: Q and output d x (n_heads head_dim), K and V
    d x (n_kv_heads head_dim), and the two QK-norm gains (head_dim each) if on."""
    d, hd = cfg.d_model, cfg.attn_head_dim
    norms = 2 * hd if cfg.qk_norm else 0
    return 2 * d * cfg.n_heads * hd + 2 * d * cfg.attn_kv_heads * hd + norms


def attention_linear_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of one attention layer's projections (Q, K, V, O)."""
    hd = cfg.attn_head_dim
    return 2 * cfg.d_model * (2 * cfg.n_heads * hd + 2 * cfg.attn_kv_heads * hd)


def attention_score_flops(cfg: ModelConfig, keys: float) -> float:
    """Forward FLOPs per query of scores and weighted values over ``keys`` keys."""
    return 4 * keys * cfg.n_heads * cfg.attn_head_dim


def block_params(cfg: ModelConfig, letter: str) -> tuple[int, float]:
    """(total, active) parameters of one block."""
    d, f = cfg.d_model, cfg.ffn_dim
    attn = attention_params(cfg)
    norms = 2 * d
    if letter == "E":
        mlp_total, mlp_active = moe_mlp_params(cfg)
        return attn + norms + mlp_total, attn + norms + mlp_active
    body = attn + norms + 3 * d * f
    if letter == "D":
        return body, float(body)
    frac = routed_fraction(cfg)
    extra = d + (1 if cfg.gating == "variance_scaled" else 0) + _router_kind(cfg).extra_params()
    return body + extra, body * frac + extra


def moe_mlp_params(cfg: ModelConfig) -> tuple[int, float]:
    """(total, active) parameters of one MoE MLP: E routed experts and ``moe_shared``
    shared experts, all SwiGLU of width d_e (3 d d_e each), plus the router (d E).
    The balancing bias is a buffer, not a parameter. Active: the router, the shared
    experts, and top_k / E of the routed ones. The whole MoE part of a block's
    count, so a preset's size can be checked against it alone."""
    d, d_e = cfg.d_model, cfg.expert_dim
    routed = cfg.n_experts * 3 * d * d_e
    shared = cfg.moe_shared * 3 * d * d_e
    router = d * cfg.n_experts
    return routed + shared + router, router + shared + routed * cfg.moe_top_k / cfg.n_experts


def moe_mlp_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of one MoE MLP: the router (2 d E) and top_k routed
    plus ``moe_shared`` shared experts of width d_e (6 d d_e each)."""
    d, d_e = cfg.d_model, cfg.expert_dim
    return 2 * d * cfg.n_experts + (cfg.moe_top_k + cfg.moe_shared) * 6 * d * d_e


def block_flops(cfg: ModelConfig, letter: str, context: int) -> float:
    """Forward FLOPs per token of one block at context length ``context``."""
    d, f, T = cfg.d_model, cfg.ffn_dim, context
    attn = attention_linear_flops(cfg) + attention_score_flops(cfg, T)
    if letter == "D":
        return attn + 6 * d * f
    if letter == "E":
        return attn + moe_mlp_flops(cfg)
    k = capacity_tokens(cfg.depth.capacity, T)
    return sparse_block_flops(cfg, k / T, k)


def sparse_block_flops(cfg: ModelConfig, fraction: float, keys: float) -> float:
    """Forward FLOPs per token of a sparse block that processes ``fraction`` of the
    tokens, each attending over ``keys`` routed keys: the linear part and attention
    scale with the fraction; the router and the kind's head run on every token. In
    training the fraction is k / T over k keys; at inference, the fraction f the
    causal decision routes, over f T keys (:func:`inference_flops`)."""
    d, f = cfg.d_model, cfg.ffn_dim
    linear = attention_linear_flops(cfg) + 6 * d * f
    routed = fraction * linear + fraction * attention_score_flops(cfg, keys)
    return routed + 2 * d + _router_kind(cfg).extra_flops()


def inference_flops(cfg: ModelConfig, fractions: list[float], context: int | None = None) -> float:
    """Forward FLOPs per token under causal routing, each sparse block (in depth
    order) processing its measured ``fractions`` of the tokens; the training count
    (:func:`count`) is this with every fraction k / T, the budget inference should
    meet."""
    T = context or cfg.context
    sparse = iter(fractions)
    fwd = 2.0 * cfg.d_model * cfg.vocab_size
    for letter in cfg.block_layout:
        if letter == "s":
            fraction = next(sparse)
            fwd += sparse_block_flops(cfg, fraction, fraction * T)
        else:
            fwd += block_flops(cfg, letter, T)
    assert next(sparse, None) is None, "more fractions than sparse blocks"
    return fwd


def kv_bytes_formula(
    cfg: ModelConfig,
    n_tokens: int,
    routed_fraction_per_block: float | Sequence[float] | None = None,
    dtype_bytes: int = 4,
) -> float:
    """Analytic KV-cache bytes of ``cfg`` holding ``n_tokens`` tokens (summed over the batch).

    Each cached token costs ``2 * n_kv_heads * head_dim * dtype_bytes`` per block
    (a key and a value over the key/value heads). Anchor, dense and MoE blocks
    cache every token; sparse block l caches ``f_l * n_tokens``.
    ``routed_fraction_per_block``: None (every sparse block at the config's
    capacity c), one fraction for every sparse block, or a sequence with one
    fraction per sparse block (depth order) or per block (non-sparse entries must
    be 1). With every f_l = c the ratio to a dense model of the same depth is
    ``L_active / L``.
    """
    layout = cfg.block_layout
    n_sparse = layout.count("s")
    if routed_fraction_per_block is None:
        fractions = [cfg.depth.capacity] * n_sparse
    elif isinstance(routed_fraction_per_block, (int, float)):
        fractions = [float(routed_fraction_per_block)] * n_sparse
    else:
        given = [float(f) for f in routed_fraction_per_block]
        if len(given) == n_sparse:
            fractions = given
        elif len(given) == len(layout):
            for letter, f in zip(layout, given, strict=True):
                if letter != "s" and f != 1.0:
                    raise UserError(f"routed fraction {f} given for non-sparse block: must be 1")
            fractions = [f for letter, f in zip(layout, given, strict=True) if letter == "s"]
        else:
            raise UserError(
                f"{len(given)} routed fractions given: need one per sparse block ({n_sparse})"
                f" or one per block ({len(layout)})"
            )
    per_token = 2 * cfg.attn_kv_heads * cfg.attn_head_dim * dtype_bytes
    tokens = (len(layout) - n_sparse) * n_tokens + sum(f * n_tokens for f in fractions)
    return float(tokens * per_token)


def count(cfg: ModelConfig, context: int | None = None) -> Counts:
    """Parameters and per-token FLOPs of ``cfg`` at ``context`` (default: cfg.context)."""
    T = context or cfg.context
    d, V = cfg.d_model, cfg.vocab_size
    layout = cfg.block_layout
    total = active = 0.0
    lm_head = 2.0 * d * V
    fwd = lm_head
    for letter in layout:
        p_total, p_active = block_params(cfg, letter)
        total += p_total
        active += p_active
        fwd += block_flops(cfg, letter, T)
    total += d  # final norm
    active += d
    embed = V * d if cfg.tie_embeddings else 2 * V * d
    return Counts(
        params_total=int(total) + embed,
        params_non_embedding=int(total),
        params_active=active,
        flops_forward=fwd,
        flops_train=3.0 * fwd,
        context=T,
        flops_lm_head=lm_head,
    )


def head_fraction(cfg: ModelConfig, context: int | None = None) -> float:
    """The LM head's share of training FLOPs per token. Where it is large, a
    FLOP-matched comparison mostly compares two heads: studies bound it."""
    counts = count(cfg, context)
    return counts.flops_lm_head / counts.flops_forward


def flop_match(
    dense: ModelConfig,
    stride: int,
    capacity: float,
    max_layers: int = 512,
    first_anchor_only: bool = False,
    **changes: object,
) -> tuple[ModelConfig, float]:
    """The config with ``dense``'s width and (stride, capacity) closest in training FLOPs.

    Depth is a multiple of ``stride``; with ``first_anchor_only`` (the anchors
    ablation) the layout is one anchor then sparse blocks only, at any depth.
    Returns the config and the relative FLOP mismatch ``F_x / F_dense - 1``.
    ``changes`` are extra fields (gating, ...) applied before matching.
    """
    if "s" in dense.block_layout or "E" in dense.block_layout:
        raise UserError("flop matching needs a dense reference (stride 1, no MoE)")
    target = count(dense).flops_train
    best: tuple[float, ModelConfig] | None = None
    step = 1 if first_anchor_only else stride
    for n_layers in range(max(step, 2 if first_anchor_only else 1), max_layers + 1, step):
        layout = "D" + "s" * (n_layers - 1) if first_anchor_only else ""
        cand = dataclasses.replace(
            dense, n_layers=n_layers, stride=stride, capacity=capacity, layout=layout, **changes
        )
        gap = count(cand).flops_train / target - 1.0
        if best is None or abs(gap) < abs(best[0]):
            best = (gap, cand)
        if gap > 0:
            break  # FLOPs grow with depth: later candidates are only further away
    assert best is not None
    best[1].validate()
    return best[1], best[0]


def same_active_dense(cfg: ModelConfig) -> ModelConfig | None:
    """The dense model of ``cfg``'s backbone and active-equivalent depth (the paper's
    phi_D reference: same N_act, same L), where that depth is whole; else None."""
    depth = active_depth(cfg)
    if abs(depth - round(depth)) > 1e-9:
        return None
    return dataclasses.replace(
        cfg, sparsity=1.0, anchor_stride=1.0, stride=1, capacity=1.0, layout="", mlp="swiglu",
        active_layers=float(round(depth)) if cfg.active_layers > 0 else 0.0,
        n_layers=round(depth),
    )


def flops_over_dense(cfg: ModelConfig) -> float | None:
    """phi / phi_D, the paper's Table 1 column: forward FLOPs per token without the LM
    head over those of :func:`same_active_dense` (None where there is none)."""
    dense = same_active_dense(cfg)
    if dense is None:
        return None
    mine, theirs = count(cfg), count(dense)
    return ((mine.flops_forward - mine.flops_lm_head)
            / (theirs.flops_forward - theirs.flops_lm_head))
