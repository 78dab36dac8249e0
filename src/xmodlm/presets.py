"""Where a configuration's settings come from: the shipped presets by name, YAML files,
and the chain of ``base:`` files each may start from, merged into one mapping.

Below :mod:`xmodlm.config`, which types and checks what these read: here the
settings are plain mappings, so a preset, a user's file and a run's saved config
are read by one rule.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from xmodlm.errors import UserError
from xmodlm.typed import load_yaml


def preset_names() -> list[str]:
    """The shipped presets, by the name ``load_config`` takes."""
    root = resources.files("xmodlm") / "configs"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))



def with_bases(name_or_path: str | Path, chain: list[str]) -> dict[str, Any]:
    """The settings of ``name_or_path`` merged over those of its base, and so on up
    the chain (a base dropped silently would train a different model than the file
    says); a chain that comes back to itself is refused."""
    key = str(name_or_path)
    if key in chain:
        loop = " -> ".join([*chain[chain.index(key):], key])
        raise UserError(f"config base chain loops: {loop}; a base may not lead back to itself")
    raw = read_yaml(name_or_path)
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str) or not base.strip():
        raise UserError(f"config {key!r}: base {base!r} must be a preset name or a YAML path")
    return deep_merge(with_bases(base, [*chain, key]), raw)


def read_yaml(name_or_path: str | Path) -> dict[str, Any]:
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
    raw = load_yaml(text, f"config {str(name_or_path)!r}")
    if raw is None:
        raise UserError(
            f"config {str(name_or_path)!r} is empty (no settings): give at least `base: PRESET`"
        )
    if not isinstance(raw, dict):
        raise UserError(f"config {str(name_or_path)!r}: top level must be a mapping")
    return raw


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out
