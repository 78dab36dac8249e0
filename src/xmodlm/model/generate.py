"""Autoregressive generation with a sparse KV cache.

Routing at inference is the *causal* decision, exactly as
``RoutedBlock.forward(mode="causal")`` decides it: a sparse block processes a
token iff its depth router says so from that token alone (its decision logit
above the block's threshold: :mod:`xmodlm.model.depth_router`). Prefill and
decode use the same rule, so generating with the cache computes what a full forward pass in
``routing_mode="causal"`` computes over the same tokens (tested to fp32
round-off).

How a batch is decoded (:class:`Decoder`):

* **prefill**: the prompts, right-padded to the longest, go through the stack in
  one pass. Right padding keeps every token at its real position (0, 1, ...),
  and causal attention never lets a real token see the padding after it. Padding
  is never routed (the decision is and-ed with validity) and never cached (each
  sequence's fill length is its own prompt length). A sparse block gathers its
  routed tokens per sequence (in causal order, with their original rotary
  positions), runs on those only, and appends them to its cache.
* **decode**: one token per sequence per step, at that sequence's own position.
  Dense blocks append every token. A sparse block needs its routers' decisions
  (a host sync); if no sequence routes its token the block is skipped
  altogether, otherwise only the routed sequences' rows are gathered, run
  through the block, cached and added back. A skipped block leaves the stream
  as it was, so the decisions of a run of consecutive sparse blocks (whose kind
  decides by the router logit) are scored together, in one matmul and one sync,
  up to the first block some sequence takes; after it, the rest of the run is
  scored again (:class:`_SparseRun`). A token routed through c of a window's
  blocks then costs about one sync per block it takes, not one per block. At batch 1 this is
  where decoding saves time; at larger batches the block's weights are read
  whenever *any* sequence routes, so the saving in a memory-bound step shrinks
  to the probability that none does, (1 - c)^B.
* sequences that finish (end-of-text, their token budget, or the context) leave
  the batch: their rows are dropped from the cache in place, without
  reallocation.

The cache (:mod:`xmodlm.model.kv_cache`) is preallocated; sparse buffers are
sized for the expected routed fraction and grow geometrically if exceeded,
never per token.

Positions are bounded by the model's context (its rotary table), so a sequence
stops when prompt plus generated tokens reach ``cfg.context``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from xmodlm.errors import UserError
from xmodlm.model import routing
from xmodlm.model.blocks import DecodeStep, Prompts, RoutedBlock
from xmodlm.model.kv_cache import DEFAULT_SLACK, KVCache
from xmodlm.model.transformer import Transformer


class Decoder:
    """Prefill and one-token steps over a batch, holding the model's KV cache.

    ``max_len``: the most tokens any sequence will be fed (prompt plus generated
    tokens that are fed back), at most the model's context. ``sparse_alloc``
    and ``slack``: the cache's allocation policy for sparse blocks.
    """

    def __init__(
        self,
        model: Transformer,
        batch: int,
        max_len: int,
        *,
        sparse_alloc: str = "expected",
        slack: float = DEFAULT_SLACK,
    ) -> None:
        assert max_len <= model.cfg.context, "max_len exceeds the model's context"
        self.model = model
        weight = model.embed.weight
        self.device = weight.device
        self.cache = KVCache(
            model.cfg,
            batch,
            max_len,
            dtype=weight.dtype,
            device=weight.device,
            sparse_alloc=sparse_alloc,
            slack=slack,
        )
        self.seq_len = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.seq_lens = [0] * batch
        self.runs = _SparseRun.of(model)

    @property
    def batch(self) -> int:
        return len(self.seq_lens)

    # --- prefill ----------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], all_logits: bool = False) -> torch.Tensor:
        """Run the prompts in one pass and fill the cache.

        Returns the logits of each prompt's last token, (B, V); with
        ``all_logits`` the logits of every position, (B, T_max, V) (positions past
        a prompt's end are padding and meaningless).
        """
        model = self.model
        assert len(prompts) == self.batch and not any(self.seq_lens), "prefill an empty decoder"
        lens = [len(p) for p in prompts]
        T = max(lens)
        assert min(lens) >= 1 and T <= self.cache.max_len
        idx_BT = torch.zeros(self.batch, T, dtype=torch.long)
        for b, p in enumerate(prompts):
            idx_BT[b, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        idx_BT = idx_BT.to(self.device)
        lens_B = torch.tensor(lens, dtype=torch.long, device=self.device)
        pos_T = torch.arange(T, device=self.device)
        valid_BT = pos_T.unsqueeze(0) < lens_B.unsqueeze(1)
        ragged = min(lens) != T
        cos, sin = model.rope(pos_T)
        prompts = Prompts(model.rope, pos_T, cos, sin, valid_BT, lens, lens_B)
        x = model.embed(idx_BT)
        bias = routing.TokenBias(model.cfg.token_bias, model.cfg.token_bias_step)
        for block, cache in zip(model.blocks, self.cache.blocks, strict=True):
            if isinstance(block, RoutedBlock):
                x, sel_BT = block.prefill(x, prompts, cache, bias.shift())
                bias.selected(sel_BT)
            else:
                x = block.prefill(x, prompts, cache)
                bias.reset()
        self.seq_len.copy_(lens_B)
        self.seq_lens = lens
        if all_logits:
            return model.head(model.norm(x))
        if ragged:
            x_BD = x[torch.arange(self.batch, device=self.device), lens_B - 1]
        else:
            x_BD = x[:, -1]
        return model.head(model.norm(x_BD))

    # --- decode -----------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, tokens_B: torch.Tensor) -> torch.Tensor:
        """Feed one token per sequence (at its own next position); return logits (B, V)."""
        model = self.model
        assert tokens_B.shape == (self.batch,)
        assert max(self.seq_lens) < self.cache.max_len, "decoder is full (max_len tokens fed)"
        pos_B = self.seq_len
        cos, sin = model.rope(pos_B.unsqueeze(1))
        step = DecodeStep(pos_B, cos, sin)
        x = model.embed(tokens_B.to(self.device).unsqueeze(1))
        blocks, caches = model.blocks, self.cache.blocks
        bias = routing.TokenBias(model.cfg.token_bias, model.cfg.token_bias_step)
        i = 0
        while i < len(blocks):
            run = self.runs.get(i)
            if run is None:
                if isinstance(blocks[i], RoutedBlock):
                    x, sel = blocks[i].step(x, step, caches[i], bias.shift())
                    if bias.tau:
                        bias.selected(torch.tensor(sel, device=self.device).unsqueeze(1))
                else:
                    x = blocks[i].step(x, step, caches[i])
                    bias.reset()
                i += 1
                continue
            # the blocks a run skips select nothing: the bias stays as it is over them
            taken, r_B1, sel = run.first_taken(i, x, bias.shift())
            if taken is None:  # no sequence takes any block left in the run
                i = run.end
                continue
            x = blocks[taken].step_decided(x, step, caches[taken], r_B1, sel)
            if bias.tau:
                bias.selected(torch.tensor(sel, device=self.device).unsqueeze(1))
            i = taken + 1
        self.seq_len += 1
        self.seq_lens = [n + 1 for n in self.seq_lens]
        return model.head(model.norm(x[:, 0]))

    @torch.inference_mode()
    def keep(self, rows: list[int]) -> None:
        """Keep only sequences ``rows`` (indices into the current batch), in that order."""
        if rows == list(range(self.batch)):
            return
        self.cache.keep(rows)
        self.seq_len = self.seq_len[torch.tensor(rows, dtype=torch.long, device=self.device)]
        self.seq_lens = [self.seq_lens[r] for r in rows]


class _SparseRun:
    """Consecutive sparse blocks whose decisions are their router logits, scored
    together: the routers stacked (N, D) and the thresholds in effect (N,), both
    read when the decoder is made. :meth:`of` maps each block index inside a run
    to its run."""

    def __init__(self, blocks: list[RoutedBlock], start: int) -> None:
        self.start, self.end = start, start + len(blocks)
        self.w_ND = torch.cat([b.router.weight.detach().float() for b in blocks])
        self.thr_N = torch.stack([
            torch.as_tensor(b.router.effective_threshold(), dtype=torch.float32,
                            device=self.w_ND.device).reshape(())
            for b in blocks
        ])

    @classmethod
    def of(cls, model: Transformer) -> dict[int, _SparseRun]:
        runs: dict[int, _SparseRun] = {}
        group: list[RoutedBlock] = []
        for i, block in enumerate([*model.blocks, None]):
            if isinstance(block, RoutedBlock) and block.router.kind.decides_by_router_logit:
                group.append(block)
                continue
            if len(group) > 1:
                run = cls(group, i - len(group))
                runs.update(dict.fromkeys(range(run.start, run.end), run))
            group = []
        return runs

    def first_taken(
        self, i: int, x_B1D: torch.Tensor, shift_B1: torch.Tensor | None = None
    ) -> tuple[int | None, torch.Tensor | None, list[bool]]:
        """The first block from ``i`` on that some sequence takes: its index, router
        logits (B, 1, less the token-choice bias ``shift``) and decisions; (None,
        None, []) when none takes any."""
        k = i - self.start
        r_BN = x_B1D[:, 0].float() @ self.w_ND[k:].T
        if shift_B1 is not None:
            r_BN = r_BN - shift_B1
        sel_BN = r_BN > self.thr_N[k:]
        any_N = sel_BN.any(0).tolist()
        if True not in any_N:
            return None, None, []
        j = any_N.index(True)
        return i + j, r_BN[:, j : j + 1], sel_BN[:, j].tolist()


# --- sampling ---------------------------------------------------------------------------


def _check_sampling(
    max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None
) -> None:
    if max_new_tokens < 0:
        raise UserError(f"max_new_tokens={max_new_tokens}: must be >= 0")
    if not temperature >= 0 or math.isinf(temperature):
        raise UserError(f"temperature={temperature}: must be >= 0 (0 = greedy)")
    if top_k is not None and top_k < 1:
        raise UserError(f"top_k={top_k}: must be >= 1 (or unset)")
    if top_p is not None and not (0.0 < top_p <= 1.0):
        raise UserError(f"top_p={top_p}: must be in (0, 1] (or unset)")


def _check_prompts(model: Transformer, prompts: Sequence[Sequence[int]]) -> None:
    cfg = model.cfg
    if len(prompts) == 0:
        raise UserError("no prompts given: pass at least one prompt")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise UserError(
                f"prompt {i} is empty: give at least one token"
                " (e.g. the end-of-text token to sample unconditionally)"
            )
        if len(p) >= cfg.context:
            raise UserError(
                f"prompt {i} has {len(p)} tokens but the model's context is {cfg.context}:"
                f" at most {cfg.context - 1} prompt tokens leave room to generate"
            )
        bad = [t for t in p if not (0 <= int(t) < cfg.vocab_size)]
        if bad:
            raise UserError(
                f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {cfg.vocab_size})"
            )


def sample_next(
    logits_BV: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token per row: argmax at temperature 0, else sampled from the filtered softmax.

    ``top_k`` keeps the k most likely tokens; ``top_p`` the smallest set whose
    probability reaches p (always at least the most likely token).
    """
    if temperature == 0:
        return logits_BV.argmax(-1)
    # in float64 (a float32 temperature of 1e-300 is 0), the best logit at 0 first: a
    # small temperature then sends the others to -inf, never all of them (softmax nan)
    logits = logits_BV.double()
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    V = logits.shape[-1]
    if top_k is not None and top_k < V:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the more likely tokens
        sorted_logits = sorted_logits.masked_fill(before >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(int(seed))


# --- public entry points ------------------------------------------------------------------


@torch.inference_mode()
def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eot_id: int | None = None,
    *,
    vocab_limit: int | None = None,
    stop: Callable[[int, list[int]], bool] | None = None,
) -> list[list[int]]:
    """Continue every prompt (a list of token ids) by up to ``max_new_tokens`` tokens.

    All prompts run as one batch; each keeps its own positions and cache fill,
    so the result equals generating each prompt alone (up to fp round-off, and
    exactly the same tokens when greedy). Returns the *new* tokens of each
    prompt; a sequence stops after emitting ``eot_id`` (included in its output),
    after ``max_new_tokens``, or when prompt plus output reach the context.
    ``temperature`` 0 is greedy. ``seed`` makes sampling reproducible (None:
    torch's global generator). ``vocab_limit``: never sample ids at or above it
    (a tokenizer smaller than the model's vocabulary). ``stop(row, new_tokens)``,
    called after each new token, ends that row early when it returns True (stop
    strings: the caller decodes and looks).
    """
    _check_prompts(model, prompts)
    _check_sampling(max_new_tokens, temperature, top_k, top_p)
    out: list[list[int]] = [[] for _ in prompts]
    if max_new_tokens == 0:
        return out
    context = model.cfg.context
    budgets = [min(max_new_tokens, context - len(p)) for p in prompts]
    max_fed = max(len(p) + n - 1 for p, n in zip(prompts, budgets, strict=True))
    dec = Decoder(model, len(prompts), max(1, max_fed))
    gen = _generator(seed, dec.device)
    rows = list(range(len(prompts)))
    logits = dec.prefill(prompts)
    while True:
        if vocab_limit is not None and vocab_limit < logits.shape[-1]:
            logits[:, vocab_limit:] = float("-inf")
        tok_B = sample_next(logits, temperature, top_k, top_p, gen)
        keep = []
        for i, (row, tok) in enumerate(zip(rows, tok_B.tolist(), strict=True)):
            out[row].append(tok)
            done = tok == eot_id or len(out[row]) >= budgets[row]
            if not done and (stop is None or not stop(row, out[row])):
                keep.append(i)
        if not keep:
            return out
        if len(keep) < len(rows):
            dec.keep(keep)
            rows = [rows[i] for i in keep]
            tok_B = tok_B[torch.tensor(keep, dtype=torch.long, device=tok_B.device)]
        logits = dec.step(tok_B)


@torch.inference_mode()
def decode_logits(
    model: Transformer,
    tokens: torch.Tensor | Sequence[Sequence[int]],
    prefill: int = 1,
    *,
    sparse_alloc: str = "expected",
    slack: float = DEFAULT_SLACK,
    return_cache: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, KVCache]:
    """Logits (B, T, V) of equal-length sequences computed through the cache.

    The first ``prefill`` tokens go through :meth:`Decoder.prefill` in one pass,
    the rest one step at a time. Equals ``model(tokens, routing_mode="causal")``
    up to round-off; with ``return_cache`` also returns the filled cache.
    """
    idx_BT = torch.as_tensor(tokens, dtype=torch.long)
    B, T = idx_BT.shape
    assert 1 <= prefill <= T <= model.cfg.context
    dec = Decoder(model, B, T, sparse_alloc=sparse_alloc, slack=slack)
    logits = [dec.prefill(idx_BT[:, :prefill].tolist(), all_logits=True)]
    for t in range(prefill, T):
        logits.append(dec.step(idx_BT[:, t]).unsqueeze(1))
    out = torch.cat(logits, dim=1)
    return (out, dec.cache) if return_cache else out


def generate_text(
    model: Transformer,
    tokenizer: Any,
    prompts: Sequence[str],
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
) -> list[str]:
    """Continue text prompts; returns each continuation's text (without the end-of-text token).

    ``tokenizer``: a :class:`xmodlm.data.tokenizer.Tokenizer` (``encode``,
    ``decode``, ``eot_id``, ``vocab_size``). An empty prompt is an error; to
    sample unconditionally, pass the text ``<|endoftext|>``.
    """
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise UserError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model only"
            f" {model.cfg.vocab_size}: they do not belong together"
        )
    ids = [tokenizer.encode(p) for p in prompts]
    for i, (text, p) in enumerate(zip(prompts, ids, strict=True)):
        if not p:
            raise UserError(
                f"prompt {i} ({text!r}) is empty: give some text, or <|endoftext|>"
                " to sample unconditionally"
            )
    new = generate(
        model,
        ids,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        eot_id=tokenizer.eot_id,
        vocab_limit=tokenizer.vocab_size,
    )
    eot = tokenizer.eot_id
    return [tokenizer.decode(t[:-1] if t and t[-1] == eot else t) for t in new]
