"""The X-MoD model family: one transformer built from a layout string.

The package loads lazily, so that importing one module of it does not pull in
the whole transformer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from xmodlm.flops import active_depth
    from xmodlm.model.transformer import ModelOutput, Transformer

__all__ = ["ModelOutput", "Transformer", "active_depth"]


def __getattr__(name: str) -> Any:
    if name == "active_depth":
        from xmodlm.flops import active_depth

        return active_depth
    if name in __all__:
        from xmodlm.model import transformer

        return getattr(transformer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
