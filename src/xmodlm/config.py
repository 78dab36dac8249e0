"""Typed configuration: nested dataclasses, YAML presets, ``--set`` overrides.

One configuration space covers every family. Dense, MoD and X-MoD differ only in
(K, A, N0, gating, balancing); MoE is a choice of MLP. The per-block layout string
(``D`` dense/anchor, ``s`` sparse, ``E`` MoE) is derived from those knobs by the
paper's construction (:mod:`xmodlm.depth`; the earlier (stride, capacity) are
aliases, resolved there too) unless given explicitly, and the model is built from
the layout alone.

Every value a user can set is validated in :meth:`Config.validate`; errors raise
:class:`~xmodlm.errors.UserError` naming the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from xmodlm import depth, record
from xmodlm.depth_routers import kinds as depth_router_kinds
from xmodlm.errors import UserError
from xmodlm.presets import read_yaml, with_bases
from xmodlm.typed import build, load_yaml

GATINGS = ("logit", "sigmoid", "variance_scaled")
# block: g (a + f), the whole routed residual (X-MoD, Eq. 7); ffn: a + g f (MoD, Eq. 6)
GATE_SCOPES = ("block", "ffn")
BALANCES = ("token_bias", "cv", "none")
CAUSAL_ROUTERS = tuple(sorted(depth_router_kinds()))  # xmodlm.depth_routers
CAUSAL_THRESHOLDS = ("calibrated", "half")  # xmodlm.model.depth_router
MLPS = ("swiglu", "moe")
MOE_ROUTERS = ("switch", "fine")  # xmodlm.model.moe.make_router
SCHEDULES = ("cosine", "wsd", "constant")
DTYPES = ("auto", "bf16", "fp32")
COMPILE_MODES = ("auto", "on", "off")
SEED_MAX = 2**32 - 1
"""The largest seed every generator takes: numpy's stop at 2**32 - 1, torch's at 2**64 - 1."""


@dataclass
class ModelConfig:
    """Architecture. ``context`` is the training context length T."""

    vocab_size: int = 4096
    d_model: int = 256
    n_layers: int = 8
    n_heads: int = 4
    # grouped-query attention: n_heads query heads share n_kv_heads key/value heads
    # (0: n_kv_heads = n_heads, plain multi-head); the cache holds only the latter
    n_kv_heads: int = 0
    head_dim: int = 0  # 0: d_model // n_heads; else free of d_model (Qwen3-style)
    qk_norm: bool = False  # RMSNorm of each query and key head before rotary (Qwen3)
    d_ff: int = 0  # 0: SwiGLU default, 8/3 * d_model rounded up to a multiple of 32
    context: int = 256
    # --- sparse depth (xmodlm.depth) ---------------------------------------------
    # the paper's description: [D] x N0 + ([S(K)] x A*K + [D]) x N1, sized by its
    # active-equivalent depth N0 + N1 (1 + A); active_layers 0: n_layers blocks
    # from (stride, capacity) instead, or the explicit layout
    sparsity: float = 1.0  # K: a sparse block processes the top 1/K of a sequence
    anchor_stride: float = 1.0  # A: A*K sparse blocks between two anchors
    dense_prefix: int = 4  # N0: dense blocks before the first stage
    active_layers: float = 0.0  # N0 + N1 (1 + A)
    anchors: bool = True  # false: each anchor after the prefix becomes K sparse blocks
    # aliases of earlier versions: S = A K + 1, c = 1 / K
    stride: int = 1  # S: every S-th block is a dense anchor (S=1: all dense)
    capacity: float = 1.0  # c: fraction of each sequence a sparse block processes
    layout: str = ""  # explicit per-block layout; empty: derived
    gating: str = "variance_scaled"  # logit | sigmoid | variance_scaled
    gate_scope: str = "block"  # block: x + g (a + f) | ffn: x + a + g f (MoD)
    # depth-wise token balancing: token_bias (r = sigmoid(s - tau b), b a token's
    # selections so far in its stage) | cv (squared-CV loss, weight balance_coef) | none
    balance: str = "token_bias"
    token_bias_tau: float = 1.0
    token_bias_step: float = 1.0  # what b grows by at each selection
    balance_coef: float = 0.0  # weight of the cv balancing loss
    causal_router: str = "bce"  # bce: BCE on router logits | predictor: stop-grad MLP
    causal_coef: float = 1e-2  # weight of the causal-decision BCE loss
    # calibrated: each sparse block's inference threshold routes c of the tokens
    # (set after training and at every evaluation); half: sigmoid(r) > 1/2
    causal_threshold: str = "calibrated"
    # --- MLP / MoE ------------------------------------------------------------
    mlp: str = "swiglu"  # swiglu | moe
    n_experts: int = 8
    moe_top_k: int = 2
    moe_router: str = "switch"  # switch: softmax + z-loss | fine: sigmoid + balancing bias
    moe_d_ff: int = 0  # expert width; 0: ffn_dim / moe_granularity
    moe_granularity: int = 1  # G: experts of width ffn_dim / G (when moe_d_ff is 0)
    moe_shared: int = 0  # always-on shared experts of the expert width (0: none)
    moe_aux_coef: float = 1e-2  # load-balancing loss weight (both routers)
    moe_z_coef: float = 1e-3  # router z-loss weight (switch router only)
    # fine router only: per-step move of the selection bias toward even load (0: off)
    moe_bias_rate: float = 1e-3
    # --- misc -----------------------------------------------------------------
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    tie_embeddings: bool = False

    @property
    def attn_head_dim(self) -> int:
        """The head dim in effect: ``head_dim``, or d_model // n_heads when it is 0."""
        return self.head_dim or self.d_model // self.n_heads

    @property
    def attn_kv_heads(self) -> int:
        """Key/value heads in effect: ``n_kv_heads``, or n_heads when it is 0."""
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.d_ff > 0:
            return self.d_ff
        return 32 * math.ceil(8 * self.d_model / 3 / 32)

    @property
    def expert_dim(self) -> int:
        """Width of every expert, routed and shared: ``moe_d_ff``, else ffn_dim / G."""
        return self.moe_d_ff if self.moe_d_ff > 0 else self.ffn_dim // self.moe_granularity

    @property
    def depth(self) -> depth.Depth:
        """The sparse depth with every description filled in: (K, A, N0), (S, c) and
        the layout, resolved in one place (:func:`xmodlm.depth.resolve`)."""
        try:
            return depth.resolve(
                n_layers=self.n_layers, stride=self.stride, capacity=self.capacity,
                layout=self.layout, sparsity=self.sparsity, anchor_stride=self.anchor_stride,
                dense_prefix=self.dense_prefix, active_layers=self.active_layers,
                anchors=self.anchors, dense="E" if self.mlp == "moe" else "D",
            )
        except depth.DepthError as err:
            raise UserError(str(err)) from None

    @property
    def block_layout(self) -> str:
        """One letter per block: ``D`` dense/anchor, ``s`` sparse, ``E`` MoE."""
        return self.depth.layout

    @property
    def num_blocks(self) -> int:
        """Blocks the model has (``n_layers`` unless the paper's construction sets it)."""
        return len(self.block_layout)

    @property
    def token_bias(self) -> float:
        """tau of the token-choice bias in effect (0: none)."""
        return self.token_bias_tau if self.balance == "token_bias" else 0.0

    @property
    def cv_coef(self) -> float:
        """Weight of the squared-CV balancing loss in effect (0: none)."""
        return self.balance_coef if self.balance == "cv" else 0.0

    @property
    def family(self) -> str:
        """The family name used in run records (:func:`xmodlm.record.family`; derived,
        never branched on in the model)."""
        return record.family(self.block_layout, self.gating, self.depth.stride, self.gate_scope)

    def validate(self) -> None:
        _positive(self, "vocab_size", "d_model", "n_layers", "n_heads", "context")
        if self.vocab_size < 2:  # one token leaves nothing to predict
            raise UserError(f"model.vocab_size={self.vocab_size}: must be an integer >= 2")
        if not (0.0 < self.capacity <= 1.0):
            raise UserError(f"model.capacity={self.capacity}: must be in (0, 1]")
        if self.stride < 1:
            raise UserError(f"model.stride={self.stride}: must be an integer >= 1")
        if self.sparsity < 1:
            raise UserError(f"model.sparsity={self.sparsity}: must be >= 1 (K; 1 is dense)")
        if self.anchor_stride < 0 or self.active_layers < 0 or self.dense_prefix < 0:
            raise UserError(
                "model.anchor_stride, model.active_layers and model.dense_prefix must be >= 0"
            )
        if self.token_bias_tau < 0 or self.token_bias_step <= 0:
            raise UserError(
                f"model.token_bias_tau={self.token_bias_tau} must be >= 0 and"
                f" model.token_bias_step={self.token_bias_step} > 0"
            )
        _choice(self, "balance", BALANCES)
        _choice(self, "gate_scope", GATE_SCOPES)
        resolved = self.depth  # a (K, A, N0) the construction cannot build fails here
        if resolved.construction == "stride" and self.n_layers % resolved.stride != 0:
            raise UserError(
                f"model.n_layers={self.n_layers} is not a multiple of the anchor stride"
                f" S = A*K + 1 = {resolved.stride}: depth must be a multiple of it (or set"
                " model.active_layers for the paper's construction)"
            )
        self._validate_heads()
        _choice(self, "gating", GATINGS)
        _choice(self, "causal_router", CAUSAL_ROUTERS)
        _choice(self, "causal_threshold", CAUSAL_THRESHOLDS)
        _choice(self, "mlp", MLPS)
        if self.layout:
            bad = set(self.layout) - set("DsE")
            if bad or len(self.layout) != self.n_layers:
                raise UserError(
                    f"model.layout={self.layout!r}: must be {self.n_layers} letters"
                    " (n_layers) from D (dense), s (sparse), E (MoE)"
                )
        if "E" in self.block_layout:
            self._validate_moe()
        for key in ("balance_coef", "causal_coef", "moe_aux_coef", "moe_z_coef", "d_ff", "moe_d_ff",
                    "moe_shared", "moe_bias_rate"):
            if getattr(self, key) < 0:
                raise UserError(f"model.{key}={getattr(self, key)}: must be >= 0")
        if self.rope_theta <= 1.0:
            raise UserError(
                f"model.rope_theta={self.rope_theta}: must be > 1 (the rotary base; the"
                " frequencies theta^(-2i/d) must fall with i)"
            )
        if self.norm_eps <= 0.0:
            raise UserError(f"model.norm_eps={self.norm_eps}: must be > 0 (it keeps 1/rms finite)")
        if self.init_std <= 0.0:
            raise UserError(f"model.init_std={self.init_std}: must be > 0")

    def _validate_heads(self) -> None:
        """Query heads must group evenly over the key/value heads, and the head dim
        must be even (rotary turns pairs); d_model need only divide by n_heads when
        the head dim is derived from it."""
        if self.n_kv_heads < 0 or self.head_dim < 0:
            raise UserError(
                f"model.n_kv_heads={self.n_kv_heads}, model.head_dim={self.head_dim}:"
                " must be >= 0 (0: n_heads and d_model // n_heads)"
            )
        if self.n_heads % self.attn_kv_heads != 0:
            raise UserError(
                f"model.n_heads={self.n_heads} is not divisible by"
                f" model.n_kv_heads={self.n_kv_heads}: query heads share key/value heads in"
                " equal groups"
            )
        if not self.head_dim and self.d_model % self.n_heads != 0:
            raise UserError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}"
                " (or set model.head_dim)"
            )
        if self.attn_head_dim % 2 != 0:
            name = "model.head_dim" if self.head_dim else "model.d_model/n_heads"
            raise UserError(f"{name}={self.attn_head_dim}: rotary needs an even head dim")

    def _validate_moe(self) -> None:
        """The MoE fields, checked only where a block is MoE (elsewhere they are unused)."""
        _choice(self, "moe_router", MOE_ROUTERS)
        if self.n_experts < 1:
            raise UserError(f"model.n_experts={self.n_experts}: must be >= 1")
        if not (1 <= self.moe_top_k <= self.n_experts):
            raise UserError(
                f"model.moe_top_k={self.moe_top_k}: must be in [1, n_experts={self.n_experts}]"
            )
        if self.moe_granularity < 1:
            raise UserError(f"model.moe_granularity={self.moe_granularity}: must be an integer >= 1")
        if self.moe_d_ff == 0 and self.ffn_dim % self.moe_granularity != 0:
            raise UserError(
                f"model.moe_granularity={self.moe_granularity} does not divide the FFN width"
                f" {self.ffn_dim}: choose a divisor, or set model.moe_d_ff"
            )


@dataclass
class DataConfig:
    """Where the prepared token files live (``xmod data prepare --out DIR``)."""

    dir: str = "data/corpus"
    val_batches: int = 8  # fixed validation batches per evaluation

    def validate(self) -> None:
        if not self.dir.strip():
            raise UserError("data.dir is empty: give the directory of `xmod data prepare --out`")
        if self.val_batches < 1:
            raise UserError(f"data.val_batches={self.val_batches}: must be an integer >= 1")


OPTIMIZERS = ("adamw", "muon")


@dataclass
class TrainConfig:
    """Optimisation, budget, schedule, precision, logging and checkpoints."""

    seed: int = 0
    batch_size: int = 16  # sequences per micro-batch (per rank); with batch_tokens, its cap
    grad_accum: int = 1
    # > 0: tokens per optimiser step at any context (batch x grad_accum x ranks derived)
    batch_tokens: int = 0
    # budget: max_steps caps everything; else tokens; else compute C (FLOPs) -> D = C / F
    max_steps: int = 0
    tokens: int = 0
    compute: float = 0.0
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    warmup_frac: float = 0.0  # > 0: warmup is this fraction of the run's steps (replaces warmup_steps)
    schedule: str = "cosine"  # cosine | wsd | constant
    cooldown_frac: float = 0.2  # wsd: fraction of steps in the final linear decay
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # adamw | muon (Muon on hidden weight matrices, AdamW on the rest: docs/training.md)
    optimizer: str = "adamw"
    adamw_lr: float = 0.0  # muon: peak lr of the AdamW-trained parameters; 0 = train.lr
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5  # Newton-Schulz iterations
    muon_rms_match: float = 0.2  # update RMS = this x learning rate (AdamW's typical RMS)
    dtype: str = "auto"  # autocast dtype; auto: bf16 where the hardware has it, else fp32
    compile: str = "off"  # auto | on | off
    device: str = "auto"  # auto | cpu | cuda
    eval_every: int = 100
    log_every: int = 10
    ckpt_every: int = 200
    keep_last: int = 2
    max_bad_steps: int = 5  # consecutive non-finite losses before the run is "diverged"
    fsdp: bool = False
    tensorboard: bool = False  # TensorBoard event files in RUN_DIR/tb (needs tensorboard)
    wandb: bool = False  # Weights & Biases (needs wandb); a resumed run continues the same W&B run
    wandb_project: str = ""  # empty: W&B's default project
    wandb_entity: str = ""  # empty: W&B's default entity
    wandb_tags: str = ""  # comma-separated

    def validate(self) -> None:
        _positive(self, "batch_size", "grad_accum", "keep_last", "eval_every", "log_every",
                  "ckpt_every", "max_bad_steps")
        if not 0 <= self.seed <= SEED_MAX:
            raise UserError(f"train.seed={self.seed}: must be an integer in 0..{SEED_MAX}")
        _choice(self, "schedule", SCHEDULES)
        _choice(self, "optimizer", OPTIMIZERS)
        _choice(self, "dtype", DTYPES)
        _choice(self, "compile", COMPILE_MODES)
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise UserError(f"train.device={self.device!r}: must be one of auto, cpu, cuda")
        for key in ("max_steps", "tokens", "compute", "warmup_steps", "lr", "weight_decay",
                    "adamw_lr", "batch_tokens"):
            if getattr(self, key) < 0:
                raise UserError(f"train.{key}={getattr(self, key)}: must be >= 0")
        if not (0.0 <= self.cooldown_frac <= 1.0):
            raise UserError(f"train.cooldown_frac={self.cooldown_frac}: must be in [0, 1]")
        if not (0.0 <= self.min_lr_ratio <= 1.0):
            raise UserError(f"train.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        for key in ("beta1", "beta2", "muon_momentum"):
            if not (0.0 <= getattr(self, key) < 1.0):
                raise UserError(
                    f"train.{key}={getattr(self, key)}: must be in [0, 1) (a momentum decay)"
                )
        if not (0.0 <= self.warmup_frac < 1.0):
            raise UserError(
                f"train.warmup_frac={self.warmup_frac}: must be in [0, 1) (0: use warmup_steps)"
            )
        if not (1 <= self.muon_ns_steps <= 20):
            raise UserError(
                f"train.muon_ns_steps={self.muon_ns_steps}: must be an integer in 1..20"
                " (Newton-Schulz iterations; 5 is the usual)"
            )
        if self.muon_rms_match <= 0.0:
            raise UserError(
                f"train.muon_rms_match={self.muon_rms_match}: must be > 0 (the update's RMS"
                " relative to the learning rate; 0.2 matches AdamW)"
            )
        if self.grad_clip <= 0.0:
            raise UserError(
                f"train.grad_clip={self.grad_clip}: must be > 0 (the largest gradient norm;"
                " a huge value such as 1e9 leaves gradients unclipped)"
            )
        if self.batch_tokens > 0 and self.grad_accum != 1:
            raise UserError(
                f"train.grad_accum={self.grad_accum} with train.batch_tokens: grad_accum is derived"
                " from batch_tokens, leave it at 1 (train.batch_size caps the micro-batch)"
            )

    def warmup(self, total_steps: int) -> int:
        """Warmup steps of a run of ``total_steps``: ``warmup_frac`` of them (rounded up)
        when set, else ``warmup_steps``. The paper warms up over 1% of each run, which
        keeps the schedule's shape across budgets; a fixed count does not."""
        if self.warmup_frac > 0:
            return math.ceil(self.warmup_frac * total_steps)
        return self.warmup_steps


_ON_OFF = frozenset({(TrainConfig, "compile")})
"""String settings whose values include on/off, which YAML 1.1 reads as true/false."""


@dataclass
class Config:
    """The full, resolved configuration of one run."""

    name: str = "custom"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self) -> Config:
        """Check every value before any work: finite numbers only, bounds of the maths."""
        for section in (self.model, self.data, self.train):
            _finite(section)
        if not self.name.strip():
            raise UserError("name is empty: give the run a name (it labels records and reports)")
        self.model.validate()
        self.data.validate()
        self.train.validate()
        if 0 < self.train.batch_tokens < self.model.context:
            raise UserError(
                f"train.batch_tokens={self.train.batch_tokens}: less than one sequence of"
                f" model.context={self.model.context} tokens (0: batch_size sequences)"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "config") -> Config:
        return build(cls, _balance_from_coef(raw), where, on_off=_ON_OFF)

    def merge(self, overrides: list[str] | tuple[str, ...]) -> Config:
        """Return a copy with ``key.path=value`` overrides applied (values parsed as YAML)."""
        raw = self.to_dict()
        for item in overrides:
            if "=" not in item:
                raise UserError(f"--set {item!r}: expected key.path=value, e.g. model.stride=4")
            key, value = item.split("=", 1)
            key = key if key.isprintable() else repr(key)  # its messages stay one line
            parts = key.strip().split(".")
            node = raw
            for i, part in enumerate(parts):
                if not isinstance(node, dict) or part not in node:
                    known = ", ".join(sorted(node)) if isinstance(node, dict) else "(none)"
                    path = ".".join(parts[: i + 1])
                    raise UserError(f"--set {key}: unknown key {path!r}; known here: {known}")
                if i == len(parts) - 1:
                    if isinstance(node[part], dict):
                        raise UserError(f"--set {key}: is a section, set one of its keys")
                    node[part] = load_yaml(value, f"--set {key}: value {value!r}") if value else ""
                else:
                    node = node[part]
        return Config.from_dict(raw, where="")


def _balance_from_coef(raw: Any) -> Any:
    """``raw`` with ``model.balance`` filled in where the model section names
    ``balance_coef`` but not ``balance``: the squared-CV loss at that weight, or none
    at 0. That is what such a section meant before ``balance`` existed (every run
    config written then states ``balance_coef`` and trained so), and what a user who
    sets only the CV weight asks for; the token-choice bias must be named."""
    model = raw.get("model") if isinstance(raw, dict) else None
    if not isinstance(model, dict) or "balance" in model or "balance_coef" not in model:
        return raw
    try:
        coef = float(model["balance_coef"])
    except (TypeError, ValueError):
        return raw  # the typed build names the bad value
    return {**raw, "model": {**model, "balance": "cv" if coef > 0 else "none"}}


RESUME_FREE = frozenset({
    "device", "compile", "eval_every", "log_every", "ckpt_every", "keep_last", "max_bad_steps",
    "tensorboard", "wandb", "wandb_project", "wandb_entity", "wandb_tags",
})
"""Train settings a resumed run may change freely: they do not change what is trained
(the trainer checks a resume against them; a sweep lets ``--set`` change only these)."""


def _section(obj: Any) -> str:
    return {ModelConfig: "model", DataConfig: "data"}.get(type(obj), "train")


def _finite(obj: Any) -> None:
    """Every number of a section is finite: nan and inf pass a range check by accident."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"{_section(obj)}.{f.name}={value}: must be a finite number")


def _positive(obj: Any, *keys: str) -> None:
    section = _section(obj)
    for key in keys:
        if getattr(obj, key) < 1:
            raise UserError(f"{section}.{key}={getattr(obj, key)}: must be an integer >= 1")


def _choice(obj: Any, key: str, allowed: tuple[str, ...]) -> None:
    section = _section(obj)
    if getattr(obj, key) not in allowed:
        raise UserError(f"{section}.{key}={getattr(obj, key)!r}: must be one of {', '.join(allowed)}")


# --- presets ----------------------------------------------------------------------


def load_config(
    name_or_path: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    vocab_from_data: bool = False,
) -> Config:
    """Load a preset by name (``xmod-tiny``) or a YAML file, apply overrides, validate.

    A YAML file may say ``base: PRESET`` (or a YAML path) to start from another
    config; that base may have its own base, and the whole chain is merged, the
    nearest file winning (:func:`xmodlm.presets.with_bases`).

    With ``vocab_from_data`` (what ``xmod train`` asks for), ``model.vocab_size``
    is the vocabulary of the prepared corpus in ``data.dir`` unless the chain or the
    overrides set it: a user's 77k-token tokenizer then needs no second setting, and
    a preset that leaves it unset resolves, on the default corpus, to exactly the
    config (and so the run id) it always did. A config written by a run or a sweep
    states every field, so it never changes under it.
    """
    raw = with_bases(name_or_path, [])
    cfg = Config.from_dict(raw, where="")
    if overrides:
        cfg = cfg.merge(list(overrides))
    if vocab_from_data and not _sets_vocab(raw, overrides):
        cfg = _with_data_vocab(cfg)
    return cfg.validate()


def own_settings(name_or_path: str | Path) -> dict[str, Any]:
    """The settings a preset or YAML file states itself, without those of its base:
    what makes ``paper-556m-mod`` the MoD, whatever backbone it sits on."""
    raw = read_yaml(name_or_path)
    raw.pop("base", None)
    return raw


def _sets_vocab(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> bool:
    """Whether the merged YAML chain ``raw`` or an override names ``model.vocab_size``."""
    model = raw.get("model")
    return (isinstance(model, dict) and "vocab_size" in model) or any(
        o.partition("=")[0].strip() == "model.vocab_size" for o in overrides)


def _with_data_vocab(cfg: Config) -> Config:
    """``cfg`` with the vocabulary of the corpus in ``data.dir``; unchanged where there
    is no manifest yet (training then says the data is missing, in its own words)."""
    from xmodlm.data.batches import MANIFEST_FILE, load_manifest

    if not (Path(cfg.data.dir) / MANIFEST_FILE).is_file():
        return cfg
    vocab = load_manifest(cfg.data.dir)["vocab_size"]
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))
