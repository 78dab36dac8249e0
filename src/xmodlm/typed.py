"""Typed settings from YAML mappings: a nested dataclass built field by field, each
value coerced to its annotated type or refused in one line naming the key.

Apart from :mod:`xmodlm.config` because it knows nothing of what the settings mean:
YAML's own quirks (``1e-3`` read as a string, ``on`` as true) are undone here, the
ranges and choices of each setting are checked where they are declared.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

from xmodlm.errors import UserError


def build(cls: type, raw: Any, where: str,
          on_off: frozenset[tuple[type, str]] = frozenset()) -> Any:
    """Build dataclass ``cls`` from ``raw``, rejecting unknown keys and wrong types.

    ``on_off``: (dataclass, field) pairs of string settings whose values include
    on/off, which YAML 1.1 reads as true/false; those booleans become the strings.
    """
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
        if (cls, name) in on_off and isinstance(value, bool):  # YAML reads on/off as booleans
            value = "on" if value else "off"
        kwargs[name] = _coerce(hints[name], value, f"{where}.{name}" if where else name, on_off)
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, where: str, on_off: frozenset[tuple[type, str]]) -> Any:
    if tp in (int, float) and isinstance(value, str):
        try:  # YAML 1.1 reads "1e-3" as a string
            value = float(value)
        except ValueError:
            pass
    if dataclasses.is_dataclass(tp):
        return build(tp, value, where, on_off)
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
