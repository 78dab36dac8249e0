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

``eval`` (optional, ``{tasks: [cloze, minimal_pairs], split: test, max_items: 200,
batches: 64}``) evaluates each run's final checkpoint right after it trains (``xmod
eval``, causal and top-k routing, the offline downstream tasks) into ``RUN/eval.json``,
whose figures join the results table: checkpoints stay on the machine that trained
them. ``batches`` (default: the eval command's) bounds the windows, in batches of the
run's batch size, capped at what the split holds without overlap: a bound above the
split's size evaluates every run on the whole split, whatever its context.

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

**The paper's language.** A spec whose base is built by the paper's construction
(``model.active_layers > 0``, as ``cpu-d64`` is) has no ``dense`` entries: the
base is the one backbone, and every family keeps its active depth (the same
N_act) and gets the same C, so a sparse model trains on more tokens
(:mod:`xmodlm.sweep.paper`)::

    name: paper-demo
    base: cpu-d64
    compute: {1024: [4.0e13]}
    context: [1024]
    families:
      - {family: dense, optimizer: [adamw, muon], lr: [1.6e-3, 3.2e-3]}
      - {family: xmod, sparsity: [4, 8], anchor_stride: [0.5, 1, 2]}
      - {family: xmod, sparsity: 8, anchor_stride: 1, balance: none}  # ablations:
      - {family: xmod, sparsity: 8, anchor_stride: 1, anchors: false}  # balance, anchors,
      - {family: xmod, sparsity: 8, anchor_stride: 1, dense_prefix: 0}  # gating, gate_scope
      - {family: mod, active_layers: 7.75}
      - {family: moe}

A family takes the model keys ``sparsity`` (K), ``anchor_stride`` (A),
``dense_prefix`` (N0), ``anchors``, ``gating``, ``gate_scope``, ``balance``,
``token_bias_tau``, the MoE's (``n_experts``, ``moe_top_k``, ``moe_shared``,
``moe_granularity``, ``moe_router``, ...) and ``active_layers`` (only where the
construction cannot build a family at the backbone's depth: then its N_act
differs, and the plan shows by how much). A (K, A, N0) it cannot build is
refused, naming the combination. ``batch_tokens`` sets ``train.batch_tokens``.
Any family may set ``optimizer`` (adamw | muon) and ``lr``, crossed, so a
learning-rate sweep of both optimisers is one spec.

The values each key may take are checked in :mod:`xmodlm.sweep.grammar` before
anything expands; what the runs will cost in wall time is estimated in
:mod:`xmodlm.sweep.estimate`.
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
from xmodlm.budget import resolve_budget
from xmodlm.config import Config, load_config
from xmodlm.errors import UserError
from xmodlm.sweep import paper as paper_families
from xmodlm.sweep.grammar import (
    GRID_KEYS,
    RULES,
    SCALE_KEYS,
    SPEC_KEYS,
    TRAIN_KEYS,
    as_list,
    check_spec,
    dense_size,
    family_keys,
    is_paper,
)
from xmodlm.typed import load_yaml

FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "dense": {},
    "mod": record.MOD_RECIPE,
    "xmod": record.XMOD_DEFAULTS,
    "moe": record.MOE_DEFAULTS,
}

# The record's configuration columns the sweep's plan shows, in each language.
PLAN_COLUMNS = ("family", "width", "n_layers", "stride", "capacity", "context", "gating",
                "balance_coef", "params_total", "params_active", "flops_per_token")
PAPER_PLAN_COLUMNS = ("family", "sparsity", "anchor_stride", "dense_prefix", "n_layers",
                      "context", "gating", "balance", "params_total", "params_non_embedding",
                      "params_active", "flops_per_token")


@dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: its id, resolved config and compute budget."""

    run_id: str
    cfg: Config
    compute: float

    def row(self) -> dict[str, Any]:
        """The run as the sweep's plan shows it: its record columns (gating ``-`` where
        no block routes), the tokens its budget buys, its steps and head share."""
        m, t = self.cfg.model, self.cfg.train
        c = flops.count(m)
        row = record.config_row(m, c)
        if not record.is_sparse(m.depth.stride, m.depth.capacity, row["layout"]):
            row["gating"] = "-"
        paper = m.active_layers > 0
        tokens = self.compute / c.flops_train
        steps = self.steps
        return {
            "id": self.run_id,
            **{k: row[k] for k in (PAPER_PLAN_COLUMNS if paper else PLAN_COLUMNS)},
            **({"optimizer": t.optimizer, "lr": t.lr} if paper else {}),
            "seed": t.seed,
            "tokens": tokens,
            **({"tokens_per_param": tokens / c.params_non_embedding} if paper else {}),
            "compute": self.compute,
            "steps": steps,
            "warmup_steps": t.warmup(steps),
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
    spec = load_yaml(p.read_text(), f"sweep spec {str(p)!r}")
    if not isinstance(spec, dict):
        raise UserError(f"sweep spec {str(p)!r}: top level must be a mapping")
    unknown = set(spec) - SPEC_KEYS
    if unknown:
        raise UserError(
            f"sweep spec: unknown key {sorted(unknown)[0]!r}; allowed: {', '.join(sorted(SPEC_KEYS))}"
        )
    return check_spec(spec)

def eval_args(spec: dict[str, Any]) -> tuple[str, ...]:
    """The ``xmod eval`` options a spec's ``eval`` asks for; empty without one."""
    options = spec.get("eval")
    if not options:
        return ()
    batches = options.get("batches")
    return ("--split", options["split"], "--tasks", ",".join(options["tasks"]),
            "--max-items", str(options["max_items"]),
            *(("--batches", str(batches)) if batches is not None else ()))

def rule_lr(rule: dict[str, float], width: int) -> float:
    """The learning rate ``lr_rule`` gives a model of this width."""
    return rule["lr"] * (width / rule["width"]) ** -rule["power"]

def _variants(family_entry: dict[str, Any], paper: bool = False) -> list[dict[str, Any]]:
    """Cross the list-valued keys of one family entry, over its family's defaults
    (``paper``: the paper's recipes, :func:`xmodlm.sweep.paper.recipe`)."""
    entry = dict(family_entry)
    family = entry.pop("family", None)
    if family not in FAMILY_DEFAULTS:
        raise UserError(
            f"sweep spec: family {family!r} unknown; allowed: {', '.join(FAMILY_DEFAULTS)}"
        )
    for key in GRID_KEYS:
        entry.pop(key, None)
    allowed = family_keys(paper)
    unknown = set(entry) - allowed
    if unknown:
        raise UserError(
            f"sweep spec: family {family}: unknown key {sorted(unknown)[0]!r};"
            f" allowed: {', '.join(sorted(allowed))}"
        )
    defaults = paper_families.recipe(family) if paper else FAMILY_DEFAULTS[family]
    merged = {**defaults, **entry}
    keys = sorted(merged)
    combos = itertools.product(*(as_list(merged[k]) for k in keys))
    return [{"family": family, **dict(zip(keys, combo, strict=True))} for combo in combos]


# Config fields added after sweeps were committed, with the value that means what
# runs before them did in training: hashed only when set otherwise, so that a new
# field never renames (and so reruns) the runs of a committed sweep.
# model.causal_threshold changes only how a trained model routes at inference; the
# MoE fields at these values are the switch MoE every committed MoE run trained.
ID_NEUTRAL = {
    ("model", "causal_threshold"): "calibrated",
    # the paper's (K, A, N0) construction: unused while active_layers is 0
    ("model", "sparsity"): 1.0, ("model", "anchor_stride"): 1.0, ("model", "dense_prefix"): 4,
    ("model", "active_layers"): 0.0, ("model", "anchors"): True, ("model", "gate_scope"): "block",
    # attention shape: plain multi-head at d_model // n_heads, no QK-norm
    ("model", "n_kv_heads"): 0, ("model", "head_dim"): 0, ("model", "qk_norm"): False,
    # the optimiser and schedule of the paper's recipe: off at these values
    ("train", "batch_tokens"): 0,
    ("train", "warmup_frac"): 0.0,
    ("train", "optimizer"): "adamw",
    ("train", "adamw_lr"): 0.0,
    ("train", "muon_momentum"): 0.95,
    ("train", "muon_nesterov"): True,
    ("train", "muon_ns_steps"): 5,
    ("train", "muon_rms_match"): 0.2,
    ("model", "moe_router"): "switch", ("model", "moe_granularity"): 1,
    ("model", "moe_shared"): 0, ("model", "moe_bias_rate"): 1e-3,
}


def _balance_neutral(model: dict[str, Any], sparse: bool) -> list[str]:
    """The balancing keys that say nothing runs before them did not: all of them in a
    model with no sparse block; ``balance`` where it trains what ``balance_coef``
    alone meant then (the cv loss at that weight; none at 0); the token-bias settings
    wherever the token bias is not in use."""
    bias = ["token_bias_tau", "token_bias_step"]
    if not sparse:
        return ["balance", *bias]
    balance, coef = model.get("balance"), model.get("balance_coef", 0.0)
    if balance == "token_bias":
        return []
    return bias + (["balance"] if balance == "cv" or coef == 0 else [])


def run_id(cfg: Config) -> str:
    """Stable id: hash of the resolved config (compute included, in train.compute),
    leaving out the :data:`ID_NEUTRAL` fields at their neutral values."""
    raw = cfg.to_dict()
    for (section, key), neutral in ID_NEUTRAL.items():
        if raw[section].get(key) == neutral:
            del raw[section][key]
    for key in _balance_neutral(raw["model"], "s" in cfg.model.block_layout):
        raw["model"].pop(key, None)
    return hashlib.sha1(yaml.safe_dump(raw, sort_keys=False).encode()).hexdigest()[:12]


def expand(spec: dict[str, Any], data_dir: str | None = None) -> list[RunSpec]:
    """All runs of a spec, compute-matched, in a deterministic order: by compute tier
    (the i-th budget of each context), then context, dense reference, family, seed.
    In the paper's language there is one backbone (the base) and no dense reference."""
    spec = check_spec(spec)
    paper = is_paper(spec)
    base = spec.get("base", "micro")
    extra = [str(s) for s in as_list(spec.get("set", []))]
    if data_dir is not None:
        extra.append(f"data.dir={data_dir}")
    default_seeds = spec.get("seeds", [0])
    all_seeds = sorted({*default_seeds, *(s for f in spec["families"] for s in f.get("seeds", []))})
    n_tiers = max(
        len(_for_context(f.get("compute", spec["compute"]), t))
        for f in spec["families"] for t in as_list(spec.get("context", [None]))
    )
    runs: list[RunSpec] = []
    seen: set[str] = set()
    for tier, context, dense_ref, family_entry, seed in itertools.product(
        range(n_tiers),
        as_list(spec.get("context", [None])),
        spec["dense"] or [None],
        as_list(spec["families"]),
        all_seeds,
    ):
        budgets = _for_context(family_entry.get("compute", spec["compute"]), context)
        if tier >= len(budgets) or seed not in family_entry.get("seeds", default_seeds):
            continue
        if "dense" in family_entry and dense_size(dense_ref) not in family_entry["dense"]:
            continue
        compute = budgets[tier]
        overrides = _overrides(spec, dense_ref, context, [
            f"train.seed={seed}", f"train.compute={compute}", *extra])
        # the corpus's vocabulary unless the spec names one, as `xmod train` takes it
        dense_cfg = load_config(base, overrides, vocab_from_data=True)
        for variant in _variants(family_entry, paper):
            cfg = _resolve_variant(dense_cfg, variant, paper)
            rid = run_id(cfg)
            if rid not in seen:
                seen.add(rid)
                runs.append(RunSpec(rid, cfg, compute))
    if not runs:  # e.g. families whose per-context budgets name none of the contexts
        raise UserError("sweep spec expands to no runs: check its families' compute and seeds")
    return runs


def _overrides(
    spec: dict[str, Any], dense_ref: dict[str, Any] | None, context: int | None,
    common: list[str],
) -> list[str]:
    """The ``--set`` overrides that make the base one run's reference: its dense
    size (none in the paper's language: the base is the backbone), context, batch
    and learning rate; ``common`` (seed, budget, the spec's set) after the size."""
    base = spec.get("base", "micro")
    if dense_ref is None:
        overrides = list(common)
    else:
        overrides = [f"model.d_model={dense_ref['width']}",
                     f"model.n_layers={dense_ref['n_layers']}", *common]
        if "n_heads" in dense_ref:
            overrides.append(f"model.n_heads={dense_ref['n_heads']}")
    if spec.get("lr_rule"):
        width = (int(dense_ref["width"]) if dense_ref is not None
                 else load_config(base, common).model.d_model)
        overrides.append(f"train.lr={rule_lr(spec['lr_rule'], width):.6g}")
    if context is not None:
        overrides.append(f"model.context={context}")
    if spec.get("batch_tokens") and dense_ref is None:  # the trainer's own rule
        overrides.append(f"train.batch_tokens={int(spec['batch_tokens'])}")
    elif spec.get("batch_tokens"):  # the same tokens per step at every context
        T = int(context) if context is not None else load_config(base).model.context
        overrides.append(f"train.batch_size={max(1, int(spec['batch_tokens']) // T)}")
    return overrides


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
        steps = run.steps
        warmup = run.cfg.train.warmup(steps)
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


def _resolve_variant(dense_cfg: Config, variant: dict[str, Any], paper: bool = False) -> Config:
    family = variant["family"]
    changes = {k: v for k, v in variant.items() if k not in {"family"} | TRAIN_KEYS | SCALE_KEYS}
    train = dataclasses.replace(
        dense_cfg.train, **{k: v for k, v in variant.items() if k in TRAIN_KEYS}
    )
    if variant.get("lr_scale", 1) != 1:
        train = dataclasses.replace(train, lr=float(f"{train.lr * variant['lr_scale']:.6g}"))
    if paper:
        new_model = paper_families.paper_model(dense_cfg.model, variant)
        return dataclasses.replace(dense_cfg, model=new_model, train=train, name=family).validate()
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
