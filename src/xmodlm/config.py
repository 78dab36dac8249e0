"""Typed configuration: nested dataclasses, YAML presets, ``--set`` overrides.

One configuration space covers every family. Dense, MoD and X-MoD differ only in
(stride, capacity, gating, balancing); MoE is a choice of MLP. The per-block
layout string (``D`` dense/anchor, ``s`` sparse, ``E`` MoE) is derived from those
knobs unless given explicitly, and the model is built from the layout alone.

Every value a user can set is validated in :meth:`Config.validate`; errors raise
:class:`~xmodlm.errors.UserError` naming the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from xmodlm import record
from xmodlm.errors import UserError
from xmodlm.model.depth_routers import kinds as depth_router_kinds

GATINGS = ("logit", "sigmoid", "variance_scaled")
CAUSAL_ROUTERS = tuple(sorted(depth_router_kinds()))  # xmodlm.model.depth_routers
CAUSAL_THRESHOLDS = ("calibrated", "half")  # xmodlm.model.depth_router
MLPS = ("swiglu", "moe")
MOE_ROUTERS = ("switch", "fine")  # xmodlm.model.moe.make_router
SCHEDULES = ("cosine", "wsd", "constant")
DTYPES = ("auto", "bf16", "fp32")
COMPILE_MODES = ("auto", "on", "off")


@dataclass
class ModelConfig:
    """Architecture. ``context`` is the training context length T."""

    vocab_size: int = 4096
    d_model: int = 256
    n_layers: int = 8
    n_heads: int = 4
    d_ff: int = 0  # 0: SwiGLU default, 8/3 * d_model rounded up to a multiple of 32
    context: int = 256
    # --- sparse depth -------------------------------------------------------
    stride: int = 1  # S: every S-th block is a dense anchor (S=1: all dense)
    capacity: float = 1.0  # c: fraction of each sequence a sparse block processes
    layout: str = ""  # explicit per-block layout; empty: derived from (stride, capacity)
    gating: str = "variance_scaled"  # logit | sigmoid | variance_scaled
    balance_coef: float = 0.0  # depth-wise token balancing loss weight (0: off, no cost)
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
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

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
    def block_layout(self) -> str:
        """One letter per block: ``D`` dense/anchor, ``s`` sparse, ``E`` MoE; the explicit
        ``layout`` if given, else derived from (stride, capacity) by
        :func:`xmodlm.record.derive_layout`."""
        if self.layout:
            return self.layout
        return record.derive_layout(self.n_layers, self.stride, self.capacity, self.mlp)

    @property
    def family(self) -> str:
        """The family name used in run records (:func:`xmodlm.record.family`; derived,
        never branched on in the model)."""
        return record.family(self.block_layout, self.gating, self.stride)

    def validate(self) -> None:
        _positive(self, "vocab_size", "d_model", "n_layers", "n_heads", "context")
        if not (0.0 < self.capacity <= 1.0):
            raise UserError(f"model.capacity={self.capacity}: must be in (0, 1]")
        if self.stride < 1:
            raise UserError(f"model.stride={self.stride}: must be an integer >= 1")
        if not self.layout and self.n_layers % self.stride != 0:
            raise UserError(
                f"model.n_layers={self.n_layers} is not a multiple of model.stride={self.stride}:"
                " depth must be a multiple of the anchor stride"
            )
        if self.d_model % self.n_heads != 0:
            raise UserError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}"
            )
        if self.head_dim % 2 != 0:
            raise UserError(f"model.d_model/n_heads={self.head_dim}: rotary needs an even head dim")
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


@dataclass
class TrainConfig:
    """Optimisation, budget, schedule, precision, logging and checkpoints."""

    seed: int = 0
    batch_size: int = 16  # sequences per micro-batch (per rank)
    grad_accum: int = 1
    # budget: max_steps caps everything; else tokens; else compute C (FLOPs) -> D = C / F
    max_steps: int = 0
    tokens: int = 0
    compute: float = 0.0
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    schedule: str = "cosine"  # cosine | wsd | constant
    cooldown_frac: float = 0.2  # wsd: fraction of steps in the final linear decay
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
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
        if self.seed < 0:
            raise UserError(f"train.seed={self.seed}: must be an integer >= 0")
        _choice(self, "schedule", SCHEDULES)
        _choice(self, "dtype", DTYPES)
        _choice(self, "compile", COMPILE_MODES)
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise UserError(f"train.device={self.device!r}: must be one of auto, cpu, cuda")
        for key in ("max_steps", "tokens", "compute", "warmup_steps", "lr", "weight_decay"):
            if getattr(self, key) < 0:
                raise UserError(f"train.{key}={getattr(self, key)}: must be >= 0")
        if not (0.0 <= self.cooldown_frac <= 1.0):
            raise UserError(f"train.cooldown_frac={self.cooldown_frac}: must be in [0, 1]")
        if not (0.0 <= self.min_lr_ratio <= 1.0):
            raise UserError(f"train.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        for key in ("beta1", "beta2"):
            if not (0.0 <= getattr(self, key) < 1.0):
                raise UserError(
                    f"train.{key}={getattr(self, key)}: must be in [0, 1) (an AdamW moment decay)"
                )
        if self.grad_clip <= 0.0:
            raise UserError(
                f"train.grad_clip={self.grad_clip}: must be > 0 (the largest gradient norm;"
                " a huge value such as 1e9 leaves gradients unclipped)"
            )


_ON_OFF = {(TrainConfig, "compile")}
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
        self.model.validate()
        self.data.validate()
        self.train.validate()
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "config") -> Config:
        return _build(cls, raw, where)

    def merge(self, overrides: list[str] | tuple[str, ...]) -> Config:
        """Return a copy with ``key.path=value`` overrides applied (values parsed as YAML)."""
        raw = self.to_dict()
        for item in overrides:
            if "=" not in item:
                raise UserError(f"--set {item!r}: expected key.path=value, e.g. model.stride=4")
            key, value = item.split("=", 1)
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
                    try:
                        node[part] = yaml.safe_load(value) if value != "" else ""
                    except yaml.YAMLError:
                        raise UserError(f"--set {key}: value {value!r} is not valid YAML") from None
                else:
                    node = node[part]
        return Config.from_dict(raw, where="")


@dataclass
class Budget:
    """How long a run trains: its optimiser steps, the tokens each step takes (on all
    ranks) and which setting set them (max_steps, tokens or compute)."""

    total_steps: int
    tokens_per_step: int
    source: str


def resolve_budget(cfg: Config, world_size: int) -> Budget:
    """Steps from train.max_steps, else the token budget, else compute C (D = C / F).
    Here, beside the settings it reads, because the trainer and a sweep's plan must
    count the same steps."""
    from xmodlm import flops  # flops reads ModelConfig from this module

    t = cfg.train
    per_step = t.batch_size * t.grad_accum * world_size * cfg.model.context
    if t.max_steps > 0:
        return Budget(t.max_steps, per_step, "max_steps")
    if t.tokens > 0:
        tokens, source = float(t.tokens), "tokens"
    elif t.compute > 0:
        tokens, source = t.compute / flops.count(cfg.model).flops_train, "compute"
    else:
        raise UserError(
            "no training budget: set train.max_steps, train.tokens or train.compute (FLOPs)"
        )
    steps = int(tokens // per_step)
    if steps < 1:
        raise UserError(
            f"train.{source} gives {tokens:.3g} tokens, less than one batch of {per_step} tokens"
            " (batch_size x grad_accum x ranks x context): raise the budget or shrink the batch"
        )
    return Budget(steps, per_step, source)


RESUME_FREE = frozenset({
    "device", "compile", "eval_every", "log_every", "ckpt_every", "keep_last", "max_bad_steps",
    "tensorboard", "wandb", "wandb_project", "wandb_entity", "wandb_tags",
})
"""Train settings a resumed run may change freely: they do not change what is trained
(the trainer checks a resume against them; a sweep lets ``--set`` change only these)."""


def _build(cls: type, raw: Any, where: str) -> Any:
    """Build dataclass ``cls`` from ``raw``, rejecting unknown keys and wrong types."""
    if not isinstance(raw, dict):
        raise UserError(f"{where}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(raw) - names
    if unknown:
        raise UserError(
            f"{where}: unknown key {sorted(unknown)[0]!r}; allowed: {', '.join(sorted(names))}"
        )
    kwargs = {}
    for name, value in raw.items():
        if (cls, name) in _ON_OFF and isinstance(value, bool):  # YAML reads on/off as booleans
            value = "on" if value else "off"
        kwargs[name] = _coerce(hints[name], value, f"{where}.{name}" if where else name)
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, where: str) -> Any:
    if tp in (int, float) and isinstance(value, str):
        try:  # YAML 1.1 reads "1e-3" as a string
            value = float(value)
        except ValueError:
            pass
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if isinstance(tp, types.UnionType):  # only `X | None` is used
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise UserError(f"{where}={value!r}: must be true or false")
    if tp is int:
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value != int(value)
        ):
            raise UserError(f"{where}={value!r}: must be an integer")
        return int(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{where}={value!r}: must be a number")
        return float(value)
    if tp is str:
        if value is None:
            return ""
        if not isinstance(value, str):
            raise UserError(f"{where}={value!r}: must be a string")
        return value
    return value


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


def preset_names() -> list[str]:
    root = resources.files("xmodlm") / "configs"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def load_config(
    name_or_path: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    vocab_from_data: bool = False,
) -> Config:
    """Load a preset by name (``xmod-tiny``) or a YAML file, apply overrides, validate.

    A YAML file may say ``base: PRESET`` (or a YAML path) to start from another
    config; that base may have its own base, and the whole chain is merged, the
    nearest file winning (:func:`_with_bases`).

    With ``vocab_from_data`` (what ``xmod train`` asks for), ``model.vocab_size``
    is the vocabulary of the prepared corpus in ``data.dir`` unless the chain or the
    overrides set it: a user's 77k-token tokenizer then needs no second setting, and
    a preset that leaves it unset resolves, on the default corpus, to exactly the
    config (and so the run id) it always did. A config written by a run or a sweep
    states every field, so it never changes under it.
    """
    raw = _with_bases(name_or_path, [])
    cfg = Config.from_dict(raw, where="")
    if overrides:
        cfg = cfg.merge(list(overrides))
    if vocab_from_data and not _sets_vocab(raw, overrides):
        cfg = _with_data_vocab(cfg)
    return cfg.validate()


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


def _with_bases(name_or_path: str | Path, chain: list[str]) -> dict[str, Any]:
    """The settings of ``name_or_path`` merged over those of its base, and so on up
    the chain (a base dropped silently would train a different model than the file
    says); a chain that comes back to itself is refused."""
    key = str(name_or_path)
    if key in chain:
        loop = " -> ".join([*chain[chain.index(key):], key])
        raise UserError(f"config base chain loops: {loop}; a base may not lead back to itself")
    raw = _read_yaml(name_or_path)
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str) or not base.strip():
        raise UserError(f"config {key!r}: base {base!r} must be a preset name or a YAML path")
    return _deep_merge(_with_bases(base, [*chain, key]), raw)


def _read_yaml(name_or_path: str | Path) -> dict[str, Any]:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise UserError(f"config file {str(path)!r} not found")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise UserError(f"config file {str(path)!r} is not UTF-8 text (a binary file?)") from None
    else:
        res = resources.files("xmodlm") / "configs" / f"{name_or_path}.yaml"
        if not res.is_file():
            raise UserError(
                f"unknown config {str(name_or_path)!r}: give a YAML path or one of the presets:"
                f" {', '.join(preset_names())}"
            )
        text = res.read_text()
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        line = getattr(getattr(err, "problem_mark", None), "line", None)
        at = f" (line {line + 1})" if line is not None else ""
        raise UserError(f"config {str(name_or_path)!r} is not valid YAML{at}") from None
    if raw is None:
        raise UserError(
            f"config {str(name_or_path)!r} is empty (no settings): give at least `base: PRESET`"
        )
    if not isinstance(raw, dict):
        raise UserError(f"config {str(name_or_path)!r}: top level must be a mapping")
    return raw


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out
