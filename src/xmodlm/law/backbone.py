"""The paper's backbones and what a (K, A, N0) model built on one counts.

The paper's law and recommender speak of GQA backbones (its Table 4: 16 query and
8 KV heads, head dimensions 64 or 128 independent of the width, SwiGLU FFN,
untied embeddings, GPT-2 vocabulary of 50,257), sized by their active-equivalent
parameter label (556M ...). The project's FLOP accounting (:mod:`xmodlm.flops`)
counts attention as 4 d^2, which is right for its own models (head dimension
d / n_heads, as many KV heads as query heads) and not for these, so the law
counts the paper's backbones here, with the paper's conventions:

* parameters of a layer: Q and O d x (n_heads head_dim), K and V d x (n_kv
  head_dim), SwiGLU 3 d d_ff; norms and routers (d per sparse layer, under
  0.01%) are left out, as in the paper's N = N_layer (N0 + N1 (1 + A K)) (its
  Eq. 4); embeddings untied, 2 V d;
* forward FLOPs per token as the paper's Table 6 counts them (DESIGN 0): 2 x the
  linear weights, attention over all L keys 4 L n_heads head_dim, both scaled by
  1/K (linear) and 1/K^2 (attention) in a sparse layer; LM head and embeddings
  not counted. Training is 3 x forward.

Which blocks a model has comes from the one construction rule,
:func:`xmodlm.depth.construct`. With these rules the A4K8 and A3K16 totals of the
paper's Table 1 come out at 2.64B / 4.79B (556M), 4.52B / 8.24B (936M), and
8.31B / 15.2B (1.65B; printed 14.73B, a difference DESIGN 0 notes).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import SimpleNamespace

from xmodlm import depth
from xmodlm.config import ModelConfig
from xmodlm.errors import UserError

VOCAB = 50_257  # GPT-2
ACTIVE_LAYERS = 28  # the paper's active-equivalent depth at every size
DENSE_PREFIX = 4  # the paper's N0


@dataclass(frozen=True)
class Backbone:
    """A Qwen3-shaped GQA backbone (the paper's Table 4 row, or one of its shape)."""

    label: float  # the active-equivalent size the paper names it by (N_act), parameters
    d_model: int
    head_dim: int
    ffn_dim: int
    n_heads: int = 16
    n_kv_heads: int = 8
    vocab_size: int = VOCAB
    active_layers: int = ACTIVE_LAYERS

    @property
    def layer_params(self) -> int:
        """N_layer: weights of one block (attention with GQA, SwiGLU FFN)."""
        d, q, kv = self.d_model, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return 2 * d * q + 2 * d * kv + 3 * d * self.ffn_dim

    @property
    def embedding_params(self) -> int:
        return 2 * self.vocab_size * self.d_model  # untied input and output matrices

    @property
    def dense_total(self) -> int:
        """Total parameters of the dense model of ``active_layers`` blocks, embeddings included."""
        return self.layer_params * self.active_layers + self.embedding_params

    def layer_flops(self, context: int, fraction: float = 1.0) -> float:
        """Forward FLOPs per token of one block whose tokens are ``fraction`` of the
        sequence (1 dense, 1/K sparse): linear part x fraction, attention x fraction^2."""
        linear = 2.0 * self.layer_params
        attention = 4.0 * context * self.n_heads * self.head_dim
        return fraction * linear + fraction**2 * attention


# The paper's Table 4 (N_act label, width, head dim, FFN), all 28 layers, 16 / 8 heads.
TABLE4 = tuple(
    Backbone(label, d, hd, f)
    for label, d, hd, f in (
        (165e6, 512, 64, 1536),
        (298e6, 768, 64, 2304),
        (556e6, 1024, 128, 3072),
        (936e6, 1536, 128, 3840),
        (1.65e9, 2048, 128, 6144),
    )
)
LABEL_RTOL = 0.03  # an N_act within 3% of a Table 4 label gets that backbone


def backbone_for(active_params: float, active_layers: int = ACTIVE_LAYERS) -> Backbone:
    """The backbone of active-equivalent size ``active_params``: the paper's Table 4
    row when the size is within 3% of its label (and the depth is the paper's 28),
    else the Qwen3 shape rule (16 / 8 heads, head dim 64 below width 1024 and 128
    from it, FFN 3 d, width a multiple of 128) at the width whose dense total is
    closest to ``active_params`` in ln N."""
    if not active_params > 0:
        raise UserError(f"active_params={active_params}: must be positive")
    if active_layers < 1:
        raise UserError(f"active_layers={active_layers}: must be >= 1")
    if active_layers == ACTIVE_LAYERS:
        for b in TABLE4:
            if abs(active_params / b.label - 1) <= LABEL_RTOL:
                return b

    def shaped(d: int) -> Backbone:
        return Backbone(active_params, d, 64 if d < 1024 else 128, 3 * d,
                        active_layers=active_layers)

    target = math.log(active_params)
    width = min(range(128, 32768 + 1, 128),
                key=lambda d: abs(math.log(shaped(d).dense_total) - target))
    return shaped(width)


def backbone_of(model: ModelConfig) -> Backbone:
    """The backbone a config describes (a preset such as ``cpu-d64``): its width, heads,
    FFN, vocabulary and active-equivalent depth, named by its dense total (N_act), so
    that the recommender answers for the model a study trains rather than for the
    paper's shape of that size."""
    if model.active_layers != int(model.active_layers) or model.active_layers < 1:
        raise UserError(f"model.active_layers={model.active_layers:g}: the recommender's"
                        " backbone needs a whole active depth >= 1")
    b = Backbone(0.0, model.d_model, model.attn_head_dim, model.ffn_dim, model.n_heads,
                 model.attn_kv_heads, model.vocab_size, int(model.active_layers))
    return Backbone(float(b.dense_total), *dataclasses.astuple(b)[1:])


@dataclass(frozen=True)
class Model:
    """A (K, A, N0) model on a backbone: its blocks and its counts."""

    backbone: Backbone
    sparsity: float  # K
    anchor_stride: float  # A
    dense_prefix: int  # N0
    layout: str  # one letter per block (:func:`xmodlm.depth.paper_layout`)

    @property
    def blocks(self) -> int:
        return len(self.layout)

    @property
    def sparse_blocks(self) -> int:
        return self.layout.count(depth.SPARSE)

    @property
    def params_total(self) -> int:
        """N with embeddings (the paper's Table 1 column): N_layer x blocks + 2 V d."""
        return self.backbone.layer_params * self.blocks + self.backbone.embedding_params

    @property
    def params_non_embedding(self) -> int:
        """N of the paper's Eq. 4: N_layer x blocks."""
        return self.backbone.layer_params * self.blocks

    @property
    def params_active(self) -> float:
        """N_act of the paper's Eq. 5 with embeddings: N_layer x active depth + 2 V d."""
        active = self.blocks - self.sparse_blocks * (1 - 1 / self.sparsity)
        return self.backbone.layer_params * active + self.backbone.embedding_params

    def flops_forward(self, context: int) -> float:
        """Forward FLOPs per token as the paper's Table 6 counts them."""
        b = self.backbone
        dense_blocks = self.blocks - self.sparse_blocks
        return (dense_blocks * b.layer_flops(context)
                + self.sparse_blocks * b.layer_flops(context, 1 / self.sparsity))


def build(backbone: Backbone, sparsity: float, anchor_stride: float,
          dense_prefix: int = DENSE_PREFIX) -> Model:
    """The model of the paper's construction at the backbone's active depth; raises
    :class:`xmodlm.depth.DepthError` where (K, A, N0) cannot be built there."""
    layout = depth.paper_layout(sparsity, anchor_stride, dense_prefix, backbone.active_layers)
    return Model(backbone, float(sparsity), float(anchor_stride), dense_prefix, layout)


def model_config(m: Model, context: int) -> ModelConfig:
    """``m`` as the project's model config (the paper's backbone shape: GQA, QK-norm,
    untied embeddings), for the run-record columns :func:`xmodlm.record.config_row`
    fills; its counts under the paper's conventions are :func:`paper_counts`."""
    b = m.backbone
    return ModelConfig(
        vocab_size=b.vocab_size, d_model=b.d_model, n_heads=b.n_heads, n_kv_heads=b.n_kv_heads,
        head_dim=b.head_dim, qk_norm=True, d_ff=b.ffn_dim, context=context,
        active_layers=float(b.active_layers), dense_prefix=m.dense_prefix,
        sparsity=m.sparsity, anchor_stride=m.anchor_stride if m.sparse_blocks else 1.0,
        tie_embeddings=False,
    )


def paper_counts(m: Model, context: int) -> SimpleNamespace:
    """The counts a run record carries, as the paper counts them: N with embeddings,
    N_act without them (the record's ``params_active``), training FLOPs 3 x Table 6's
    forward."""
    return SimpleNamespace(
        params_total=m.params_total, params_non_embedding=m.params_non_embedding,
        params_active=m.params_active - m.backbone.embedding_params,
        flops_train=3 * m.flops_forward(context))

