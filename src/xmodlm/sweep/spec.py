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

``compute`` may instead map each context to its budgets
(``compute: {128: [2e13, 6e13], 512: [3e13, 9e13]}``): a longer context costs more
FLOPs per token, so the same step count needs a larger C. A family entry may
narrow the grid for itself with its own ``seeds`` and ``compute`` (same forms; a
mapping may name only some contexts, and the family runs at those only): the
headline families at three seeds, the exploratory ones at one.

``eval`` (optional, ``{tasks: [cloze, minimal_pairs], split: test, max_items: 200}``)
evaluates each run's final checkpoint right after it trains (``xmod eval``, causal
and top-k routing, the offline downstream tasks) into ``RUN/eval.json``, whose
figures join the results table: checkpoints stay on the machine that trained them.

``lr_rule`` (optional, ``{lr: 4.0e-3, width: 128, power: 1.0}``) sets each run's
learning rate from its width, ``lr * (width / rule width) ** -power``, the same for
every family at that width, so that an isoFLOP profile does not handicap the sizes
far from the width a single rate was tuned at. A family's own ``lr`` replaces the
rule; its ``lr_scale`` (a list, crossed) multiplies the rate it gets, which is how
a rule is checked (``lr_scale: [0.5, 1, 2]``). A family's ``dense`` (a list of the
spec's dense entries) narrows the sizes it runs at, like its ``seeds``.

``require`` (optional) states the design rules every run must meet, checked
before anything runs (``xmod sweep`` refuses a spec that breaks one, naming the
run): ``min_steps`` (optimiser steps after warmup), ``max_warmup_frac``,
``max_head_frac`` (the LM head's share of training FLOPs) and ``max_epochs``
(passes over the training split; needs the prepared data to count).

Every non-dense run is FLOP-matched to its dense reference (same width, depth
chosen so training FLOPs per token are closest; DESIGN 4) and every run gets the
same compute C, so D = C / F_token. A run's id is a hash of its fully resolved
configuration, so it is stable across invocations and machines.

About 620 lines, kept whole: a spec's grammar (its keys and their checks), its
expansion into runs with stable ids, and the cost of those runs (the estimate the
dry run and a sweep's ETA share) are one contract a spec file is read against.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from xmodlm import flops, record
from xmodlm.config import Config, load_config, resolve_budget
from xmodlm.errors import UserError

FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "dense": {},
    "mod": record.MOD_RECIPE,
    "xmod": record.XMOD_DEFAULTS,
    "moe": record.MOE_DEFAULTS,
}
SPEC_KEYS = {
    "name", "base", "compute", "context", "dense", "families", "seeds", "set", "batch_tokens",
    "require", "eval", "lr_rule",
}
EVAL_KEYS = {"tasks": "", "split": "test", "max_items": 200}  # ``eval:`` keys and defaults
ROUTING_KEYS = {"stride", "capacity", "gating", "balance_coef", "causal_router", "causal_coef"}
MOE_KEYS = {"n_experts", "moe_top_k", "moe_aux_coef", "moe_z_coef"}
LAYOUT_KEYS = {"anchors"}  # "stride" (every S-th block, the default) | "first" (block 0 only)
TRAIN_KEYS = {"lr", "warmup_steps"}  # per-family training settings (e.g. tuned learning rates)
SCALE_KEYS = {"lr_scale"}  # per-family multipliers of a training setting (crossed)
GRID_KEYS = {"seeds", "compute", "dense"}  # per-family narrowing of the spec's grid (not crossed)
LR_RULE_KEYS = ("lr", "width", "power")
RULES = {  # design rules a spec may require of every run: name -> (kind, what it bounds)
    "min_steps": ("min", "optimiser steps after warmup"),
    "max_warmup_frac": ("max", "warmup steps / steps"),
    "max_head_frac": ("max", "LM head share of training FLOPs"),
    "max_epochs": ("max", "passes over the training split"),
}


# The record's configuration columns the sweep's plan shows.
PLAN_COLUMNS = ("family", "width", "n_layers", "stride", "capacity", "context", "gating",
                "balance_coef", "params_total", "params_active", "flops_per_token")


@dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: its id, resolved config and compute budget."""

    run_id: str
    cfg: Config
    compute: float

    def row(self) -> dict[str, Any]:
        """The run as the sweep's plan shows it: its record columns (gating ``-`` where
        no block routes), the tokens its budget buys, its steps and head share."""
        m = self.cfg.model
        c = flops.count(m)
        row = record.config_row(m, c)
        if not record.is_sparse(m.stride, m.capacity, row["layout"]):
            row["gating"] = "-"
        return {
            "id": self.run_id,
            **{k: row[k] for k in PLAN_COLUMNS},
            "seed": self.cfg.train.seed,
            "tokens": self.compute / c.flops_train,
            "compute": self.compute,
            "steps": self.steps,
            "warmup_steps": self.cfg.train.warmup_steps,
            "head_frac": flops.head_fraction(m),
        }

    @property
    def steps(self) -> int:
        """Optimiser steps this run will take on one rank (the trainer's budget rule)."""
        return resolve_budget(self.cfg, world_size=1).total_steps


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
    return check_spec(spec)


# value kinds of a spec's family keys, checked before expansion (see check_spec)
_INT_KEYS = {"stride": 1, "n_experts": 1, "moe_top_k": 1, "warmup_steps": 0}
_NUMBER_KEYS = {"balance_coef", "causal_coef", "moe_aux_coef", "moe_z_coef", "lr", "lr_scale"}
_STRING_KEYS = {"gating", "causal_router", "anchors"}


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


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _seeds(value: Any, where: str) -> list[int]:
    return [_integer(v, where, 0) for v in _as_list(value)]


def _budgets(
    value: Any, where: str, contexts: list[int] | None, partial: bool = False
) -> list[float] | dict[int, list[float]]:
    """Compute budgets: a list, or a mapping context -> list covering every context
    (``partial``, for a family: some of them; the family runs at those only)."""
    def checked(items: Any, label: str) -> list[float]:
        budgets = [_number(c, label) for c in _as_list(items)]
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
    tasks = tasks.split(",") if isinstance(tasks, str) else tasks
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
    return out


def eval_args(spec: dict[str, Any]) -> tuple[str, ...]:
    """The ``xmod eval`` options a spec's ``eval`` asks for; empty without one."""
    options = spec.get("eval")
    if not options:
        return ()
    return ("--split", options["split"], "--tasks", ",".join(options["tasks"]),
            "--max-items", str(options["max_items"]))


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


def rule_lr(rule: dict[str, float], width: int) -> float:
    """The learning rate ``lr_rule`` gives a model of this width."""
    return rule["lr"] * (width / rule["width"]) ** -rule["power"]


def _size(ref: dict[str, Any]) -> tuple[int, int]:
    return int(ref["width"]), int(ref["n_layers"])


def _dense_subset(value: Any, dense: list[dict[str, Any]], where: str) -> list[tuple[int, int]]:
    """A family's narrowing of the dense entries: each must be one of the spec's."""
    known = {_size(ref) for ref in dense}
    sizes = []
    for ref in _as_list(value):
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


def check_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Check the values of a loaded spec before expansion; return it with numbers that
    YAML left as strings ("3e12") read as numbers. Every fault is one UserError line."""
    out = dict(spec)
    if spec.get("context") is not None:
        out["context"] = [_integer(t, "context", 1) for t in _as_list(spec["context"])]
    out["compute"] = _budgets(spec["compute"], "compute", out.get("context"))
    if "seeds" in spec:
        out["seeds"] = _seeds(spec["seeds"], "seeds")
    out["require"] = _rules(spec.get("require") or {})
    if spec.get("eval") is not None:
        out["eval"] = _eval_options(spec["eval"])
    for key in ("name", "base"):
        if key in spec and not isinstance(spec[key], str):
            raise UserError(f"sweep spec: {key}={spec[key]!r}: must be a string")
    if any(not isinstance(item, str) for item in _as_list(spec.get("set", []))):
        raise UserError("sweep spec: set must be a list of key.path=value strings")
    dense = []
    for ref in _as_list(spec["dense"]):
        if not isinstance(ref, dict) or not {"width", "n_layers"} <= set(ref):
            raise UserError("sweep spec: each dense entry needs width and n_layers")
        dense.append({k: _integer(v, f"dense.{k}", 1) if k in ("width", "n_layers", "n_heads")
                      else v for k, v in ref.items()})
    out["dense"] = dense
    if spec.get("lr_rule") is not None:
        out["lr_rule"] = _lr_rule(spec["lr_rule"])
    families = []
    for entry in _as_list(spec["families"]):
        if not isinstance(entry, dict):
            raise UserError(f"sweep spec: families entry {entry!r}: must be a mapping with a family")
        name = entry.get("family")
        fam = {}
        for key, value in entry.items():
            where = f"families.{name}.{key}"
            if key == "seeds":
                fam[key] = _seeds(value, where)
                continue
            if key == "compute":
                fam[key] = _budgets(value, where, out.get("context"), partial=True)
                continue
            if key == "dense":
                fam[key] = _dense_subset(value, dense, where)
                continue
            values = _as_list(value)
            if key in _INT_KEYS:
                values = [_integer(v, where, _INT_KEYS[key]) for v in values]
            elif key == "capacity":
                values = [_number(v, where) for v in values]
                if any(not 0 < v <= 1 for v in values):
                    raise UserError(f"sweep spec: {where}={value!r}: must be in (0, 1]")
            elif key in _NUMBER_KEYS:
                values = [_number(v, where) for v in values]
                if any(v < 0 for v in values):
                    raise UserError(f"sweep spec: {where}={value!r}: must be >= 0")
            elif key in _STRING_KEYS and any(not isinstance(v, str) for v in values):
                raise UserError(f"sweep spec: {where}={value!r}: must be a string")
            fam[key] = values if isinstance(value, list) else values[0]
        families.append(fam)
    out["families"] = families
    return out


def _variants(family_entry: dict[str, Any]) -> list[dict[str, Any]]:
    """Cross the list-valued keys of one family entry."""
    entry = dict(family_entry)
    family = entry.pop("family", None)
    if family not in FAMILY_DEFAULTS:
        raise UserError(
            f"sweep spec: family {family!r} unknown; allowed: {', '.join(FAMILY_DEFAULTS)}"
        )
    for key in GRID_KEYS:
        entry.pop(key, None)
    allowed = ROUTING_KEYS | MOE_KEYS | LAYOUT_KEYS | TRAIN_KEYS | SCALE_KEYS
    unknown = set(entry) - allowed
    if unknown:
        raise UserError(
            f"sweep spec: family {family}: unknown key {sorted(unknown)[0]!r};"
            f" allowed: {', '.join(sorted(allowed | GRID_KEYS))}"
        )
    merged = {**FAMILY_DEFAULTS[family], **entry}
    keys = sorted(merged)
    combos = itertools.product(*(_as_list(merged[k]) for k in keys))
    return [{"family": family, **dict(zip(keys, combo, strict=True))} for combo in combos]


# Config fields added after sweeps were committed, with the value that means what
# runs before them did in training: hashed only when set otherwise, so that a new
# field never renames (and so reruns) the runs of a committed sweep.
# model.causal_threshold changes only how a trained model routes at inference; the
# MoE fields at these values are the switch MoE every committed MoE run trained.
ID_NEUTRAL = {
    ("model", "causal_threshold"): "calibrated",
    ("model", "moe_router"): "switch",
    ("model", "moe_granularity"): 1,
    ("model", "moe_shared"): 0,
    ("model", "moe_bias_rate"): 1e-3,
}


def run_id(cfg: Config) -> str:
    """Stable id: hash of the resolved config (compute included, in train.compute),
    leaving out the :data:`ID_NEUTRAL` fields at their neutral values."""
    raw = cfg.to_dict()
    for (section, key), neutral in ID_NEUTRAL.items():
        if raw[section].get(key) == neutral:
            del raw[section][key]
    return hashlib.sha1(yaml.safe_dump(raw, sort_keys=False).encode()).hexdigest()[:12]


def expand(spec: dict[str, Any], data_dir: str | None = None) -> list[RunSpec]:
    """All runs of a spec, compute-matched, in a deterministic order: by compute tier
    (the i-th budget of each context), then context, dense reference, family, seed."""
    spec = check_spec(spec)
    base = spec.get("base", "micro")
    extra = [str(s) for s in _as_list(spec.get("set", []))]
    if data_dir is not None:
        extra.append(f"data.dir={data_dir}")
    default_seeds = spec.get("seeds", [0])
    all_seeds = sorted({*default_seeds, *(s for f in spec["families"] for s in f.get("seeds", []))})
    n_tiers = max(
        len(_for_context(f.get("compute", spec["compute"]), t))
        for f in spec["families"] for t in _as_list(spec.get("context", [None]))
    )
    runs: list[RunSpec] = []
    seen: set[str] = set()
    for tier, context, dense_ref, family_entry, seed in itertools.product(
        range(n_tiers),
        _as_list(spec.get("context", [None])),
        _as_list(spec["dense"]),
        _as_list(spec["families"]),
        all_seeds,
    ):
        budgets = _for_context(family_entry.get("compute", spec["compute"]), context)
        if tier >= len(budgets) or seed not in family_entry.get("seeds", default_seeds):
            continue
        if "dense" in family_entry and _size(dense_ref) not in family_entry["dense"]:
            continue
        compute = budgets[tier]
        overrides = [
            f"model.d_model={dense_ref['width']}",
            f"model.n_layers={dense_ref['n_layers']}",
            f"train.seed={seed}",
            f"train.compute={compute}",
            *extra,
        ]
        if "n_heads" in dense_ref:
            overrides.append(f"model.n_heads={dense_ref['n_heads']}")
        if spec.get("lr_rule"):
            overrides.append(f"train.lr={rule_lr(spec['lr_rule'], int(dense_ref['width'])):.6g}")
        if context is not None:
            overrides.append(f"model.context={context}")
        if spec.get("batch_tokens"):  # the same tokens per step at every context
            T = int(context) if context is not None else load_config(base).model.context
            overrides.append(f"train.batch_size={max(1, int(spec['batch_tokens']) // T)}")
        dense_cfg = load_config(base, overrides)
        for variant in _variants(family_entry):
            cfg = _resolve_variant(dense_cfg, variant)
            rid = run_id(cfg)
            if rid not in seen:
                seen.add(rid)
                runs.append(RunSpec(rid, cfg, compute))
    return runs


def _for_context(
    budgets: list[float] | dict[int, list[float]], context: int | None
) -> list[float]:
    """The budgets (tiers) at ``context``, from a plain list or a per-context mapping."""
    return budgets.get(int(context), []) if isinstance(budgets, dict) else budgets


def check_requirements(
    runs: list[RunSpec],
    rules: dict[str, float],
    train_tokens: int | None = None,
    strict: bool = True,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Each run's figures for the spec's design rules, and one line per broken rule
    (the first run that breaks it, and how many do). ``strict``: raise the first line
    as a UserError instead. ``train_tokens`` (the training split's size) is needed
    only by ``max_epochs``; without it that figure is None and the rule unchecked."""
    figures: list[dict[str, Any]] = []
    broken: dict[str, list[str]] = {}
    for run in runs:
        steps, warmup = run.steps, run.cfg.train.warmup_steps
        row = {
            "min_steps": steps - warmup,
            "max_warmup_frac": warmup / steps,
            "max_head_frac": flops.head_fraction(run.cfg.model),
            "max_epochs": None if train_tokens is None else run.row()["tokens"] / train_tokens,
        }
        for rule, bound in rules.items():
            value = row[rule]
            kind, what = RULES[rule]
            if value is not None and (value < bound if kind == "min" else value > bound):
                m = run.cfg.model
                broken.setdefault(rule, []).append(
                    f"sweep spec: run {run.run_id} ({m.family}, T={m.context}, C={run.compute:.3g})"
                    f" breaks require.{rule}={bound:g}: {what} is {value:.4g}"
                )
        figures.append(row)
    lines = [
        runs_[0] + (f" (and {len(runs_) - 1} more runs)" if len(runs_) > 1 else "")
        for runs_ in broken.values()
    ]
    if strict and lines:
        raise UserError(lines[0])
    return figures, lines


def _resolve_variant(dense_cfg: Config, variant: dict[str, Any]) -> Config:
    family = variant["family"]
    changes = {k: v for k, v in variant.items() if k not in {"family"} | TRAIN_KEYS | SCALE_KEYS}
    train = dataclasses.replace(
        dense_cfg.train, **{k: v for k, v in variant.items() if k in TRAIN_KEYS}
    )
    if variant.get("lr_scale", 1) != 1:
        train = dataclasses.replace(train, lr=float(f"{train.lr * variant['lr_scale']:.6g}"))
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
# What a run costs besides its training FLOPs, where no finished run measures it:
# the process start and imports, opening the data, the initial evaluation, the
# final checkpoint and summary. A 10-step width-32 run took 7.8 s on a loaded
# 2-core machine, 2.1 s of it in the training loop; a sweep run with an
# evaluation stage (a second process) costs about twice that.
DEFAULT_FIXED_S = 8.0


class MeasuredCost(NamedTuple):
    """What finished runs measured: training FLOP/s a run reached, how many runs,
    and the seconds each spent outside its training loop (None: not measurable)."""

    rate: float
    runs: int
    fixed_s: float | None


def _outside_loop_s(run: Path, loop_s: float) -> float | None:
    """Seconds a finished run spent outside its training loop: from the job's start
    (``sweep_config.yaml``, written as the run is launched) to its last record
    (``eval.json`` where the sweep evaluated it, else ``summary.json``), less the
    loop's own ``wall_s``. None where the files' times cannot be that (copied or
    checked-out results, or a run resumed across sweeps)."""
    try:
        start = (run / "sweep_config.yaml").stat().st_mtime
        end = max((run / name).stat().st_mtime for name in ("summary.json", "eval.json")
                  if (run / name).is_file())
    except (OSError, ValueError):
        return None
    extra = end - start - loop_s
    return extra if 0 < extra < 600 else None


def measured_rate(sweep_dir: str | Path) -> MeasuredCost | None:
    """Training FLOP/s per run measured by the finished runs of a sweep folder (median
    of flops / wall_s over its ``runs/*/summary.json`` with status ok), how many
    runs it comes from, and their median time outside the loop (:func:`_outside_loop_s`);
    None where there are none. The runs' own concurrency is in the figure: it
    predicts a sweep run with as many workers on the same machine."""
    import json
    import statistics

    rates, fixed = [], []
    for path in sorted(Path(sweep_dir).glob("runs/*/summary.json")):
        try:
            s = json.loads(path.read_text())
            if s.get("status") == "ok" and s.get("wall_s", 0) > 0:
                rates.append(float(s["flops"]) / float(s["wall_s"]))
                extra = _outside_loop_s(path.parent, float(s["wall_s"]))
                if extra is not None:
                    fixed.append(extra)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if not rates:
        return None
    return MeasuredCost(statistics.median(rates), len(rates),
                        statistics.median(fixed) if fixed else None)


def estimate_seconds(
    runs: list[RunSpec], workers: int = 1, rate: float | None = None,
    fixed_s: float | None = None,
) -> list[float]:
    """Wall time per run: a fixed cost (``fixed_s``, measured by
    :func:`measured_rate`, else :data:`DEFAULT_FIXED_S`) plus its FLOPs over a rate.
    With ``rate`` (training FLOP/s a run reached in an earlier sweep at this many
    workers, :func:`measured_rate`): compute / rate. Without it, rough: compute /
    (measured matmul peak x ASSUMED_MFU), slowed by sharing the machine's cores
    between ``workers`` concurrent runs. The peak is measured in the dtype training
    would use here (``train.dtype=auto``): timing bf16 on a CPU that only emulates
    it would take seconds and mislead. The fixed cost matters: a small sweep's runs
    spend more time starting and evaluating than training."""
    fixed = DEFAULT_FIXED_S if fixed_s is None else fixed_s
    if rate is None:
        import torch

        from xmodlm.hardware import matmul_peak_gflops, resolve_dtype

        dtype = resolve_dtype("auto", torch.device("cpu"))
        rate = matmul_peak_gflops(dtype, "cpu") * 1e9 * ASSUMED_MFU / max(1, workers)
    return [fixed + r.compute / rate for r in runs]
