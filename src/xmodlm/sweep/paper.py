"""The paper's families in a sweep: each variant built on the one backbone.

A spec whose base is built by the paper's construction (``model.active_layers >
0``; :func:`xmodlm.sweep.grammar.is_paper`) compares its families as the paper
does (DESIGN 4, matching ``active``): the same backbone and active depth, so the
same N_act, and the same compute C. A sparse model spends fewer FLOPs a token
and so trains on more tokens; nothing is FLOP-matched by changing depth.

A family's defaults are the paper's recipe as its presets state it, read from
those presets so the recipe has one home: ``mod`` is what ``paper-556m-mod``
sets (K = 8, A = 1/8, N0 = 1, the FFN-only sigmoid gate of its Eq. 6, no
balancing), ``moe`` what ``paper-556m-moe8x64`` sets (fine-grained experts of a
granularity-8 width, 6 of 64 routed plus 2 shared). ``xmod`` is the base's own
routing at the (K, A) it is given, ``dense`` the base at K = 1. A family entry's
keys override its recipe.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from xmodlm.config import ModelConfig, own_settings
from xmodlm.errors import UserError

RECIPE_PRESETS = {"mod": "paper-556m-mod", "moe": "paper-556m-moe8x64"}
FAMILIES = ("dense", "xmod", "mod", "moe")


def recipe(family: str) -> dict[str, Any]:
    """The model settings a family starts from (before its entry's own keys)."""
    if family == "dense":
        return {"sparsity": 1.0}
    if family in RECIPE_PRESETS:
        return dict(own_settings(RECIPE_PRESETS[family]).get("model") or {})
    return {}


def describe(model: ModelConfig) -> str:
    """(K, A, N0) and the active depth, as a refusal names the model it cannot build."""
    return (f"K={model.sparsity:g}, A={model.anchor_stride:g}, N0={model.dense_prefix},"
            f" active_layers={model.active_layers:g}"
            + ("" if model.anchors else ", no anchors"))


def paper_model(backbone: ModelConfig, variant: dict[str, Any]) -> ModelConfig:
    """The backbone with one variant's model settings (its recipe already merged in),
    checked: a (K, A, N0) the construction cannot build at the active depth, or any
    other bad value, is one line naming the family and the combination."""
    family = variant["family"]
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    # a float field holds a float whatever YAML read (8 or 8.0): the run id hashes it
    changes = {k: float(v) if isinstance(getattr(backbone, k), float) else v
               for k, v in variant.items() if k in fields}
    if family == "xmod" and float(changes.get("sparsity", backbone.sparsity)) <= 1:
        raise UserError("sweep spec: family xmod needs sparsity (K > 1; K = 1 is the dense family)")
    model = dataclasses.replace(backbone, **changes)
    try:
        model.validate()
    except UserError as err:
        raise UserError(f"sweep spec: family {family} ({describe(model)}): {err}") from None
    return model
