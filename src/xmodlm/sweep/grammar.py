"""A sweep spec's grammar: the keys it may hold and the values each may take.

:func:`check_spec` reads a loaded spec (``xmodlm.sweep.spec.load_spec``, or a
mapping built in Python) before anything expands, so that a fault is one
:class:`~xmodlm.errors.UserError` line naming the key, not a traceback from deep
in the expansion or a sweep that stops after hours. What the keys mean is in
:mod:`xmodlm.sweep.spec`, which turns a checked spec into runs.

A spec speaks one of two languages, set by its base (:func:`is_paper`): the
paper's (K, A, N0) on a base built by the paper's construction
(``model.active_layers > 0``), where every family keeps the backbone's active
depth; or the earlier (stride, capacity), FLOP-matched to dense references by
depth. A family key of the other language is refused, naming the one to use.
"""

from __future__ import annotations

import math
from typing import Any

from xmodlm.config import (
    BALANCES,
    GATE_SCOPES,
    GATINGS,
    MLPS,
    MOE_ROUTERS,
    OPTIMIZERS,
    SEED_MAX,
    load_config,
)
from xmodlm.errors import UserError

SPEC_KEYS = {
    "name", "base", "compute", "context", "dense", "families", "seeds", "set", "batch_tokens",
    "require", "eval", "lr_rule",
}
# ``eval:`` keys and defaults; batches None: the eval command's own default
EVAL_KEYS = {"tasks": "", "split": "test", "max_items": 200, "batches": None}
ROUTING_KEYS = {"stride", "capacity", "gating", "balance_coef", "causal_router", "causal_coef"}
MOE_KEYS = {"n_experts", "moe_top_k", "moe_aux_coef", "moe_z_coef"}
LAYOUT_KEYS = {"anchors"}  # "stride" (every S-th block, the default) | "first" (block 0 only)
# the paper's language: model fields a family sets directly (model.<key>), crossed
PAPER_KEYS = {
    "sparsity", "anchor_stride", "dense_prefix", "active_layers", "anchors", "gating",
    "gate_scope", "balance", "token_bias_tau", "balance_coef", "causal_router", "causal_coef",
    "mlp", *MOE_KEYS, "moe_router", "moe_shared", "moe_granularity", "moe_bias_rate",
}
LEGACY_ONLY = {"stride", "capacity"}  # the (S, c) description: FLOP-matched by depth
TRAIN_KEYS = {"lr", "warmup_steps", "optimizer"}  # per-family training settings (crossed)
SCALE_KEYS = {"lr_scale"}  # per-family multipliers of a training setting (crossed)
GRID_KEYS = {"seeds", "compute", "dense"}  # per-family narrowing of the spec's grid (not crossed)
LR_RULE_KEYS = ("lr", "width", "power")
DENSE_KEYS = ("width", "n_layers", "n_heads")  # a dense reference entry
RULES = {  # design rules a spec may require of every run: name -> (kind, what it bounds)
    "min_steps": ("min", "optimiser steps after warmup"),
    "max_warmup_frac": ("max", "warmup steps / steps"),
    "max_head_frac": ("max", "LM head share of training FLOPs"),
    "max_epochs": ("max", "passes over the training split"),
}


# value kinds of a spec's family keys, checked before expansion (see check_spec)
_INT_KEYS = {"stride": 1, "n_experts": 1, "moe_top_k": 1, "warmup_steps": 0, "dense_prefix": 0,
             "moe_shared": 0, "moe_granularity": 1}
_NUMBER_KEYS = {"balance_coef", "causal_coef", "moe_aux_coef", "moe_z_coef", "lr", "lr_scale",
                "anchor_stride", "token_bias_tau", "moe_bias_rate"}
_STRING_KEYS = {"gating", "causal_router", "anchors"}
# string keys whose values are a config's choices: checked here, before expansion
_CHOICE_KEYS = {"gating": GATINGS, "gate_scope": GATE_SCOPES, "balance": BALANCES,
                "optimizer": OPTIMIZERS, "moe_router": MOE_ROUTERS, "mlp": MLPS}


def _number(value: Any, where: str) -> float:
    """A finite number; a string YAML 1.1 left unparsed ("1e-3") is read as one."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise UserError(f"sweep spec: {where}={value!r}: must be a number") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserError(f"sweep spec: {where}={value!r}: must be a finite number")
    return value


def _integer(value: Any, where: str, least: int) -> int:
    number = _number(value, where)
    if number != int(number) or number < least:
        raise UserError(f"sweep spec: {where}={value!r}: must be an integer >= {least}")
    return int(number)


def as_list(value: Any) -> list[Any]:
    """A key that takes one value or a list of them, as a list."""
    return value if isinstance(value, list) else [value]


def _some(value: Any, where: str) -> list[Any]:
    """A key that takes one value or a non-empty list of them: an empty list would
    silently cross to no runs at all."""
    if value == []:
        raise UserError(f"sweep spec: {where}=[]: give at least one value (or leave the key out)")
    return as_list(value)


def _seeds(value: Any, where: str) -> list[int]:
    seeds = [_integer(v, where, 0) for v in _some(value, where)]
    if any(s > SEED_MAX for s in seeds):
        raise UserError(f"sweep spec: {where}={value!r}: seeds must be in 0..{SEED_MAX}")
    return seeds


def _budgets(
    value: Any, where: str, contexts: list[int] | None, partial: bool = False
) -> list[float] | dict[int, list[float]]:
    """Compute budgets: a list, or a mapping context -> list covering every context
    (``partial``, for a family: some of them; the family runs at those only)."""
    def checked(items: Any, label: str) -> list[float]:
        budgets = [_number(c, label) for c in as_list(items)]
        if not budgets or any(c <= 0 for c in budgets):
            raise UserError(f"sweep spec: {label}={items!r}: budgets must be > 0 FLOPs")
        return budgets

    if not isinstance(value, dict):
        return checked(value, where)
    if contexts is None:
        raise UserError(f"sweep spec: {where} maps contexts to budgets, so context must be given")
    by_context = {_integer(t, f"{where} key", 1): checked(v, f"{where}.{t}") for t, v in value.items()}
    if set(by_context) - set(contexts) or (not partial and set(by_context) != set(contexts)):
        raise UserError(
            f"sweep spec: {where} gives budgets for contexts {sorted(by_context)};"
            f" context is {sorted(contexts)}: give each context its budgets"
        )
    return by_context


def _eval_options(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise UserError(f"sweep spec: eval={value!r}: must be a mapping ({', '.join(EVAL_KEYS)})")
    if unknown := set(value) - set(EVAL_KEYS):
        raise UserError(
            f"sweep spec: eval: unknown key {sorted(unknown)[0]!r}; allowed: {', '.join(EVAL_KEYS)}"
        )
    out = {**EVAL_KEYS, **value}
    tasks = out["tasks"]
    tasks = [t for t in tasks.split(",") if t] if isinstance(tasks, str) else tasks
    if not isinstance(tasks, list) or any(not isinstance(t, str) or not t for t in tasks):
        raise UserError(f"sweep spec: eval.tasks={value.get('tasks')!r}: a list of task names")
    out["tasks"] = [t for t in tasks if t]
    from xmodlm.eval.tasks import check_tasks  # checked now, not after every run has trained

    try:
        check_tasks(out["tasks"])
    except UserError as err:
        raise UserError(f"sweep spec: eval.tasks: {err}") from None
    if out["split"] not in ("val", "test"):
        raise UserError(f"sweep spec: eval.split={out['split']!r}: allowed: val, test")
    out["max_items"] = _integer(out["max_items"], "eval.max_items", 1)
    if out["batches"] is not None:  # capped by evaluation at what the split holds
        out["batches"] = _integer(out["batches"], "eval.batches", 1)
    return out

def _rules(value: Any) -> dict[str, float]:
    if not isinstance(value, dict):
        raise UserError(f"sweep spec: require={value!r}: must be a mapping of rule: bound")
    unknown = set(value) - set(RULES)
    if unknown:
        raise UserError(
            f"sweep spec: require: unknown rule {sorted(unknown)[0]!r}; allowed: {', '.join(RULES)}"
        )
    return {k: _number(v, f"require.{k}") for k, v in value.items()}


def _lr_rule(value: Any) -> dict[str, float]:
    if not isinstance(value, dict) or set(value) != set(LR_RULE_KEYS):
        raise UserError(
            f"sweep spec: lr_rule={value!r}: must be a mapping of exactly {', '.join(LR_RULE_KEYS)}"
            " (lr * (width / rule width) ** -power)"
        )
    rule = {k: _number(value[k], f"lr_rule.{k}") for k in LR_RULE_KEYS}
    if rule["lr"] <= 0 or rule["width"] <= 0:
        raise UserError(f"sweep spec: lr_rule={value!r}: lr and width must be > 0")
    return rule

def dense_size(ref: dict[str, Any]) -> tuple[int, int]:
    """A dense entry as (width, n_layers): how a family names the sizes it runs at."""
    return int(ref["width"]), int(ref["n_layers"])


def _dense_subset(value: Any, dense: list[dict[str, Any]], where: str) -> list[tuple[int, int]]:
    """A family's narrowing of the dense entries: each must be one of the spec's."""
    known = {dense_size(ref) for ref in dense}
    sizes = []
    for ref in as_list(value):
        if isinstance(ref, tuple):  # already checked (check_spec runs again in expand)
            ref = {"width": ref[0], "n_layers": ref[1]}
        if not isinstance(ref, dict) or not {"width", "n_layers"} <= set(ref):
            raise UserError(f"sweep spec: {where}: each entry needs width and n_layers")
        size = (_integer(ref["width"], f"{where}.width", 1),
                _integer(ref["n_layers"], f"{where}.n_layers", 1))
        if size not in known:
            raise UserError(
                f"sweep spec: {where}: width {size[0]}, n_layers {size[1]} is not one of the"
                f" spec's dense entries ({', '.join(f'{w}x{n}' for w, n in sorted(known))})"
            )
        sizes.append(size)
    return sizes


def is_paper(spec: dict[str, Any]) -> bool:
    """Whether a spec speaks the paper's language: its base, with the spec's ``set``
    applied, is built by the paper's construction (``model.active_layers > 0``)."""
    extra = [str(item) for item in as_list(spec.get("set", []))]
    return load_config(spec.get("base", "micro"), extra).model.active_layers > 0


def family_keys(paper: bool) -> set[str]:
    """The keys a family entry may give (besides ``family``) in each language."""
    model = PAPER_KEYS if paper else ROUTING_KEYS | MOE_KEYS | LAYOUT_KEYS
    return model | TRAIN_KEYS | SCALE_KEYS | GRID_KEYS


def check_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Check the values of a loaded spec before expansion; return it with numbers that
    YAML left as strings ("3e12") read as numbers. Every fault is one UserError line."""
    out = dict(spec)
    for key in ("compute", "families"):
        if not spec.get(key):
            raise UserError(f"sweep spec: {key!r} is required and must not be empty")
    if spec.get("context") is not None:
        out["context"] = [_integer(t, "context", 1) for t in _some(spec["context"], "context")]
    out["compute"] = _budgets(spec["compute"], "compute", out.get("context"))
    if "seeds" in spec:
        out["seeds"] = _seeds(spec["seeds"], "seeds")
    out["require"] = _rules(spec.get("require") or {})
    if spec.get("eval") is not None:
        out["eval"] = _eval_options(spec["eval"])
    for key in ("name", "base"):
        if key in spec and not isinstance(spec[key], str):
            raise UserError(f"sweep spec: {key}={spec[key]!r}: must be a string")
    if any(not isinstance(item, str) for item in as_list(spec.get("set", []))):
        raise UserError("sweep spec: set must be a list of key.path=value strings")
    if spec.get("batch_tokens") is not None:
        out["batch_tokens"] = _integer(spec["batch_tokens"], "batch_tokens", 1)
    paper = is_paper(spec)
    out["dense"] = _dense_entries(spec.get("dense"), paper, spec.get("base", "micro"))
    if spec.get("lr_rule") is not None:
        out["lr_rule"] = _lr_rule(spec["lr_rule"])
    out["families"] = [_family(entry, out, paper) for entry in _some(spec["families"], "families")]
    return out


def _dense_entries(value: Any, paper: bool, base: str) -> list[dict[str, Any]]:
    """The dense references: (width, depth) entries that the (S, c) families are
    FLOP-matched to; none in the paper's language, whose backbone is the base."""
    if paper:
        if value:
            raise UserError(
                f"sweep spec: dense: the base {base!r} is built by the paper's construction"
                " (model.active_layers > 0), so it is the one backbone and every family keeps"
                " its active depth: give no dense entries (vary the backbone with set)"
            )
        return []
    if not value:
        raise UserError("sweep spec: 'dense' is required and must not be empty")
    dense = []
    for ref in _some(value, "dense"):
        if not isinstance(ref, dict) or not {"width", "n_layers"} <= set(ref):
            raise UserError("sweep spec: each dense entry needs width and n_layers")
        if unknown := set(ref) - set(DENSE_KEYS):
            raise UserError(
                f"sweep spec: dense: unknown key {sorted(unknown)[0]!r};"
                f" allowed: {', '.join(DENSE_KEYS)}"
            )
        dense.append({k: _integer(v, f"dense.{k}", 1) if k in ("width", "n_layers", "n_heads")
                      else v for k, v in ref.items()})
    return dense


def _wrong_language(where: str, key: str, paper: bool) -> str:
    if paper:
        return (f"sweep spec: {where}: the base is built by the paper's construction"
                " (model.active_layers > 0): give sparsity (K = 1/capacity) and anchor_stride"
                f" (A = (stride - 1)/K), not {key}")
    return (f"sweep spec: {where}: {key} belongs to the paper's (K, A, N0) construction, and"
            " this spec's base has model.active_layers 0 (families FLOP-matched by stride and"
            " capacity): use a base with active_layers > 0, such as cpu-d64")


def _family(entry: Any, spec: dict[str, Any], paper: bool) -> dict[str, Any]:
    """One family entry, its values checked (numbers read, choices known, keys of the
    spec's language only); list values stay lists (crossed at expansion)."""
    if not isinstance(entry, dict):
        raise UserError(f"sweep spec: families entry {entry!r}: must be a mapping with a family")
    name = entry.get("family")
    other = LEGACY_ONLY if paper else PAPER_KEYS - ROUTING_KEYS - MOE_KEYS - LAYOUT_KEYS
    fam: dict[str, Any] = {}
    for key, value in entry.items():
        where = f"families.{name}.{key}"
        if key in other:
            raise UserError(_wrong_language(where, key, paper))
        if key == "seeds":
            fam[key] = _seeds(value, where)
            continue
        if key == "compute":
            fam[key] = _budgets(value, where, spec.get("context"), partial=True)
            continue
        if key == "dense":
            fam[key] = _dense_subset(value, spec["dense"], where)
            continue
        values = _values(key, value, where, paper)
        fam[key] = values if isinstance(value, list) else values[0]
    return fam


def _values(key: str, shown: Any, where: str, paper: bool) -> list[Any]:
    """The values of one family key (``shown``: one value or a list), checked by the
    kind of value it takes."""
    values = _some(shown, where)
    if key in _INT_KEYS:
        return [_integer(v, where, _INT_KEYS[key]) for v in values]
    if key == "capacity":
        values = [_number(v, where) for v in values]
        if any(not 0 < v <= 1 for v in values):
            raise UserError(f"sweep spec: {where}={shown!r}: must be in (0, 1]")
    elif key in ("sparsity", "active_layers"):
        values = [_number(v, where) for v in values]
        least = 1 if key == "sparsity" else 0
        if any(v < least or (v == 0 and key == "active_layers") for v in values):
            what = "must be >= 1 (K; 1 is dense)" if key == "sparsity" else "must be > 0"
            raise UserError(f"sweep spec: {where}={shown!r}: {what}")
    elif key == "anchors" and paper:
        if any(not isinstance(v, bool) for v in values):
            raise UserError(
                f"sweep spec: {where}={shown!r}: true or false (false: the ablation without"
                " dense anchors)"
            )
    elif key in _NUMBER_KEYS:
        values = [_number(v, where) for v in values]
        if any(v < 0 for v in values):
            raise UserError(f"sweep spec: {where}={shown!r}: must be >= 0")
    elif key in _CHOICE_KEYS:
        allowed = _CHOICE_KEYS[key]
        if any(v not in allowed for v in values):
            raise UserError(f"sweep spec: {where}={shown!r}: allowed: {', '.join(allowed)}")
    elif key in _STRING_KEYS and any(not isinstance(v, str) for v in values):
        raise UserError(f"sweep spec: {where}={shown!r}: must be a string")
    return values
