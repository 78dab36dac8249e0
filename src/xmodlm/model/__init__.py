"""The X-MoD model family: one transformer built from a layout string."""

from xmodlm.flops import active_depth
from xmodlm.model.transformer import ModelOutput, Transformer, stride_windows

__all__ = ["ModelOutput", "Transformer", "active_depth", "stride_windows"]
