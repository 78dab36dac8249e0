"""An exported xmod-lm model for Hugging Face ``transformers``: needs ``torch`` and
``transformers`` only.

``xmod export RUN --out DIR`` copies this file into DIR as ``modeling_xmod.py`` and
names its classes in ``config.json`` (``auto_map``), so that anywhere, xmod-lm
installed or not::

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)
    tok = AutoTokenizer.from_pretrained(DIR, padding_side="left", trust_remote_code=True)
    batch = tok(["The whale", "A ship"], return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=20, do_sample=False)

It imports nothing of xmod-lm, so it restates the network X-MoD runs at
inference (``Transformer.forward(routing_mode="causal")`` and the sparse KV cache
of ``xmodlm.model.generate``), with the same parameter names, so that the
exported ``model.safetensors`` loads into either. The tests hold the two to the
same logits and the same greedy tokens; a change to the model's inference path
changes this file too.

**Routing.** A sparse block processes a token iff the block's decision logit for
that token (the router logit, or the ``predictor`` head's) exceeds the block's
threshold: the calibrated ``threshold`` buffer under the ``calibrated`` rule,
0 under ``half``. That decision reads the token alone, never the sequence
(top-k routing would look at future tokens), so logits at position t depend on
tokens up to t only, and a cached step computes what a full pass computes. A
processed token's branch is scaled by the block's gate (``logit``, ``sigmoid``
or ``variance_scaled``) and added to the stream; a skipped token passes
unchanged. Router logits, decisions and gates are fp32 whatever the model dtype.

**Cache.** :class:`XModCache` keeps, for each block, the keys and values of the
tokens that block processed, packed per sequence: every real token for a dense
block, only the routed ones for a sparse block, so it fills at about c of a
dense cache there. A decoding step skips a sparse block that no sequence routes.

**Padding.** Rows may be padded (left padding, as ``generate`` wants): a
padded position is never attended, routed or cached, and each sequence's
positions count its real tokens from 0, so a padded row computes what it
computes alone. Logits at padded positions are meaningless.

Logits of ids past the tokenizer's vocabulary (a model vocabulary padded beyond
it) are -inf, as ``xmod generate`` never samples them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.utils import ModelOutput

MODEL_TYPE = "xmodlm"
DECISIONS = ("bce", "predictor")  # xmodlm.depth_routers kinds this file runs
GATINGS = ("logit", "sigmoid", "variance_scaled")
NEUTRAL_GAMMA = 2.0  # gamma * sigmoid(0) = 1
# bf16 attention over at most this many keys runs in fp32 on a CPU, as xmod-lm's does
CPU_FP32_ATTENTION_MAX_KEYS = 128


class XModConfig(PretrainedConfig):
    """``config.json`` of an export: the resolved architecture (layout, widths,
    routing rule), the tokenizer's vocabulary, and xmod-lm's own config (``xmod``,
    kept for ``xmodlm.load_pretrained``; unread here)."""

    model_type = MODEL_TYPE

    def __init__(
        self,
        vocab_size: int = 4096,
        hidden_size: int = 256,
        num_attention_heads: int = 4,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        qk_norm: bool = False,
        intermediate_size: int = 704,
        max_position_embeddings: int = 256,
        layout: str = "DDDDDDDD",
        gating: str = "variance_scaled",
        gate_scope: str = "block",
        token_bias: float = 0.0,
        token_bias_step: float = 1.0,
        decision: str = "bce",
        decision_hidden: int = 0,
        threshold_rule: str = "calibrated",
        num_experts: int = 8,
        num_experts_per_tok: int = 2,
        expert_intermediate_size: int = 704,
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        tokenizer_vocab_size: int | None = None,
        use_cache: bool = True,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = len(layout)
        self.num_attention_heads = num_attention_heads
        # grouped queries and a free head dim; unset (exports before them): multi-head
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.qk_norm = qk_norm
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.layout = layout
        self.gating = gating
        # block: x + g (a + f), the whole routed branch; ffn: x + a + g f (MoD's gate)
        self.gate_scope = gate_scope
        # the token-choice bias: router logits less tau b, b a token's selections so far
        # in its stage (each adds token_bias_step), reset at every dense block; 0: none
        self.token_bias = token_bias
        self.token_bias_step = token_bias_step
        self.decision = decision
        self.decision_hidden = decision_hidden or max(1, hidden_size // 4)
        self.threshold_rule = threshold_rule
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.expert_intermediate_size = expert_intermediate_size
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.tokenizer_vocab_size = tokenizer_vocab_size
        self.use_cache = use_cache
        kwargs.pop("num_hidden_layers", None)  # the layout's length
        kwargs.setdefault("tie_word_embeddings", False)  # the file holds both matrices
        super().__init__(**kwargs)


# --- layers -----------------------------------------------------------------------------


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        inv = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * inv * self.weight.float()).to(x.dtype)


def _rotary(
    pos_BT: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) at each token's own position, (B, T, head_dim): ``cos`` is (cos, cos)
    and ``sin`` (-sin, sin) over the halves, so a rotation is x cos + roll(x) sin."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                             device=pos_BT.device) / head_dim))
    angles = pos_BT.float().unsqueeze(-1) * inv_freq
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((cos, cos), -1).to(dtype), torch.cat((-sin, sin), -1).to(dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """SDPA of (B, H, T, K) queries over (B, G, T, K) keys and values, each key/value
    head shared by H / G query heads; ``mask``: True = may attend (replaces ``causal``)."""
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" \
            and k.shape[-2] <= CPU_FP32_ATTENTION_MAX_KEYS:
        return _attend(q.float(), k.float(), v.float(), mask, causal).to(q.dtype)
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class _Attention(nn.Module):
    """Grouped-query attention: one fused projection whose rows are the queries
    (n_heads heads), keys and values (n_kv_heads each); optional RMSNorm of each query
    and key head (one gain of head_dim each) before rotary."""

    def __init__(self, config: XModConfig) -> None:
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, hd)
        q_dim, kv_dim = self.n_heads * hd, self.n_kv_heads * hd
        self.qkv = nn.Linear(d, q_dim + 2 * kv_dim, bias=False)
        self.proj = nn.Linear(q_dim, d, bias=False)
        self.q_norm = _RMSNorm(hd, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = _RMSNorm(hd, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor | None,
        causal: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output, new keys, new values); ``past``: cached (keys, values) attended first."""
        B, T, _ = x_BTD.shape
        H, G, K = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.qkv(x_BTD).split((H * K, G * K, G * K), -1)
        q, k, v = q.view(B, T, H, K), k.view(B, T, G, K), v.view(B, T, G, K)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        c, s = cos.unsqueeze(2).to(q.dtype), sin.unsqueeze(2).to(q.dtype)  # (B, T, 1, K)
        q = (q * c + q.roll(K // 2, -1) * s).transpose(1, 2)
        k = (k * c + k.roll(K // 2, -1) * s).transpose(1, 2)
        v = v.transpose(1, 2)
        keys, values = (k, v) if past is None else (torch.cat((past[0], k), 2),
                                                    torch.cat((past[1], v), 2))
        y = _attend(q, keys, values, mask, causal)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1)), k, v


class _SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class _ExpertRouter(nn.Module):
    def __init__(self, d_model: int, n_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))


class _MoE(nn.Module):
    """Token choice: each token's top-k experts by fp32 softmax, weights renormalised."""

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = _ExpertRouter(d_model, n_experts)
        self.experts = nn.ModuleList(_SwiGLU(d_model, d_ff) for _ in range(n_experts))

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        probs = F.linear(x_ND.float(), self.router.weight.float()).softmax(-1)
        weight_NK, expert_NK = probs.topk(self.top_k, dim=-1)
        weight_NK = weight_NK / weight_NK.sum(-1, keepdim=True)
        order = torch.argsort(expert_NK.flatten(), stable=True)
        token_of, weight_of = order // self.top_k, weight_NK.flatten()[order]
        counts = torch.bincount(expert_NK.flatten(), minlength=len(self.experts)).tolist()
        outs = [expert(chunk) for expert, chunk in
                zip(self.experts, x_ND[token_of].split(counts), strict=True) if chunk.shape[0]]
        y = torch.cat(outs) * weight_of.unsqueeze(-1).to(outs[0].dtype)
        return torch.zeros(B * T, D, dtype=y.dtype, device=y.device).index_add(
            0, token_of, y).view(B, T, D)


class _Block(nn.Module):
    """Pre-norm attention then MLP; returns the two parts of the branch, attention's
    a and the MLP's f (block(x) = x + a + f), and the new keys and values."""

    def __init__(self, config: XModConfig, moe: bool) -> None:
        super().__init__()
        d = config.hidden_size
        self.norm1 = _RMSNorm(d, config.rms_norm_eps)
        self.attn = _Attention(config)
        self.norm2 = _RMSNorm(d, config.rms_norm_eps)
        self.mlp = (_MoE(d, config.expert_intermediate_size, config.num_experts,
                         config.num_experts_per_tok) if moe
                    else _SwiGLU(d, config.intermediate_size))

    def forward(self, x, cos, sin, past, mask, causal):  # noqa: ANN001, ANN201
        a, k, v = self.attn(self.norm1(x), cos, sin, past, mask, causal)
        return a, self.mlp(self.norm2(x + a)), k, v


class _DepthRouter(nn.Module):
    """A sparse block's router weight, decision head (``predictor``) and threshold."""

    def __init__(self, config: XModConfig) -> None:
        super().__init__()
        if config.decision not in DECISIONS:
            raise ValueError(f"decision {config.decision!r}: this file runs {DECISIONS}")
        d, hidden = config.hidden_size, config.decision_hidden
        self.decision, self.rule = config.decision, config.threshold_rule
        self.weight = nn.Parameter(torch.empty(1, d))
        if config.decision == "predictor":
            self.head = nn.Sequential(nn.Linear(d, hidden), nn.SiLU(), nn.Linear(hidden, 1))
        self.register_buffer("threshold", torch.zeros(1))
        self.register_buffer("calibrated", torch.zeros(1, dtype=torch.bool))

    def forward(
        self, x_BTD: torch.Tensor, shift_BT: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(router logits r less the token-choice bias ``shift``, causal decision),
        both (B, T), r in fp32. The predictor's decision logit is shifted too."""
        r = torch.matmul(x_BTD.float(), self.weight.float().reshape(-1))
        if shift_BT is not None:
            r = r - shift_BT
        d = r if self.decision == "bce" else self.head(x_BTD.float()).squeeze(-1)
        if shift_BT is not None and self.decision != "bce":
            d = d - shift_BT
        threshold = self.threshold.float() if self.rule == "calibrated" else 0.0
        return r, d > threshold


class _Layer(nn.Module):
    """One letter of the layout: ``D`` dense, ``E`` MoE, ``s`` sparse (routed, gated)."""

    def __init__(self, config: XModConfig, letter: str) -> None:
        super().__init__()
        self.block = _Block(config, moe=letter == "E")
        self.sparse = letter == "s"
        self.gating = config.gating
        self.ffn_only = config.gate_scope == "ffn"
        if self.sparse:
            if config.gating not in GATINGS:
                raise ValueError(f"gating {config.gating!r}: one of {GATINGS}")
            self.router = _DepthRouter(config)
            if config.gating == "variance_scaled":
                self.gamma = nn.Parameter(torch.full((1,), NEUTRAL_GAMMA))

    def gate(self, r: torch.Tensor) -> torch.Tensor:
        if self.gating == "logit":
            return r
        return torch.sigmoid(r) * (self.gamma if self.gating == "variance_scaled" else 1.0)

    def forward(
        self, x_BTD: torch.Tensor, valid_BT: torch.Tensor, cos: torch.Tensor,
        sin: torch.Tensor, cache: _LayerCache | None, shift_BT: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream after this layer, and which tokens it processed (B, T)."""
        if not self.sparse:
            sel_BT = valid_BT
        else:
            r_BT, decide_BT = self.router(x_BTD, shift_BT)
            sel_BT = decide_BT & valid_BT
            if not bool(sel_BT.any()):  # nothing routed: the stream passes unchanged
                return x_BTD, sel_BT
        past = None if cache is None else cache.kv()
        mask, causal = _mask(sel_BT, cache, self.sparse)
        a, f, k, v = self.block(x_BTD, cos, sin, past, mask, causal)
        if cache is not None:
            cache.append(k, v, sel_BT)
        if not self.sparse:
            return x_BTD + (a + f), sel_BT
        g = (self.gate(r_BT) * sel_BT).unsqueeze(-1)
        update = a * sel_BT.unsqueeze(-1) + g * f if self.ffn_only else g * (a + f)
        return x_BTD + update.to(x_BTD.dtype), sel_BT


def _mask(
    sel_BT: torch.Tensor, cache: _LayerCache | None, sparse: bool
) -> tuple[torch.Tensor | None, bool]:
    """(mask, causal) of the new queries: each sees every cached key of its row, the
    new keys up to itself that the layer processes, and itself (so a skipped or
    padded query's row is never empty; its output is discarded). The mask is
    (B, 1, T, L + T); left out where plain causal attention (a dense layer on
    unpadded tokens, nothing cached) or no mask at all (one query that sees every
    key) computes the same."""
    B, T = sel_BT.shape
    width = 0 if cache is None else cache.width()
    if not sparse and not width and bool(sel_BT.all()):
        return None, True
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=sel_BT.device).tril()
    eye_TT = torch.eye(T, dtype=torch.bool, device=sel_BT.device)
    mask_BTL = (causal_TT & sel_BT.unsqueeze(1)) | eye_TT
    if width:
        cached_BTL = cache.valid().unsqueeze(1).expand(B, T, width)
        mask_BTL = torch.cat((cached_BTL, mask_BTL), -1)
    if bool(mask_BTL.all()):
        return None, False
    return mask_BTL.unsqueeze(1), False


# --- cache ------------------------------------------------------------------------------


class _LayerCache:
    """One layer's keys and values of the tokens it processed, packed per sequence:
    (B, G, capacity, K) over the G key/value heads, ``length`` tokens held per row;
    capacity doubles when full."""

    def __init__(self, batch: int) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = torch.zeros(batch, dtype=torch.long)
        self.longest = 0

    def width(self) -> int:
        return self.longest

    def kv(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.k is None or not self.longest:
            return None
        return self.k[:, :, : self.longest], self.v[:, :, : self.longest]

    def valid(self) -> torch.Tensor:
        slots = torch.arange(self.longest, device=self.length.device)
        return slots.unsqueeze(0) < self.length.unsqueeze(1)

    def append(self, k: torch.Tensor, v: torch.Tensor, sel_BT: torch.Tensor) -> None:
        """Pack the selected new tokens' keys and values after each row's held ones."""
        self.length = self.length.to(sel_BT.device)
        n_B = sel_BT.sum(1)
        need = int((self.length + n_B).max())
        B, H, _, K = k.shape
        if self.k is None or need > self.k.shape[2]:
            cap = max(need, 2 * (0 if self.k is None else self.k.shape[2]), 8)
            grown_k, grown_v = k.new_zeros(B, H, cap, K), v.new_zeros(B, H, cap, K)
            if self.k is not None:
                grown_k[:, :, : self.longest] = self.k[:, :, : self.longest]
                grown_v[:, :, : self.longest] = self.v[:, :, : self.longest]
            self.k, self.v = grown_k, grown_v
        b_idx, t_idx = sel_BT.nonzero(as_tuple=True)
        slot = self.length[b_idx] + (sel_BT.cumsum(1) - 1)[b_idx, t_idx]
        self.k[b_idx, :, slot] = k[b_idx, :, t_idx]
        self.v[b_idx, :, slot] = v[b_idx, :, t_idx]
        self.length = self.length + n_B
        self.longest = need

    def tokens(self) -> int:
        return int(self.length.sum())


class XModCache:
    """The sparse KV cache of a batch: one :class:`_LayerCache` per block, the real
    tokens each row has seen (its next position) and the columns fed so far."""

    def __init__(self, n_layers: int, batch: int) -> None:
        self.layers = [_LayerCache(batch) for _ in range(n_layers)]
        self.seen = torch.zeros(batch, dtype=torch.long)
        self.fed = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns of ``input_ids`` already fed (padding included), as ``generate`` counts."""
        return self.fed

    def tokens_per_layer(self) -> list[int]:
        """Tokens held per layer, summed over the batch: a sparse layer holds only its routed."""
        return [layer.tokens() for layer in self.layers]


# --- model ------------------------------------------------------------------------------


@dataclass
class XModOutput(ModelOutput):
    """Loss, logits and the cache (under both names ``transformers`` has used)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: XModCache | None = None
    past_key_values: XModCache | None = None


class XModForCausalLM(PreTrainedModel, GenerationMixin):
    """X-MoD behind the ``transformers`` causal-LM API, causal routing (module docstring).

    ``forward`` returns ``logits`` (B, T, V) in fp32 and, with ``labels``, the
    next-token cross-entropy (shifted inside, -100 ignored).
    """

    config_class = XModConfig
    base_model_prefix = "xmodlm"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules = ["_Layer"]
    # routing decisions compare fp32 logits with fp32 thresholds, whatever the dtype
    _keep_in_fp32_modules_strict = ["router.weight", "router.threshold", "router.head"]

    def __init__(self, config: XModConfig) -> None:
        super().__init__(config)
        d = config.hidden_size
        self.embed = nn.Embedding(config.vocab_size, d)
        self.blocks = nn.ModuleList(_Layer(config, letter) for letter in config.layout)
        self.norm = _RMSNorm(d, config.rms_norm_eps)
        self.head = nn.Linear(d, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        """No ``DynamicCache``: ``forward`` makes its own :class:`XModCache`."""
        return False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Plain init for a model built from its config (xmod-lm trains it; loading
        replaces every weight): normal matrices, unit norms, neutral gates."""
        std = self.config.initializer_range
        for name, p in module.named_parameters(recurse=False):
            if getattr(p, "_is_hf_initialized", False):
                continue
            if name == "gamma":
                p.fill_(NEUTRAL_GAMMA)
            elif isinstance(module, _RMSNorm):
                p.fill_(1.0)
            elif p.dim() >= 2:
                p.normal_(0.0, std)
            else:
                p.zero_()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        cache: XModCache | None = None,
        past_key_values: Any = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs: Any,
    ) -> XModOutput:
        """``attention_mask``: 0 on padding, over the cached columns and the new ones
        (as ``generate`` passes it) or the new ones only. Positions are counted per
        row from its real tokens; ``position_ids`` are not read."""
        B, T = input_ids.shape
        device = input_ids.device
        cache = next((c for c in (cache, past_key_values) if isinstance(c, XModCache)), None)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if cache is None and use_cache:
            cache = XModCache(len(self.blocks), B)
        valid_BT = torch.ones(B, T, dtype=torch.bool, device=device)
        if attention_mask is not None:
            valid_BT = attention_mask[:, -T:].to(device=device, dtype=torch.bool)
        seen_B = torch.zeros(B, dtype=torch.long, device=device) if cache is None \
            else cache.seen.to(device)
        pos_BT = (seen_B.unsqueeze(1) + valid_BT.long().cumsum(1) - 1).clamp_min(0)
        context = self.config.max_position_embeddings
        if int(pos_BT.max()) >= context:
            raise ValueError(
                f"{int(pos_BT.max()) + 1} tokens exceed the model's context of {context}"
                " (max_position_embeddings): shorten the prompt or max_new_tokens"
            )
        x = self.embed(input_ids)
        cos, sin = _rotary(pos_BT, self.config.head_dim, self.config.rope_theta, x.dtype)
        tau, step = self.config.token_bias, self.config.token_bias_step
        b_BT = torch.zeros(B, T, device=device)  # selections of each token in its stage
        for i, layer in enumerate(self.blocks):
            shift = tau * b_BT if tau > 0 and layer.sparse else None
            x, sel_BT = layer(x, valid_BT, cos, sin, None if cache is None else cache.layers[i],
                              shift)
            b_BT = b_BT + step * sel_BT if layer.sparse else torch.zeros_like(b_BT)
        logits = self.head(self.norm(x)).float()
        limit = self.config.tokenizer_vocab_size
        if limit is not None and limit < logits.shape[-1]:
            logits[..., limit:] = float("-inf")
        if cache is not None:
            cache.seen = seen_B + valid_BT.sum(1)
            cache.fed += T
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).clamp_min(-1e4),
                labels[:, 1:].reshape(-1).to(device), ignore_index=-100,
            )
        kept = cache if use_cache else None
        return XModOutput(loss=loss, logits=logits, cache=kept, past_key_values=kept)

    def prepare_inputs_for_generation(
        self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
        cache: Any = None, past_key_values: Any = None, use_cache: bool | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Feed the columns the cache has not seen (all of them without a cache)."""
        cache = next((c for c in (cache, past_key_values) if isinstance(c, XModCache)), None)
        if cache is not None:
            input_ids = input_ids[:, cache.fed:]
        return {"input_ids": input_ids, "attention_mask": attention_mask, "cache": cache,
                "use_cache": use_cache}
