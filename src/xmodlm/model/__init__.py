"""The X-MoD model family: one transformer built from a layout string."""

from xmodlm.model.transformer import ModelOutput, Transformer, active_depth, stride_windows

__all__ = ["ModelOutput", "Transformer", "active_depth", "stride_windows"]
