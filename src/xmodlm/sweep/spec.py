"""Sweep specs: a YAML grid expanded into compute-matched runs with stable ids.

A spec names a base preset and crosses compute budgets C, context lengths T,
dense references (width, depth), family variants and seeds::

    name: micro-ladder
    base: micro
    compute: [3.0e12, 1.0e13]
    context: [128]
    dense: [{width: 96, n_layers: 3}, {width: 128, n_layers: 4}]
    families:
      - {family: dense}
      - {family: xmod, stride: [2, 4], capacity: [0.125, 0.25]}
      - {family: mod}
      - {family: moe, n_experts: 8, moe_top_k: 2}
    seeds: [0]
    set: [train.warmup_steps=20]

``batch_tokens`` (optional) sets each run's batch size to batch_tokens / T, so
runs at different contexts take the same tokens per optimiser step.

Every non-dense run is FLOP-matched to its dense reference (same width, depth
chosen so training FLOPs per token are closest; DESIGN 4) and every run gets the
same compute C, so D = C / F_token. A run's id is a hash of its fully resolved
configuration, so it is stable across invocations and machines.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from xmodlm import flops, record
from xmodlm.config import Config, load_config
from xmodlm.errors import UserError

FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "dense": {},
    "mod": record.MOD_RECIPE,
    "xmod": record.XMOD_DEFAULTS,
    "moe": record.MOE_DEFAULTS,
}
SPEC_KEYS = {
    "name", "base", "compute", "context", "dense", "families", "seeds", "set", "batch_tokens",
}
ROUTING_KEYS = {"stride", "capacity", "gating", "balance_coef", "causal_router", "causal_coef"}
MOE_KEYS = {"n_experts", "moe_top_k", "moe_aux_coef", "moe_z_coef"}
LAYOUT_KEYS = {"anchors"}  # "stride" (every S-th block, the default) | "first" (block 0 only)
TRAIN_KEYS = {"lr", "warmup_steps"}  # per-family training settings (e.g. tuned learning rates)


@dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: its id, resolved config and compute budget."""

    run_id: str
    cfg: Config
    compute: float

    def row(self) -> dict[str, Any]:
        m = self.cfg.model
        c = flops.count(m)
        return {
            "id": self.run_id,
            "family": m.family,
            "width": m.d_model,
            "n_layers": m.n_layers,
            "stride": m.stride,
            "capacity": m.capacity,
            "context": m.context,
            "gating": m.gating if "s" in m.block_layout else "-",
            "balance_coef": m.balance_coef,
            "seed": self.cfg.train.seed,
            "params_total": c.params_total,
            "params_active": c.params_active,
            "flops_per_token": c.flops_train,
            "tokens": self.compute / c.flops_train,
            "compute": self.compute,
        }


def spec_names() -> list[str]:
    """Names of the sweep specs shipped in the package."""
    root = resources.files("xmodlm") / "configs" / "sweeps"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def load_spec(path: str | Path) -> dict[str, Any]:
    """A spec from a YAML file, or a shipped spec by name (``micro-law``)."""
    p = Path(path)
    if not p.is_file():
        shipped = resources.files("xmodlm") / "configs" / "sweeps" / f"{path}.yaml"
        if not shipped.is_file():
            raise UserError(
                f"sweep spec {str(p)!r} not found; shipped specs: {', '.join(spec_names())}"
            )
        p = Path(str(shipped))
    try:
        spec = yaml.safe_load(p.read_text())
    except yaml.YAMLError:
        raise UserError(f"sweep spec {str(p)!r} is not valid YAML") from None
    if not isinstance(spec, dict):
        raise UserError(f"sweep spec {str(p)!r}: top level must be a mapping")
    unknown = set(spec) - SPEC_KEYS
    if unknown:
        raise UserError(
            f"sweep spec: unknown key {sorted(unknown)[0]!r}; allowed: {', '.join(sorted(SPEC_KEYS))}"
        )
    for key in ("compute", "dense", "families"):
        if not spec.get(key):
            raise UserError(f"sweep spec: {key!r} is required and must not be empty")
    return spec


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _variants(family_entry: dict[str, Any]) -> list[dict[str, Any]]:
    """Cross the list-valued keys of one family entry."""
    entry = dict(family_entry)
    family = entry.pop("family", None)
    if family not in FAMILY_DEFAULTS:
        raise UserError(
            f"sweep spec: family {family!r} unknown; allowed: {', '.join(FAMILY_DEFAULTS)}"
        )
    allowed = ROUTING_KEYS | MOE_KEYS | LAYOUT_KEYS | TRAIN_KEYS
    unknown = set(entry) - allowed
    if unknown:
        raise UserError(
            f"sweep spec: family {family}: unknown key {sorted(unknown)[0]!r};"
            f" allowed: {', '.join(sorted(allowed))}"
        )
    merged = {**FAMILY_DEFAULTS[family], **entry}
    keys = sorted(merged)
    combos = itertools.product(*(_as_list(merged[k]) for k in keys))
    return [{"family": family, **dict(zip(keys, combo, strict=True))} for combo in combos]


def run_id(cfg: Config, compute: float) -> str:
    """Stable id: hash of the resolved config (compute included, in train.compute)."""
    del compute  # already part of cfg.train
    return hashlib.sha1(cfg.to_yaml().encode()).hexdigest()[:12]


def expand(spec: dict[str, Any], data_dir: str | None = None) -> list[RunSpec]:
    """All runs of a spec, compute-matched, in a deterministic order."""
    base = spec.get("base", "micro")
    extra = [str(s) for s in _as_list(spec.get("set", []))]
    if data_dir is not None:
        extra.append(f"data.dir={data_dir}")
    runs: list[RunSpec] = []
    seen: set[str] = set()
    for compute, context, dense_ref, family_entry, seed in itertools.product(
        [float(c) for c in _as_list(spec["compute"])],
        _as_list(spec.get("context", [None])),
        _as_list(spec["dense"]),
        _as_list(spec["families"]),
        _as_list(spec.get("seeds", [0])),
    ):
        if not isinstance(dense_ref, dict) or not {"width", "n_layers"} <= set(dense_ref):
            raise UserError("sweep spec: each dense entry needs width and n_layers")
        overrides = [
            f"model.d_model={dense_ref['width']}",
            f"model.n_layers={dense_ref['n_layers']}",
            f"train.seed={seed}",
            f"train.compute={compute}",
            *extra,
        ]
        if "n_heads" in dense_ref:
            overrides.append(f"model.n_heads={dense_ref['n_heads']}")
        if context is not None:
            overrides.append(f"model.context={context}")
        if spec.get("batch_tokens"):  # the same tokens per step at every context
            T = int(context) if context is not None else load_config(base).model.context
            overrides.append(f"train.batch_size={max(1, int(spec['batch_tokens']) // T)}")
        dense_cfg = load_config(base, overrides)
        for variant in _variants(family_entry):
            cfg = _resolve_variant(dense_cfg, variant)
            rid = run_id(cfg, compute)
            if rid not in seen:
                seen.add(rid)
                runs.append(RunSpec(rid, cfg, compute))
    return runs


def _resolve_variant(dense_cfg: Config, variant: dict[str, Any]) -> Config:
    family = variant["family"]
    changes = {k: v for k, v in variant.items() if k not in {"family"} | TRAIN_KEYS}
    train = dataclasses.replace(
        dense_cfg.train, **{k: v for k, v in variant.items() if k in TRAIN_KEYS}
    )
    anchors = changes.pop("anchors", "stride")
    if anchors not in ("stride", "first"):
        raise UserError(f"sweep spec: anchors={anchors!r}: allowed: stride, first")
    model = dense_cfg.model
    if family == "dense":
        new_model = model
    elif family == "moe":
        top_k = changes.get("moe_top_k", record.MOE_DEFAULTS["moe_top_k"])
        new_model = dataclasses.replace(
            model, mlp="moe", moe_d_ff=record.moe_expert_dim(model.ffn_dim, top_k), **changes
        )
    else:
        stride, capacity = changes.pop("stride", None), changes.pop("capacity", None)
        if stride is None or capacity is None:
            raise UserError(f"sweep spec: family {family} needs stride and capacity")
        new_model, _ = flops.flop_match(
            model, int(stride), float(capacity), first_anchor_only=anchors == "first", **changes
        )
    cfg = dataclasses.replace(dense_cfg, model=new_model, train=train, name=f"{family}")
    return cfg.validate()


ASSUMED_MFU = 0.3  # small models on CPU reach roughly this share of the matmul peak


def estimate_seconds(runs: list[RunSpec], workers: int = 1) -> list[float]:
    """Rough wall time per run: compute / (measured matmul peak x ASSUMED_MFU),
    slowed by sharing the machine's cores between ``workers`` concurrent runs. The
    peak is measured in the dtype training would use here (``train.dtype=auto``):
    timing bf16 on a CPU that only emulates it would take seconds and mislead."""
    import torch

    from xmodlm.hardware import matmul_peak_gflops, resolve_dtype

    dtype = resolve_dtype("auto", torch.device("cpu"))
    rate = matmul_peak_gflops(dtype, "cpu") * 1e9 * ASSUMED_MFU / max(1, workers)
    return [r.compute / rate for r in runs]
