"""A key/value cache that is sparse where the model is.

Every block keeps one preallocated buffer of keys and values,
``(B, G, capacity, head_dim)`` each (G = n_kv_heads: grouped queries share
them, so the cache is n_kv_heads / n_heads of a multi-head one), the original
position of every cached token, ``(B, capacity)`` int32, and a per-sequence
fill length. Keys are stored
with their rotary rotation already applied, at the token's *original* position,
so attention over a block's cache needs nothing but the buffer.

* Anchor, dense and MoE blocks see every token: they cache every token and their
  capacity is the longest sequence the decoder will be fed (``max_len``).
* A sparse block caches only the tokens routed through it (causal decision
  true), in causal order. Its buffer therefore fills at the routed fraction,
  about ``c``, so a model's KV memory is about ``L_active / L`` of a dense model
  of the same depth (plus a little bookkeeping: the positions).

Allocation policy of sparse buffers (``sparse_alloc``):

* ``"expected"`` (default): start at ``ceil(c * max_len * slack)`` slots
  (``slack`` 1.25 by default, never below :data:`MIN_SPARSE_SLOTS` or above
  ``max_len``) and, when a sequence's routed tokens would overflow that, grow
  by doubling (capped at ``max_len``). Growth copies the buffer, so it is
  amortised O(1) per token and happens O(log(1 / c)) times at most, never per
  token. Calibrated causal thresholds route the fraction ``c`` of the
  calibration text, so a trained model rarely grows at all, and the *allocated* memory is then about
  ``slack`` times the memory actually used by the sparse blocks.
* ``"worst_case"``: every sparse buffer is ``max_len`` slots from the start
  (never grows). The memory actually holding tokens is the same; only the
  allocation is larger, as large as a dense model's.

Either way :meth:`KVCache.bytes_used` counts the bytes holding cached tokens
(keys and values of ``sum_b length_b`` tokens per block) and
:meth:`KVCache.bytes_allocated` the bytes of the buffers as allocated. Both
count keys and values only; positions add 4 bytes per slot
(:meth:`KVCache.bytes_positions`), i.e. ``2 / (n_kv_heads * head_dim *
dtype_bytes)`` of the KV bytes. :func:`xmodlm.flops.kv_bytes_formula` is the
analytic count that ``bytes_used`` must equal.

Decoding appends one token per step to the sequences that a block processes:
every sequence for anchor, dense and MoE blocks, the routed ones for a sparse
block (their rows are gathered, so a sequence that is not routed costs nothing).
Capacity is kept at least ``max_b length_b + 1`` before each write.
"""

from __future__ import annotations

import math

import torch

from xmodlm.config import ModelConfig
from xmodlm.errors import UserError

SPARSE_ALLOCS = ("expected", "worst_case")
DEFAULT_SLACK = 1.25
MIN_SPARSE_SLOTS = 8
GROWTH = 2


def sparse_initial_capacity(capacity: float, max_len: int, slack: float = DEFAULT_SLACK) -> int:
    """Initial slots of a sparse block's buffer under the ``expected`` policy."""
    want = max(MIN_SPARSE_SLOTS, math.ceil(capacity * max_len * slack))
    return min(max_len, want)


class BlockCache:
    """Keys, values and positions of one block, for a batch of sequences.

    ``k``/``v``: (B, G, capacity, K), G the key/value heads; ``pos``: (B, capacity) int32 original
    positions; ``length``: (B,) tokens held per sequence (on the device, for
    masks) mirrored in ``lengths`` (a host list, for sizes, so that no step
    needs a device sync to know them).
    """

    def __init__(
        self,
        batch: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        max_len: int,
        sparse: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        assert 0 < capacity <= max_len
        self.sparse = sparse
        self.max_len = max_len
        self.n_grows = 0
        self.k = torch.zeros(batch, n_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.zeros(batch, capacity, dtype=torch.int32, device=device)
        self.length = torch.zeros(batch, dtype=torch.long, device=device)
        self.lengths = [0] * batch
        self._rows = torch.arange(batch, device=device)

    @property
    def batch(self) -> int:
        return self.k.shape[0]

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def token_bytes(self) -> int:
        """Bytes of one cached token (its key and value over all heads)."""
        return 2 * self.k.shape[1] * self.k.shape[3] * self.k.element_size()

    def bytes_used(self) -> int:
        return sum(self.lengths) * self.token_bytes()

    def bytes_allocated(self) -> int:
        return self.k.untyped_storage().nbytes() + self.v.untyped_storage().nbytes()

    def bytes_positions(self) -> int:
        return self.pos.untyped_storage().nbytes()

    def ensure(self, needed: int) -> None:
        """Make room for ``needed`` slots per sequence, growing geometrically."""
        if needed <= self.capacity:
            return
        assert needed <= self.max_len, f"cache overflow: {needed} slots > max_len {self.max_len}"
        new_cap = min(self.max_len, max(needed, GROWTH * self.capacity))
        fill = max(self.lengths, default=0)
        B, H, _, K = self.k.shape
        k = self.k.new_zeros(B, H, new_cap, K)
        v = self.v.new_zeros(B, H, new_cap, K)
        pos = self.pos.new_zeros(B, new_cap)
        k[:, :, :fill] = self.k[:, :, :fill]
        v[:, :, :fill] = self.v[:, :, :fill]
        pos[:, :fill] = self.pos[:, :fill]
        self.k, self.v, self.pos = k, v, pos
        self.n_grows += 1

    def prefill(
        self,
        k_BHTK: torch.Tensor,
        v_BHTK: torch.Tensor,
        pos_BT: torch.Tensor,
        counts: list[int],
        counts_B: torch.Tensor,
    ) -> None:
        """Store the first ``counts[b]`` of T tokens of each (empty) sequence.

        Slots past a sequence's count receive whatever the input holds there
        (padding); they lie past its length, are never attended, and are
        overwritten by the next tokens.
        """
        assert not any(self.lengths), "prefill needs an empty cache"
        T = k_BHTK.shape[2]
        self.ensure(T)
        self.k[:, :, :T] = k_BHTK
        self.v[:, :, :T] = v_BHTK
        self.pos[:, :T] = pos_BT
        self.length.copy_(counts_B)
        self.lengths = list(counts)

    def step(
        self,
        k_BH1K: torch.Tensor,
        v_BH1K: torch.Tensor,
        pos_B: torch.Tensor,
        rows: list[int] | None = None,
        rows_R: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Append one token to each of the given sequences; return (keys, values, mask).

        ``rows`` (host list) / ``rows_R`` (the same indices on the device): the
        sequences the token goes to, in order, and the rows of ``k``/``v``/``pos``;
        None for every sequence. Each of them then attends to its slots
        ``0..length_b`` (its own new token included): the keys and values
        returned are ``L = max length_b`` slots long, one row per given sequence,
        and ``mask`` ((R, 1, 1, L), True = may attend) is None when all those
        lengths are equal. With a subset of rows the keys and values are a
        gathered copy (R rows of L slots); otherwise they are views.
        """
        lengths = self.lengths if rows is None else [self.lengths[r] for r in rows]
        top = max(lengths)
        self.ensure(top + 1)
        L = top + 1
        equal = min(lengths) == top
        if rows is None:
            if equal:
                self.k[:, :, top] = k_BH1K[:, :, 0]
                self.v[:, :, top] = v_BH1K[:, :, 0]
                self.pos[:, top] = pos_B.to(torch.int32)
            else:
                slot_B = self.length
                self.k[self._rows, :, slot_B] = k_BH1K[:, :, 0]
                self.v[self._rows, :, slot_B] = v_BH1K[:, :, 0]
                self.pos[self._rows, slot_B] = pos_B.to(torch.int32)
            self.length += 1
            self.lengths = [n + 1 for n in lengths]
            keys, values = self.k[:, :, :L], self.v[:, :, :L]
            slot = self.length - 1
        else:
            assert rows_R is not None and len(rows) == rows_R.shape[0]
            slot = self.length[rows_R]
            self.k[rows_R, :, slot] = k_BH1K[:, :, 0]
            self.v[rows_R, :, slot] = v_BH1K[:, :, 0]
            self.pos[rows_R, slot] = pos_B.to(torch.int32)
            self.length[rows_R] += 1
            for r in rows:
                self.lengths[r] += 1
            keys = self.k[:, :, :L].index_select(0, rows_R)
            values = self.v[:, :, :L].index_select(0, rows_R)
        mask = None
        if not equal:
            slots = torch.arange(L, device=slot.device)
            mask = (slots.unsqueeze(0) <= slot.unsqueeze(1))[:, None, None, :]
        return keys, values, mask

    def keep(self, rows: list[int]) -> None:
        """Keep only the sequences ``rows`` (in that order), in place: no reallocation."""
        n = len(rows)
        idx = torch.tensor(rows, dtype=torch.long, device=self.k.device)
        self.k[:n] = self.k[idx]
        self.v[:n] = self.v[idx]
        self.pos[:n] = self.pos[idx]
        self.k, self.v, self.pos = self.k[:n], self.v[:n], self.pos[:n]
        self.length = self.length[idx]
        self.lengths = [self.lengths[r] for r in rows]
        self._rows = self._rows[:n]

    def positions(self, row: int) -> list[int]:
        """Original positions of the tokens cached for sequence ``row``, in order."""
        return self.pos[row, : self.lengths[row]].tolist()


class KVCache:
    """One :class:`BlockCache` per block of a model, sized from its config.

    ``max_len``: the most tokens any sequence will be fed. ``sparse_alloc``,
    ``slack``: the allocation policy of sparse blocks (see the module docstring).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        batch: int,
        max_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        sparse_alloc: str = "expected",
        slack: float = DEFAULT_SLACK,
    ) -> None:
        if sparse_alloc not in SPARSE_ALLOCS:
            raise UserError(
                f"sparse_alloc={sparse_alloc!r}: must be one of {', '.join(SPARSE_ALLOCS)}"
            )
        if slack <= 0:
            raise UserError(f"slack={slack}: must be > 0")
        assert batch >= 1 and max_len >= 1
        self.cfg = cfg
        self.layout = cfg.block_layout
        self.max_len = max_len
        device = torch.device(device)
        self.blocks: list[BlockCache] = []
        for letter in self.layout:
            sparse = letter == "s"
            cap = max_len
            if sparse and sparse_alloc == "expected":
                cap = sparse_initial_capacity(cfg.depth.capacity, max_len, slack)
            self.blocks.append(BlockCache(
                batch, cfg.attn_kv_heads, cfg.attn_head_dim, cap, max_len, sparse, dtype, device
            ))

    def bytes_used(self) -> int:
        """Bytes of keys and values actually holding cached tokens."""
        return sum(b.bytes_used() for b in self.blocks)

    def bytes_allocated(self) -> int:
        """Bytes of the key and value buffers as allocated."""
        return sum(b.bytes_allocated() for b in self.blocks)

    def bytes_positions(self) -> int:
        """Bytes of the position bookkeeping (int32 per slot)."""
        return sum(b.bytes_positions() for b in self.blocks)

    def routed_tokens(self) -> list[int]:
        """Tokens cached per block, summed over the batch (all tokens for non-sparse blocks)."""
        return [sum(b.lengths) for b in self.blocks]

    def n_grows(self) -> int:
        return sum(b.n_grows for b in self.blocks)

    def keep(self, rows: list[int]) -> None:
        for block in self.blocks:
            block.keep(rows)
