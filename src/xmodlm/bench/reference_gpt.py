"""A plain reference GPT: the benchmark's yardstick, written the straightforward way.

``xmod bench`` times this model beside the library's dense model of the same
shape, in the same run, so that "how fast is our dense model" has an answer
that does not depend on the machine: ``dense_vs_reference`` is our tokens per
second over this model's.

It is the model a reader would write from a textbook in one sitting, in the
manner of nanoGPT: pre-norm blocks, RMSNorm, rotary positions, a SwiGLU MLP,
causal SDPA attention and an untied LM head; separate q, k, v (and gate, up,
down) Linear layers, rotary tables sliced per forward and applied per block,
norms and loss through autograd, plain (non-fused, for-loop) AdamW, bf16
autocast. Same widths, depth, heads, MLP width and vocabulary as the
``ModelConfig`` it is built from, so its parameter count and analytic FLOPs
equal the dense model's. Nothing in the library depends on it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from xmodlm.config import ModelConfig


class RefRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight).type_as(x)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on (B, H, T, K) with (T, K/2) tables: rotate-half convention."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RefAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        H = self.n_heads
        q = self.q(x).view(B, T, H, D // H).transpose(1, 2)
        k = self.k(x).view(B, T, H, D // H).transpose(1, 2)
        v = self.v(x).view(B, T, H, D // H).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class RefMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, f = cfg.d_model, cfg.ffn_dim
        self.gate = nn.Linear(d, f, bias=False)
        self.up = nn.Linear(d, f, bias=False)
        self.down = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class RefBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm1 = RefRMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = RefAttention(cfg)
        self.norm2 = RefRMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = RefMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class ReferenceGPT(nn.Module):
    """Dense decoder of ``cfg``'s shape (its routing and MoE fields are ignored)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(RefBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RefRMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        K = cfg.attn_head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, K, 2, dtype=torch.float32) / K))
        angles = torch.outer(torch.arange(cfg.context, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = out_std if name.endswith(("proj.weight", "down.weight")) else cfg.init_std
                nn.init.normal_(p, 0.0, std)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        T = idx.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss


def reference_optimizer(
    model: nn.Module, lr: float = 3e-3, weight_decay: float = 0.1
) -> torch.optim.Optimizer:
    """Plain AdamW (the default implementation, not fused); matrices decay, vectors do not."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=False)
