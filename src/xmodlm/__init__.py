"""xmod-lm: sparse-depth language models with decoupled capacity and anchor stride."""

from __future__ import annotations

from typing import Any

from xmodlm.version import __version__

__all__ = ["__version__", "load_pretrained"]


def __getattr__(name: str) -> Any:
    """``xmodlm.load_pretrained`` without importing torch at ``import xmodlm``."""
    if name == "load_pretrained":
        from xmodlm.export import load_pretrained

        return load_pretrained
    raise AttributeError(f"module 'xmodlm' has no attribute {name!r}")
