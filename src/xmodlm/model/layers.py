"""Shared transformer layers: RMSNorm, rotary positions, attention, SwiGLU.

These layers know nothing about routing. A routed block calls them on gathered
tokens and passes the tokens' *original* positions to the rotary embedding, so
the same code serves dense and sparse blocks.

Speed notes (measured in ``docs/benchmarks.md``). On a CPU, eager PyTorch pays
for every elementwise pass over a tensor, and on a shared machine every
parallelised op also pays an OpenMP barrier. The norm and the rotary embedding
are therefore written as custom autograd functions whose forward and backward
make as few passes as the arithmetic needs; they compute exactly what the plain
formulas compute (the rotary one bit for bit, the norm to fp32 round-off).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _RMSNormFn(torch.autograd.Function):
    """y = x / rms(x) * w in fp32, with a hand-written backward (fewer passes).

    ``out_dtype`` lets the norm write its output straight in the dtype of the
    matmul that consumes it (what autocast would cast it to anyway).
    """

    @staticmethod
    def forward(ctx, x, weight, eps, out_dtype):  # noqa: ANN001, ANN205
        x32 = x.float()
        inv = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        w32 = weight.float()
        y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        torch.mul(x32 * inv, w32, out=y)
        ctx.save_for_backward(x, weight, inv)
        return y

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        x, weight, inv = ctx.saved_tensors
        D = x.shape[-1]
        g32 = g.float()
        xhat = x.float() * inv
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (g32 * xhat).reshape(-1, D).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            gw = g32 * weight.float()
            dot = (gw * xhat).sum(-1, keepdim=True) / D
            grad_x = torch.addcmul(gw, xhat, dot, value=-1.0).mul_(inv).to(x.dtype)
        return grad_x, grad_w, None, None


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain, computed in fp32 for stability.

    The output has the input's dtype, or ``out_dtype`` when given (callers pass
    the autocast dtype when the output only feeds a matmul).
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return _RMSNormFn.apply(x, self.weight, self.eps, out_dtype or x.dtype)


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on ``x`` runs in: the autocast dtype if autocast is on."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class Rotary(nn.Module):
    """Rotary position tables, indexed by arbitrary (original) positions.

    The tables are full head width, in the layout :func:`apply_rotary` uses:
    ``cos`` is (cos, cos) and ``sin`` is (-sin, sin) over the two halves of the
    head dim, so a rotation is ``x * cos + roll(x, K/2) * sin``.
    """

    def __init__(self, head_dim: int, max_len: int, theta: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles_TH = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
        cos_TH, sin_TH = angles_TH.cos(), angles_TH.sin()
        self.register_buffer("cos_TK", torch.cat((cos_TH, cos_TH), -1), persistent=False)
        self.register_buffer("sin_TK", torch.cat((-sin_TH, sin_TH), -1), persistent=False)

    def forward(
        self, pos: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) tables for positions ``pos`` (shape T or B x T), last dim head_dim.

        ``dtype``: cast once here rather than in every block.
        """
        cos, sin = self.cos_TK[pos], self.sin_TK[pos]
        if dtype is not None:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin


def apply_rotary(x_BTHK: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the head dim by the position angles.

    ``cos``/``sin`` come from :class:`Rotary`, shape (T, K) or (B, T, K); a head
    axis is inserted. Bit for bit ``cat(x1 cos - x2 sin, x2 cos + x1 sin)``.
    """
    cos = cos.unsqueeze(-2).to(x_BTHK.dtype)
    sin = sin.unsqueeze(-2).to(x_BTHK.dtype)
    return x_BTHK * cos + x_BTHK.roll(x_BTHK.shape[-1] // 2, -1) * sin


class _RotaryQKVFn(torch.autograd.Function):
    """Split a fused (B, T, 3, H, K) projection into rotated q, k and plain v.

    One node instead of unbind + two rotations: q and k rotate together and are
    written straight into contiguous (B, H, T, K) tensors, the layout the CPU
    flash-attention kernel runs fastest on (about 3% of a dense block here);
    the backward assembles the three gradients with one ``stack`` (no
    zero-filled slices added together). Bit for bit :func:`apply_rotary`.
    """

    @staticmethod
    def forward(ctx, qkv, cos, sin):  # noqa: ANN001, ANN205
        B, T, _, H, K = qkv.shape
        # (T, K) -> (1, 1, T, K); (B, T, K) -> (1, B, 1, T, K): broadcast over (2, B, H, T, K)
        cos = cos.unsqueeze(-3).unsqueeze(0).to(qkv.dtype)
        sin = sin.unsqueeze(-3).unsqueeze(0).to(qkv.dtype)
        qk = qkv[:, :, :2].permute(2, 0, 3, 1, 4)
        rot = torch.empty((2, B, H, T, K), dtype=qkv.dtype, device=qkv.device)
        torch.add(qk * cos, qk.roll(K // 2, -1) * sin, out=rot)
        ctx.save_for_backward(cos, sin)
        return rot[0], rot[1], qkv[:, :, 2].transpose(1, 2).contiguous()

    @staticmethod
    def backward(ctx, g_q, g_k, g_v):  # noqa: ANN001, ANN205
        cos, sin = ctx.saved_tensors
        ref = next(g for g in (g_q, g_k, g_v) if g is not None)
        g_q = torch.zeros_like(ref) if g_q is None else g_q
        g_k = torch.zeros_like(ref) if g_k is None else g_k
        g_v = torch.zeros_like(ref) if g_v is None else g_v
        g_qk = torch.stack((g_q, g_k))
        # inverse rotation: x = y cos - roll(y, K/2) sin (sin holds the signs)
        g_qk = g_qk * cos - g_qk.roll(ref.shape[-1] // 2, -1) * sin
        grads = (g_qk[0].transpose(1, 2), g_qk[1].transpose(1, 2), g_v.transpose(1, 2))
        return torch.stack(grads, 2), None, None


class Attention(nn.Module):
    """Causal self-attention over whatever tokens it is given, with grouped queries.

    ``n_heads`` query heads share ``n_kv_heads`` key/value heads in equal groups
    (0: as many as query heads, plain multi-head), each ``head_dim`` wide (0:
    d_model // n_heads), so the KV cache holds n_kv_heads / n_heads of what
    multi-head attention would. ``qk_norm``: an RMSNorm over each query and key
    head before rotary (a gain of head_dim shared by the heads, as in Qwen3),
    which keeps attention logits bounded as training goes on.

    The projection is one fused matmul whose rows are the queries, then the keys,
    then the values: with n_kv_heads = n_heads and the default head dim it is the
    (3 d, d) weight of plain multi-head attention, same shape, same init draws.

    Causality is by order in the given sequence. Gathered tokens are sorted by
    original position, so causal order over them is causal order over the
    original positions restricted to the selected tokens.
    """

    def __init__(
        self, d_model: int, n_heads: int, n_kv_heads: int = 0, head_dim: int = 0,
        qk_norm: bool = False, eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        self.head_dim = head_dim or d_model // n_heads
        q_dim, kv_dim = n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.qkv = nn.Linear(d_model, q_dim + 2 * kv_dim, bias=False)
        self.proj = nn.Linear(q_dim, d_model, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None

    def project_qkv(
        self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (B, H, T, K), keys and values (B, G, T, K), rotary already applied.

        Plain multi-head attention takes the fused one-node path
        (:class:`_RotaryQKVFn`); grouped heads or QK-norm split the projection and
        rotate queries and keys apart, bit for bit the same rotation."""
        B, T, _ = x_BTD.shape
        qkv_BTF = self.qkv(x_BTD)
        if self.n_kv_heads == self.n_heads and self.q_norm is None:
            return _RotaryQKVFn.apply(qkv_BTF.view(B, T, 3, self.n_heads, self.head_dim), cos, sin)
        return self.split_heads(qkv_BTF, cos, sin)

    def split_heads(
        self, qkv_BTF: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The general path of :meth:`project_qkv`, from the fused projection's output."""
        B, T, _ = qkv_BTF.shape
        H, G, K = self.n_heads, self.n_kv_heads, self.head_dim
        q_BTHK, k_BTGK, v_BTGK = qkv_BTF.split((H * K, G * K, G * K), -1)
        q_BTHK, k_BTGK = q_BTHK.view(B, T, H, K), k_BTGK.view(B, T, G, K)
        if self.q_norm is not None:
            q_BTHK, k_BTGK = self.q_norm(q_BTHK), self.k_norm(k_BTGK)
        q = apply_rotary(q_BTHK, cos, sin).transpose(1, 2).contiguous()
        k = apply_rotary(k_BTGK, cos, sin).transpose(1, 2).contiguous()
        return q, k, v_BTGK.view(B, T, G, K).transpose(1, 2).contiguous()

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
        mask = mask_BTT.unsqueeze(1) if mask_BTT is not None else None
        return self.output(attention(q, k, v, mask, causal=True))


# On a CPU, PyTorch's flash-attention kernel in bf16 has a large fixed cost per
# call and per head: at 128 keys or fewer the fp32 kernel, casts included, is
# 1.8-10x faster (docs/benchmarks.md, "Attention in fp32 on short sequences");
# from 256 keys on, bf16 wins at head size 64 and ties at 32.
CPU_FP32_ATTENTION_MAX_KEYS = 128


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    mask: torch.Tensor | None = None, causal: bool = False,
) -> torch.Tensor:
    """Scaled dot-product attention of (B, H, T, K) queries over (B, G, T, K) keys and
    values (G divides H: grouped queries): the one call every block (dense, routed,
    cached) makes. ``mask`` (True = may attend, broadcast to
    (B, H, Tq, Tk)) replaces ``causal``.

    bf16 attention over at most :data:`CPU_FP32_ATTENTION_MAX_KEYS` keys on a CPU
    runs in fp32 and casts back: faster there, and never less precise. Routed
    blocks attend over c*T tokens, so at small c this is every routed block."""
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and k.shape[-2] <= CPU_FP32_ATTENTION_MAX_KEYS:
        with torch.autocast("cpu", enabled=False):  # CPU autocast would cast SDPA back to bf16
            y = attention(q.float(), k.float(), v.float(), mask, causal)
        return y.to(q.dtype)
    # grouped queries (fewer key/value heads): SDPA's flash kernels share each key/value
    # head over its group themselves, with no repeated copy of the keys and values; on
    # a CPU as fast as repeating them first (fwd+bwd, bf16, 8 over 2 heads, T 256)
    gqa = q.shape[1] != k.shape[1]
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


class _SiluMulFn(torch.autograd.Function):
    """silu(gate) * up, for ``gate, up = gate_up.chunk(2, -1)``.

    The backward writes both halves of the gradient straight into one
    (..., 2F) buffer, where autograd would compute them separately and
    ``cat`` them (the chunk's backward): two fewer passes over the MLP's
    widest activation. Bit for bit the autograd result.
    """

    @staticmethod
    def forward(ctx, gate_up):  # noqa: ANN001, ANN205
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate)
        ctx.save_for_backward(gate_up, act)
        return act * up

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        gate_up, act = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        if torch.compiler.is_compiling():  # traced: the compiler fuses this anyway
            return torch.cat((torch.ops.aten.silu_backward(g * up, gate), g * act), dim=-1)
        d_ff = gate.shape[-1]
        grad = torch.empty(gate_up.shape, dtype=g.dtype, device=g.device)
        torch.ops.aten.silu_backward.grad_input(g * up, gate, grad_input=grad[..., :d_ff])
        torch.mul(g, act, out=grad[..., d_ff:])
        return grad


class SwiGLU(nn.Module):
    """Gated MLP: down(silu(gate(x)) * up(x)); gate and up fused into one matmul."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.d_ff = d_ff
        self.gate_up = nn.Linear(d_model, 2 * d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(_SiluMulFn.apply(self.gate_up(x)))


class _CrossEntropyFn(torch.autograd.Function):
    """Mean cross-entropy of (N, V) logits computed in fp32, gradient in the logits' dtype.

    The loss is ``F.cross_entropy(logits.float(), targets)`` to fp32 round-off.
    The forward keeps the softmax p (one exponential pass, as ``log_softmax``
    takes) and reads the loss off it: ln sum_j exp(x_j) = max(x) - ln max(p), so
    loss_i = max(x_i) - ln max(p_i) - x_{i,t}, exact however far below the maximum
    the target's logit lies (no ln of an underflowed p). The backward is then
    ``(p - onehot) / N`` written straight in the logits' dtype: one pass over
    p, where going through ``log_softmax`` recomputes p = exp(log p), a second
    exponential over the largest tensor of a step; the two row maxima that
    replace it are plain reads. Targets must be valid class ids (no ignore
    index).
    """

    @staticmethod
    def forward(ctx, logits_NV, targets_N):  # noqa: ANN001, ANN205
        x_NV = logits_NV.float()
        p_NV = torch.softmax(x_NV, dim=-1)
        t_N1 = targets_N.unsqueeze(1)
        lse_N = x_NV.amax(-1) - p_NV.amax(-1).log()
        ctx.save_for_backward(p_NV, targets_N)
        ctx.logits_dtype = logits_NV.dtype
        return (lse_N - x_NV.gather(1, t_N1).squeeze(1)).mean()

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        p_NV, targets_N = ctx.saved_tensors
        scale = g / p_NV.shape[0]
        t_N1 = targets_N.unsqueeze(1)
        grad = torch.empty(p_NV.shape, dtype=ctx.logits_dtype, device=p_NV.device)
        torch.mul(p_NV, scale, out=grad)
        # the target entries, (p - 1) * scale formed in fp32 before the cast (p untouched:
        # the graph may be walked again with retain_graph)
        grad.scatter_(1, t_N1, ((p_NV.gather(1, t_N1) - 1.0) * scale).to(grad.dtype))
        return grad, None


def cross_entropy_fp32(logits_NV: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(logits.float(), targets)`` (mean), with a leaner backward.

    Without a gradient to compute (evaluation) it is exactly that call.
    """
    if not (torch.is_grad_enabled() and logits_NV.requires_grad):
        return F.cross_entropy(logits_NV.float(), targets_N)
    return _CrossEntropyFn.apply(logits_NV, targets_N)
