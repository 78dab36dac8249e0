"""The sparse-depth construction: which blocks a model has, from (K, A, N0, depth).

One home for the rule that turns the paper's description of an X-MoD model into a
layout string, one letter per block (``D`` dense or anchor, ``s`` sparse, ``E``
MoE). Configs, FLOP accounting, the model, run records and the recommender all
call it; it is plain arithmetic and imports nothing from the rest of the package.

The paper's construction (its Eq. 3)::

    [Dense] x N0 + ([Sparse(K)] x A*K + [Dense]) x N1

K is the token sparsity (a sparse block processes the top 1/K of a sequence), A
the anchor stride (A*K sparse blocks between two anchors, so a token gets A
sparse updates per stage on average), N0 the dense prefix and N1 the number of
stages. A model is asked for by its *active-equivalent* depth ``N0 + N1 (1 + A)``
(each anchor counts 1, each sparse block 1/K). When the H = depth - N0 active
layers left after the prefix are not a whole number of stages, the first stage is
shortened, as in the paper's A4K8 at 28 active layers::

    D x4 + (S x24 + D) + (S x32 + D) x4        161 blocks, 28 active

Earlier versions described a sparse model by (S, c): every S-th block an anchor
starting with block 0, sparse blocks processing the fraction c. Those stay as
aliases (:func:`from_stride_capacity`, :func:`legacy_layout`): S - 1 = A K sparse
blocks per stage, c = 1 / K; their stages open with an anchor and the last is
not closed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

DENSE, SPARSE, MOE = "D", "s", "E"
LETTERS = DENSE + SPARSE + MOE


class DepthError(ValueError):
    """A (K, A, N0, depth) that the construction cannot build; the message says why
    and what is allowed (the config turns it into a user error)."""


def _exact(x: float) -> Fraction:
    """A config number as an exact fraction (0.125 -> 1/8, 1/3 written as 0.3333 -> 1/3)."""
    return Fraction(x).limit_denominator(10_000)


@dataclass(frozen=True)
class Construction:
    """The paper's construction, solved: the sparse blocks of each stage in order
    (the first may be shorter) and the blocks they add up to."""

    sparsity: float  # K
    anchor_stride: float  # A
    dense_prefix: int  # N0
    active_layers: float  # N0 + N1 (1 + A)
    stage_sparse: tuple[int, ...]  # sparse blocks in each stage, first stage first
    anchors: bool  # False: every anchor after the prefix replaced by K sparse blocks
    dense_rest: int = 0  # dense blocks after the prefix of a model with no sparse block

    @property
    def n_stages(self) -> int:
        return len(self.stage_sparse)

    def layout(self, dense: str = DENSE) -> str:
        """One letter per block; ``dense`` is the letter of prefix and anchor blocks
        (``E`` for an MoE model)."""
        k = round(self.sparsity)
        closing = dense if self.anchors else SPARSE * k
        stages = "".join(SPARSE * n + closing for n in self.stage_sparse)
        return dense * (self.dense_prefix + self.dense_rest) + stages


def construct(
    sparsity: float,
    anchor_stride: float,
    dense_prefix: int,
    active_layers: float,
    anchors: bool = True,
) -> Construction:
    """Solve the paper's construction for a model of ``active_layers`` active-equivalent
    layers. Raises :class:`DepthError` for a combination it cannot build.

    ``anchors=False`` is the "w/o dense anchors" ablation: every anchor after the
    prefix becomes K sparse blocks, which keeps the active depth (K x 1/K = 1) and
    adds K - 1 blocks' parameters; the stages then have no boundary left, so the
    token-choice bias runs over the whole sparse stack.
    """
    K, A = _exact(sparsity), _exact(anchor_stride)
    depth = _exact(active_layers)
    if K < 1:
        raise DepthError(f"sparsity K={sparsity}: must be >= 1 (a sparse block takes 1/K of the tokens)")
    if dense_prefix < 0:
        raise DepthError(f"dense_prefix N0={dense_prefix}: must be an integer >= 0")
    if depth < dense_prefix:
        raise DepthError(
            f"active_layers={active_layers} is less than dense_prefix={dense_prefix}:"
            " the prefix alone is deeper than the model"
        )
    H = depth - dense_prefix
    if K == 1 or A == 0 or H == 0:  # no sparse block: dense of the same active depth
        if H.denominator != 1:
            raise DepthError(f"active_layers={active_layers}: a dense model needs a whole depth")
        return Construction(float(K), float(A), dense_prefix, float(depth), (), anchors, int(H))
    if A < 0:
        raise DepthError(f"anchor_stride A={anchor_stride}: must be >= 0")
    if K.denominator != 1:
        raise DepthError(f"sparsity K={sparsity}: must be a whole number")
    per_stage = A * K
    if per_stage.denominator != 1:
        raise DepthError(
            f"anchor_stride A={anchor_stride} with sparsity K={sparsity}: A*K = {float(per_stage):g}"
            " sparse blocks per stage must be whole"
        )
    n_full = math.floor(H / (1 + A))
    rest = H - n_full * (1 + A)  # active layers of a shortened first stage
    stages = [int(per_stage)] * n_full
    if rest:
        first = (rest - 1) * K
        if rest < 1 or first.denominator != 1:
            raise DepthError(
                f"active_layers={active_layers}, dense_prefix={dense_prefix}, A={anchor_stride},"
                f" K={sparsity}: the {float(H):g} active layers after the prefix leave"
                f" {float(rest):g} for a shortened first stage, which needs an anchor (1) plus"
                f" a whole number of sparse blocks (multiples of 1/K): choose active_layers so"
                f" that active_layers - dense_prefix is a multiple of 1 + A = {float(1 + A):g}"
            )
        stages.insert(0, int(first))
    return Construction(float(K), float(A), dense_prefix, float(depth), tuple(stages), anchors)


def paper_layout(
    sparsity: float,
    anchor_stride: float,
    dense_prefix: int,
    active_layers: float,
    anchors: bool = True,
    dense: str = DENSE,
) -> str:
    """The layout string of :func:`construct`."""
    return construct(sparsity, anchor_stride, dense_prefix, active_layers, anchors).layout(dense)


# --- the (S, c) aliases ----------------------------------------------------------


def routes(stride: int, capacity: float) -> bool:
    """Whether the (S, c) layout has sparse blocks: an anchor stride above one and a
    capacity below one (otherwise every block is dense)."""
    return stride > 1 and capacity < 1


def legacy_layout(n_layers: int, stride: int, capacity: float, dense: str = DENSE) -> str:
    """The layout of (depth, S, c): block 0 an anchor, then every S-th block; the
    rest sparse. Stages open with their anchor; the last one is not closed."""
    if not routes(stride, capacity):
        return dense * n_layers
    return "".join(dense if i % stride == 0 else SPARSE for i in range(n_layers))


def from_stride_capacity(stride: int, capacity: float) -> tuple[float, float]:
    """(K, A) of an (S, c) description: K = 1 / c, A = (S - 1) / K."""
    if not routes(stride, capacity):
        return 1.0, 0.0
    K = 1.0 / capacity
    return K, (stride - 1) / K


def to_stride_capacity(sparsity: float, anchor_stride: float) -> tuple[int, float]:
    """(S, c) of a (K, A) description: c = 1 / K, S = A K + 1 (the blocks of a full stage)."""
    if sparsity <= 1 or anchor_stride == 0:
        return 1, 1.0
    return round(anchor_stride * sparsity) + 1, 1.0 / sparsity


# --- reading a layout ----------------------------------------------------------------


def stages(layout: str) -> list[list[int]]:
    """The sparse blocks of each stage, as indices among sparse blocks: a stage ends
    at every non-sparse block (the token-choice bias and the routing diagnostics
    run within a stage); sparse blocks with no block after them form the last."""
    out: list[list[int]] = [[]]
    n_sparse = 0
    for letter in layout:
        if letter == SPARSE:
            out[-1].append(n_sparse)
            n_sparse += 1
        elif out[-1]:
            out.append([])
    return [s for s in out if s]


def active_depth(layout: str, fraction: float) -> float:
    """Active-equivalent depth: non-sparse blocks count 1, a sparse block the
    ``fraction`` of tokens it processes (k / L as executed)."""
    n_sparse = layout.count(SPARSE)
    return (len(layout) - n_sparse) + fraction * n_sparse


def expansion_ratio(layout: str, fraction: float) -> float:
    """rho = blocks / active-equivalent blocks of a layout whose sparse blocks process
    ``fraction`` of the tokens."""
    return len(layout) / active_depth(layout, fraction)


# --- one resolution for every description ----------------------------------------

NEUTRAL = {"sparsity": 1.0, "anchor_stride": 1.0, "stride": 1, "capacity": 1.0}
"""The values of the depth settings that mean "not given" (each is also the dense
value): a setting left at its neutral value is filled in from its alias."""


@dataclass(frozen=True)
class Depth:
    """A model's sparse depth, every description of it filled in: (K, A, N0) as the
    paper writes it, (S, c) as earlier versions did, and the layout they give."""

    sparsity: float  # K
    anchor_stride: float  # A
    dense_prefix: int  # N0: dense blocks before the first stage
    stride: int  # S = A K + 1
    capacity: float  # c = 1 / K
    layout: str
    construction: str  # "paper" ((K, A, N0, active depth)), "stride" ((depth, S, c)) or "explicit"


def resolve(
    *,
    n_layers: int,
    stride: int,
    capacity: float,
    layout: str,
    sparsity: float,
    anchor_stride: float,
    dense_prefix: int,
    active_layers: float,
    anchors: bool,
    dense: str = DENSE,
) -> Depth:
    """The one place every depth description is resolved (the config calls it).

    With ``active_layers > 0`` the paper's construction builds the layout from
    (K, A, N0); (S, c), when given instead, are read as K = 1 / c, A = (S - 1) c.
    Otherwise the layout is ``layout`` if given, else (depth, S, c), where (K, A),
    when given instead, are read as c = 1 / K, S = A K + 1. Two descriptions of the
    same quantity that disagree raise :class:`DepthError`.
    """
    K, A = _agree(sparsity, anchor_stride, stride, capacity)
    if active_layers > 0:
        if layout:
            raise DepthError("give either model.layout or model.active_layers, not both")
        built = paper_layout(K, A, dense_prefix, active_layers, anchors, dense)
        S, c = to_stride_capacity(K, A)
        return Depth(K, A, dense_prefix, S, c, built, "paper")
    S, c = to_stride_capacity(K, A) if (stride, capacity) == (1, 1.0) else (stride, capacity)
    built = layout or legacy_layout(n_layers, S, c, dense)
    K, A = from_stride_capacity(S, c) if routes(S, c) else (K, A)
    prefix = len(built) - len(built.lstrip(DENSE + MOE)) if SPARSE in built else len(built)
    return Depth(K, A, prefix, S, c, built, "explicit" if layout else "stride")


def _agree(sparsity: float, anchor_stride: float, stride: int, capacity: float) -> tuple[float, float]:
    """(K, A) from whichever of (K, A) and (S, c) were given; both given must agree."""
    K = sparsity
    if capacity != NEUTRAL["capacity"]:
        if capacity <= 0:
            raise DepthError(f"model.capacity={capacity}: must be in (0, 1]")
        from_c = 1.0 / capacity
        if sparsity != NEUTRAL["sparsity"] and not math.isclose(sparsity, from_c, rel_tol=1e-6):
            raise DepthError(
                f"model.sparsity={sparsity} and model.capacity={capacity} disagree:"
                f" capacity is 1/K (here 1/{from_c:g}); give one of them"
            )
        K = sparsity if sparsity != NEUTRAL["sparsity"] else from_c
    A = anchor_stride
    if stride != NEUTRAL["stride"]:
        from_s = (stride - 1) / K if K > 1 else 0.0
        if anchor_stride != NEUTRAL["anchor_stride"] and not math.isclose(
                anchor_stride, from_s, rel_tol=1e-6):
            raise DepthError(
                f"model.anchor_stride={anchor_stride} and model.stride={stride} disagree:"
                f" stride is A*K + 1 (here A = {from_s:g}); give one of them"
            )
        A = anchor_stride if anchor_stride != NEUTRAL["anchor_stride"] else from_s
    return K, A
