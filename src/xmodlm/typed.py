"""Typed settings from YAML mappings: a nested dataclass built field by field, each
value coerced to its annotated type or refused in one line naming the key.

Apart from :mod:`xmodlm.config` because it knows nothing of what the settings mean:
YAML's own quirks (``1e-3`` read as a string, ``on`` as true) are undone here, the
ranges and choices of each setting are checked where they are declared.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from typing import Any

import yaml

from xmodlm.errors import UserError


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader that refuses a key given twice in one mapping (plain YAML
    keeps the last silently, so the first setting a user wrote would do nothing)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: the base class says so
                break
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str, what: str) -> Any:
    """Parse user-written YAML; any fault (bad syntax, a duplicate key) is one line
    naming ``what`` (the file) and the line."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a safe loader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(err, "problem", None)
        why = f": {problem}" if problem and "duplicate" in problem else ""
        raise UserError(f"{what} is not valid YAML{at}{why}") from None


def load_json(text: str, what: str) -> Any:
    """Parse a JSON file a user may have edited (an export's config): bad syntax or a
    key given twice in one object (which ``json`` would resolve to the last) is one
    line naming ``what``."""
    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        if twice := sorted({k for k in keys if keys.count(k) > 1}):
            raise UserError(f"{what}: key {twice[0]!r} given twice; give each key once")
        return dict(pairs)

    try:
        return json.loads(text, object_pairs_hook=unique)
    except ValueError as err:
        raise UserError(f"{what} is not valid JSON: {err}") from None


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
