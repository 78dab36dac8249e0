"""Shared transformer layers: RMSNorm, rotary positions, attention, SwiGLU.

These layers know nothing about routing. A routed block calls them on gathered
tokens and passes the tokens' *original* positions to the rotary embedding, so
the same code serves dense and sparse blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain, computed in fp32 for stability."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight).type_as(x)


class Rotary(nn.Module):
    """Rotary position tables, indexed by arbitrary (original) positions."""

    def __init__(self, head_dim: int, max_len: int, theta: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles_TH = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_TH", angles_TH.cos(), persistent=False)
        self.register_buffer("sin_TH", angles_TH.sin(), persistent=False)

    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (cos, sin) for positions ``pos`` (shape T or B x T), last dim head_dim/2."""
        return self.cos_TH[pos], self.sin_TH[pos]


def apply_rotary(x_BTHK: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the head dim by the position angles.

    ``cos``/``sin`` have shape (T, K/2) or (B, T, K/2); a head axis is inserted.
    """
    cos = cos.unsqueeze(-2).to(x_BTHK.dtype)
    sin = sin.unsqueeze(-2).to(x_BTHK.dtype)
    x1, x2 = x_BTHK.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    """Multi-head causal self-attention over whatever tokens it is given.

    Causality is by order in the given sequence. Gathered tokens are sorted by
    original position, so causal order over them is causal order over the
    original positions restricted to the selected tokens.
    """

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def project_qkv(
        self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys, values as (B, H, T, K), rotary already applied."""
        B, T, _ = x_BTD.shape
        q, k, v = self.qkv(x_BTD).view(B, T, 3, self.n_heads, self.head_dim).unbind(2)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def output(self, y_BHTK: torch.Tensor) -> torch.Tensor:
        B, H, T, K = y_BHTK.shape
        return self.proj(y_BHTK.transpose(1, 2).reshape(B, T, H * K))

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask_BTT: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention; ``mask_BTT`` (True = may attend) replaces plain causality."""
        q, k, v = self.project_qkv(x_BTD, cos, sin)
        if mask_BTT is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_BTT.unsqueeze(1))
        return self.output(y)


class SwiGLU(nn.Module):
    """Gated MLP: down(silu(gate(x)) * up(x)); gate and up fused into one matmul."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.d_ff = d_ff
        self.gate_up = nn.Linear(d_model, 2 * d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)
