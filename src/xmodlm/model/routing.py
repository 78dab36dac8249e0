"""The routing mathematics of sparse depth, as pure functions.

Everything that decides *which* tokens a sparse block processes and *how much*
its output counts lives here, separately testable and free of module state:

* the router logits (:func:`router_logits`), the causal decision
  (:func:`causal_decision`), the threshold that makes it route a given fraction
  (:func:`threshold_for_fraction`) and the attention mask among routed tokens
  (:func:`routed_attention_mask`), used alike by training, the masked
  reference path and decoding;
* expert-choice top-k per sequence (:func:`topk_indices`), gather and scatter,
  and :func:`route` (router logits, top-k and gather as one autograd node);
* the gates ``logit | sigmoid | variance_scaled`` (:func:`gate`) and the solver
  of the variance-scaled gate's initial scale (:func:`solve_gamma`,
  :func:`interpolate_depth`; the stack runs it in ``Transformer.init_gates_``);
* the auxiliary losses: depth-wise token balancing (:func:`balance_loss`) and the
  causal-decision BCE (:func:`causal_bce_loss`);
* the routing statistics logged during evaluation (:func:`routing_stats`).

Router logits are always fp32 (tensors named ``r_BT``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F


def causal_decision(d_BT: torch.Tensor, threshold: torch.Tensor | float) -> torch.Tensor:
    """The causal routing decision: a token is processed iff its decision logit
    exceeds the block's threshold (0 under the ``half`` rule; see
    :mod:`xmodlm.model.depth_router`). One rule for training statistics, the masked
    reference path and decoding."""
    return d_BT > threshold


def threshold_for_fraction(d_N: torch.Tensor, fraction: float) -> float:
    """The threshold above which the fraction ``fraction`` of the logits ``d_N`` lie.

    k = round(fraction * N) values lie strictly above it: the midpoint of the k-th
    and (k+1)-th largest, so that logits that tie at the boundary stay on one side.
    k = 0 gives the largest logit (none lies above it), k = N the fp32 number just
    below the smallest.
    """
    d_N = d_N.detach().float().flatten()
    n = d_N.numel()
    assert n > 0, "no decision logits to calibrate on"
    k = min(n, max(0, round(fraction * n)))
    top = torch.topk(d_N, min(n, k + 1)).values
    if k == 0:
        return float(top[0])
    if k == n:
        return float(torch.nextafter(top[-1], top.new_tensor(float("-inf"))))
    return 0.5 * (float(top[k - 1]) + float(top[k]))


def router_logits(x_BTD: torch.Tensor, w_1D: torch.Tensor) -> torch.Tensor:
    """r = x . w in fp32 whatever the autocast dtype; a fresh (B, T) tensor, not a view."""
    with fp32_region(x_BTD):
        return torch.matmul(x_BTD.float(), w_1D.float().reshape(-1))


def fp32_region(x: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    """Autocast off for ``x``'s device, where it is on (entering the context costs
    microseconds, paid per sparse block at every decoding step: skipped when off)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.autocast(device_type=x.device.type, enabled=False)
    return contextlib.nullcontext()


def routed_attention_mask(valid_BK: torch.Tensor) -> torch.Tensor:
    """(B, K, K) boolean mask for attention among routed tokens held in causal order.

    Query j sees key i <= j when key i is valid (selected, not padding); an invalid
    query sees only itself (its output is discarded), so every softmax row stays
    non-empty. Serves the masked reference path (K = T, valid = selected) and
    ragged prefill (K = the most tokens any sequence routes, valid = not padding).
    """
    K = valid_BK.shape[1]
    causal_KK = torch.ones(K, K, dtype=torch.bool, device=valid_BK.device).tril()
    eye_KK = torch.eye(K, dtype=torch.bool, device=valid_BK.device)
    return (causal_KK & valid_BK.unsqueeze(1)) | eye_KK


def topk_indices(
    r_BT: torch.Tensor, k: int, valid_BT: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-sequence expert-choice selection, sorted so tokens keep causal order.

    Exactly ``k`` indices per row. Invalid (padding) positions are masked to -inf
    first, so they are chosen only if a row has fewer than ``k`` valid tokens.
    """
    if valid_BT is not None:
        r_BT = r_BT.masked_fill(~valid_BT, float("-inf"))
    idx_BK = torch.topk(r_BT, k, dim=-1, sorted=False).indices
    return torch.sort(idx_BK, dim=-1).values


def gather_tokens(x_BTD: torch.Tensor, idx_BK: torch.Tensor) -> torch.Tensor:
    """x_BKD[b, j] = x_BTD[b, idx_BK[b, j]]."""
    return torch.gather(x_BTD, 1, idx_BK.unsqueeze(-1).expand(-1, -1, x_BTD.shape[-1]))


def scatter_add_tokens(
    x_BTD: torch.Tensor, idx_BK: torch.Tensor, update_BKD: torch.Tensor
) -> torch.Tensor:
    """Out of place: x + update at the selected positions, x unchanged elsewhere."""
    index = idx_BK.unsqueeze(-1).expand(-1, -1, x_BTD.shape[-1])
    return x_BTD.scatter_add(1, index, update_BKD.to(x_BTD.dtype))


class _RouteFn(torch.autograd.Function):
    """Router logits, top-k and gather in one autograd node.

    The input gets gradient from two places, the router (an outer product with
    the router weight) and the gather (a scatter of the gathered tokens'
    gradient). Separately, autograd would materialise a zero-filled (B, T, D)
    tensor for the scatter and add the two full-size gradients; here the
    scatter goes straight into the router's gradient, one full-size write.
    """

    @staticmethod
    def forward(ctx, x_BTD, w_1D, k, valid_BT, shift_BT):  # noqa: ANN001, ANN205
        r_BT = router_logits(x_BTD, w_1D)
        if shift_BT is not None:  # the token-choice bias: a constant, so dr/dx, dr/dw unchanged
            r_BT = r_BT - shift_BT
        idx_BK = topk_indices(r_BT, k, valid_BT)
        ctx.save_for_backward(x_BTD, w_1D, idx_BK)
        ctx.mark_non_differentiable(idx_BK)
        return r_BT, idx_BK, gather_tokens(x_BTD, idx_BK)

    @staticmethod
    def backward(ctx, g_r, g_idx, g_x):  # noqa: ANN001, ANN205
        x_BTD, w_1D, idx_BK = ctx.saved_tensors
        B, T, D = x_BTD.shape
        w32 = w_1D.float()
        if g_r is None:
            g_r = torch.zeros(B, T, dtype=torch.float32, device=x_BTD.device)
        grad_x = grad_w = None
        with torch.autocast(device_type=x_BTD.device.type, enabled=False):  # router in fp32
            if ctx.needs_input_grad[0]:
                grad_x = torch.mm(g_r.reshape(B * T, 1).float(), w32).view(B, T, D)
                if g_x is not None:
                    index = idx_BK.unsqueeze(-1).expand(-1, -1, D)
                    grad_x.scatter_add_(1, index, g_x.to(grad_x.dtype))
                grad_x = grad_x.to(x_BTD.dtype)
            if ctx.needs_input_grad[1]:
                grad_w = torch.mm(g_r.reshape(1, B * T).float(), x_BTD.reshape(B * T, D).float())
                grad_w = grad_w.to(w_1D.dtype)
        return grad_x, grad_w, None, None, None


def route(
    x_BTD: torch.Tensor,
    w_1D: torch.Tensor,
    k: int,
    valid_BT: torch.Tensor | None = None,
    shift_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sparse block's routing step: (r_BT, idx_BK, x_BKD).

    r = x . w - shift in fp32 (the router logits, less the token-choice bias
    ``shift_BT`` = tau b where given: :class:`TokenBias`), idx the sorted top-k
    positions of each row (:func:`topk_indices`), x_BKD the gathered tokens
    (:func:`gather_tokens`); differentiable in x and w through r and x_BKD.
    """
    return _RouteFn.apply(x_BTD, w_1D, k, valid_BT, shift_BT)


class TokenBias:
    """The paper's token-choice bias over one forward pass (its Eq. 8).

    Each token carries a count b of the sparse blocks of the current stage that
    processed it; a sparse block ranks and gates tokens by r = s - tau b instead of
    its raw logit s, so a token already refined in this stage must score higher to
    be taken again, and consecutive sparse blocks spread over more tokens. b grows by
    ``step`` at each selection and returns to 0 at every non-sparse block (the
    anchor that closes a stage). b depends only on the token's own earlier
    decisions, so it is causal: decoding keeps the same count per new token. Lives
    for one pass (no module state); tau = 0 turns it off at no cost.
    """

    def __init__(self, tau: float, step: float = 1.0) -> None:
        self.tau, self.step = tau, step
        self.b: torch.Tensor | None = None

    def shift(self) -> torch.Tensor | None:
        """tau b, to subtract from router logits (None while b is 0 or tau is 0)."""
        return None if self.b is None else self.tau * self.b

    def selected(self, sel: torch.Tensor) -> None:
        """A sparse block processed the tokens ``sel`` marks."""
        if self.tau:
            add = sel.float() * self.step
            self.b = add if self.b is None else self.b + add

    def reset(self) -> None:
        """A non-sparse block: the stage is over."""
        self.b = None


def _gate_and_slope(
    r: torch.Tensor, kind: str, gamma: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The gate g(r) (:func:`gate`), its slope dg/dr and, variance-scaled only, dg/dgamma."""
    g = gate(r, kind, gamma)
    if kind == "logit":
        return g, torch.ones_like(r), None
    s = g if kind == "sigmoid" else torch.sigmoid(r)
    slope = s * (1.0 - s)
    if kind == "sigmoid":
        return g, slope, None
    return g, gamma * slope, s


class _GatedScatterFn(torch.autograd.Function):
    """x + g(r[idx]) * f at the selected positions, in one autograd node.

    The tail of every sparse block in training: gather the router logits of the
    selected tokens, gate them, scale the branch output and scatter-add it into
    the residual stream. Written as separate ops that is about a dozen autograd
    nodes per block (gather, sigmoid, two products, unsqueeze, expand, scatter
    and their backwards); at the small widths sparse models are trained at on a
    CPU each costs a fixed dispatch (and, threaded, a barrier), so it is one node
    here. Forward bit for bit the separate ops; the backward reduces in another
    order (round-off only).
    """

    @staticmethod
    def forward(ctx, x_BTD, f_BKD, r_BT, idx_BK, gamma, kind):  # noqa: ANN001, ANN205
        r_BK = torch.gather(r_BT, 1, idx_BK)
        g_BK, slope_BK, dgamma_BK = _gate_and_slope(r_BK, kind, gamma)
        index = idx_BK.unsqueeze(-1).expand(-1, -1, x_BTD.shape[-1])
        out = x_BTD.scatter_add(1, index, (g_BK.unsqueeze(-1) * f_BKD).to(x_BTD.dtype))
        ctx.save_for_backward(f_BKD, idx_BK, g_BK, slope_BK, dgamma_BK)
        ctx.r_shape, ctx.gamma_dtype = r_BT.shape, None if gamma is None else gamma.dtype
        return out

    @staticmethod
    def backward(ctx, g_out):  # noqa: ANN001, ANN205
        f_BKD, idx_BK, g_BK, slope_BK, dgamma_BK = ctx.saved_tensors
        index = idx_BK.unsqueeze(-1).expand(-1, -1, g_out.shape[-1])
        g_sel_BKD = torch.gather(g_out, 1, index)
        grad_f = grad_r = grad_gamma = None
        if ctx.needs_input_grad[1]:
            grad_f = (g_sel_BKD * g_BK.unsqueeze(-1)).to(f_BKD.dtype)
        if ctx.needs_input_grad[2] or ctx.needs_input_grad[4]:
            dg_BK = (g_sel_BKD * f_BKD).sum(-1, dtype=g_BK.dtype)  # dL/dg per token
            if ctx.needs_input_grad[2]:
                grad_r = torch.zeros(ctx.r_shape, dtype=dg_BK.dtype, device=dg_BK.device)
                grad_r.scatter_(1, idx_BK, dg_BK * slope_BK)
            if ctx.needs_input_grad[4]:
                grad_gamma = (dg_BK * dgamma_BK).sum().reshape(1).to(ctx.gamma_dtype)
        return g_out, grad_f, grad_r, None, grad_gamma, None


def gated_scatter(
    x_BTD: torch.Tensor,
    f_BKD: torch.Tensor,
    r_BT: torch.Tensor,
    idx_BK: torch.Tensor,
    kind: str,
    gamma: torch.Tensor | None = None,
) -> torch.Tensor:
    """A sparse block's output in training: ``x + gate(r[idx]) * f`` at ``idx``.

    Out of place; ``x`` unchanged at unselected positions. Equals
    ``scatter_add_tokens(x, idx, gate(gather(r, idx), kind, gamma)[..., None] * f)``
    (:func:`gate`), as one autograd node (:class:`_GatedScatterFn`).
    """
    return _GatedScatterFn.apply(x_BTD, f_BKD, r_BT, idx_BK, gamma, kind)


def selection_mask(idx_BK: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Boolean (B, T) mask of the selected positions."""
    mask = torch.zeros(idx_BK.shape[0], seq_len, dtype=torch.bool, device=idx_BK.device)
    return mask.scatter(1, idx_BK, True)


def gate(r: torch.Tensor, kind: str, gamma: torch.Tensor | None = None) -> torch.Tensor:
    """Multiplier of a sparse block's branch output; puts the router on the gradient path.

    ``logit``: r (original MoD). ``sigmoid``: sigmoid(r).
    ``variance_scaled``: gamma * sigmoid(r), gamma a learnable per-layer scalar.
    """
    if kind == "logit":
        return r
    if kind == "sigmoid":
        return torch.sigmoid(r)
    if kind == "variance_scaled":
        assert gamma is not None, "variance_scaled gating needs its gamma"
        return gamma * torch.sigmoid(r)
    raise AssertionError(f"unknown gating {kind!r}")


NEUTRAL_GAMMA = 2.0  # gamma * sigmoid(0) = 1: the gate of a zero-scale router is exactly 1


def interpolate_depth(values_by_depth: list[float], depth: float) -> float:
    """Linear interpolation of ``values_by_depth[n]`` (n = 0, 1, ...) at a real ``depth``.

    Serves the variance-scaled rule: the dense model of the same active-equivalent
    depth L_ae has a fractional depth, so its residual variance is read between the
    dense stacks of floor(L_ae) and ceil(L_ae) blocks.
    """
    lo = min(int(math.floor(depth)), len(values_by_depth) - 1)
    hi = min(lo + 1, len(values_by_depth) - 1)
    frac = depth - lo
    return values_by_depth[lo] + frac * (values_by_depth[hi] - values_by_depth[lo])


def solve_gamma(
    added_variance: Callable[[float], float], target: float, tol: float = 0.01, max_iter: int = 8
) -> float:
    """The gate scale gamma at which ``added_variance(gamma)`` equals ``target``.

    ``added_variance`` is the residual variance a stack adds when every sparse gate
    has scale gamma; it grows monotonically with gamma^2 and nearly linearly, so a
    secant iteration in gamma^2, started from gamma = 0 (anchors only) and the
    neutral gate, converges in two to four evaluations. Stops at relative error
    ``tol``. If the anchors alone already add more than ``target`` the rule cannot
    be met; the sparse branches then start nearly closed (gamma^2 at 1% of neutral).
    """
    floor_sq = 0.01 * NEUTRAL_GAMMA**2
    a_sq, v_a = 0.0, added_variance(0.0)
    b_sq, v_b = NEUTRAL_GAMMA**2, added_variance(NEUTRAL_GAMMA)
    if v_a >= target:
        return math.sqrt(floor_sq)
    for _ in range(max_iter):
        if abs(v_b / target - 1.0) <= tol or v_b == v_a:
            break
        c_sq = max(floor_sq, b_sq + (target - v_b) * (b_sq - a_sq) / (v_b - v_a))
        a_sq, v_a = b_sq, v_b
        b_sq, v_b = c_sq, added_variance(math.sqrt(c_sq))
    return math.sqrt(b_sq)


def causal_bce_loss(logit_BT: torch.Tensor, selected_BT: torch.Tensor) -> torch.Tensor:
    """BCE teaching a per-token logit to predict top-k membership (targets detached)."""
    return F.binary_cross_entropy_with_logits(logit_BT.float(), selected_BT.float())


def balance_loss(window_probs: list[torch.Tensor]) -> torch.Tensor:
    """Depth-wise token balancing: squared coefficient of variation of sparse depth.

    ``window_probs``: one (B, T, n) tensor per stride window holding
    p = sigmoid(r) of the window's n sparse blocks. With soft sparse depth
    n_t = sum_l p_{t,l}, the loss is the mean over windows and sequences of
    Var_t(n_t) / Mean_t(n_t)^2. It is scale-free (c does not set its size) and zero
    when every token expects the same sparse depth, so it discourages the routers
    of a window from all picking the same tokens.
    """
    terms = []
    for p_BTN in window_probs:
        n_BT = p_BTN.float().sum(-1)
        mean_B = n_BT.mean(-1)
        var_B = n_BT.var(-1, unbiased=False)
        terms.append((var_B / mean_B.pow(2).clamp_min(1e-12)).mean())
    return torch.stack(terms).mean()


@torch.no_grad()
def routing_stats(
    selections: list[torch.Tensor],
    windows: list[list[int]],
    causal: list[torch.Tensor] | None = None,
    topk: list[torch.Tensor] | None = None,
) -> dict[str, object]:
    """Summaries of where sparse compute went, for logging (not on the training path).

    ``selections``: one (B, T) bool mask per sparse block, in depth order, of the
    tokens the block actually processed. ``windows``: for each stride window, the
    indices into ``selections`` of its sparse blocks. ``causal``/``topk``: the two
    decisions per sparse block, for the agreement rate.

    Returns per-window coverage (fraction of tokens processed by at least one
    sparse block of the window), the normalised histogram of per-token sparse
    depth over the whole stack, the Jaccard overlap of consecutive sparse blocks,
    per-block capacity used, and top-k/causal agreement.
    """
    out: dict[str, object] = {}
    if not selections:
        return out
    sel_NBT = torch.stack(selections).bool()
    out["capacity_used"] = [float(x) for x in sel_NBT.float().mean(dim=(1, 2))]
    out["coverage"] = [
        float(sel_NBT[w].any(0).float().mean()) for w in windows if len(w) > 0
    ]
    depth_BT = sel_NBT.sum(0)
    hist = torch.bincount(depth_BT.flatten(), minlength=len(selections) + 1).float()
    out["depth_hist"] = [float(x) for x in hist / hist.sum()]
    jac = []
    for a, b in zip(sel_NBT[:-1], sel_NBT[1:], strict=True):
        inter = (a & b).sum().float()
        union = (a | b).sum().float().clamp_min(1)
        jac.append(float(inter / union))
    out["jaccard"] = jac
    out["stages"] = [stage_stats(sel_NBT[w]) for w in windows if len(w) > 0]
    if causal is not None and topk is not None:
        agree = [float((c == t).float().mean()) for c, t in zip(causal, topk, strict=True)]
        out["agreement"] = agree
        out["agreement_mean"] = sum(agree) / len(agree)
    return out


@torch.no_grad()
def stage_stats(sel_NBT: torch.Tensor) -> dict[str, object]:
    """Routing diagnostics of one stage (its n sparse blocks' (B, T) selections),
    beside the two reference schemes of the same per-block fraction p:

    * ``coverage``: the fraction of tokens some block of the stage processed;
    * ``jaccard``: mean Jaccard overlap of adjacent blocks' selections;
    * ``update_hist``: the fraction of tokens processed by 0, 1, ..., n blocks;
    * ``identical``: every block picks the same tokens (coverage p, Jaccard 1),
      the collapse the token-choice bias exists to prevent;
    * ``random``: independent uniform picks (coverage 1 - (1 - p)^n, Jaccard
      p / (2 - p), updates binomial(n, p)).
    """
    sel = sel_NBT.bool()
    n = sel.shape[0]
    p = float(sel.float().mean())
    jac = [
        float((a & b).sum()) / max(1.0, float((a | b).sum()))
        for a, b in zip(sel[:-1], sel[1:], strict=True)
    ]
    hist = torch.bincount(sel.sum(0).flatten(), minlength=n + 1).float()
    binom = [math.comb(n, j) * p**j * (1 - p) ** (n - j) for j in range(n + 1)]
    return {
        "blocks": n,
        "coverage": float(sel.any(0).float().mean()),
        "jaccard": sum(jac) / len(jac) if jac else None,
        "update_hist": [float(x) for x in hist / hist.sum()],
        "identical": {"coverage": p, "jaccard": 1.0},
        "random": {"coverage": 1 - (1 - p) ** n, "jaccard": p / (2 - p) if p < 2 else None,
                   "update_hist": binom},
    }
