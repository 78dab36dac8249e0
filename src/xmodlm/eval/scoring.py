"""Log-likelihood of token continuations: the one scorer behind every evaluation.

``score_continuations`` answers "how likely is ``cont`` after ``ctx``" for a batch
of token-id pairs, exactly, whatever their lengths:

* a pair longer than the model's context is scored in windows: the continuation is
  cut into chunks of at most ``context`` tokens and each chunk is predicted from the
  ``context + 1`` last tokens ending with it, so every continuation token is
  predicted exactly once and the last chunk gets the longest history the model
  can see. Scoring ``([eot], document)`` this way is the rolling (perplexity)
  evaluation of lm-evaluation-harness: disjoint windows, a full last window.
* routing is causal (each token's sparse-block decisions depend only on itself and
  the past), which is how an X-MoD model is deployed, and which makes right
  padding harmless: a row's real positions never see its padding. Top-k routing
  would pick the top fraction of *the padded window*, a quantity that depends on
  what it is batched with, so it is not offered here.

The scorer batches windows by length (longest first, so the first batch shows the
peak memory) and runs the model in inference mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch

from xmodlm.errors import UserError
from xmodlm.model import Transformer
from xmodlm.progress import track

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _windows(
    ctx: Sequence[int], cont: Sequence[int], context: int
) -> list[tuple[list[int], int]]:
    """(window tokens, number of predicted tokens at its end) covering ``cont`` once."""
    seq = [*ctx, *cont]
    out = []
    for start in range(len(ctx), len(seq), context):
        end = min(start + context, len(seq))
        out.append((seq[max(0, end - context - 1): end], end - start))
    return out


@torch.inference_mode()
def score_continuations(
    model: Transformer,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    device: str | torch.device = "cpu",
    batch_size: int = 16,
    dtype: str = "fp32",
    desc: str | None = None,
) -> list[tuple[float, bool]]:
    """``(log p(cont | ctx) in nats, cont is the greedy continuation)`` per request.

    ``ctx`` must hold at least one token (use the end-of-text id to score a text
    from a document start); ``cont`` may be empty (log-likelihood 0, greedy).
    ``dtype``: ``fp32`` (default, exact) or ``bf16``/``fp16`` autocast. ``desc``: the
    stage name of a progress display on stderr, per batch (none without it).
    """
    if batch_size < 1:
        raise UserError(f"batch_size must be at least 1, got {batch_size}")
    if dtype not in _DTYPES:
        raise UserError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    context, vocab = model.cfg.context, model.cfg.vocab_size
    device = torch.device(device)
    jobs: list[tuple[int, list[int], int]] = []  # (request, window, n_pred)
    for i, (ctx, cont) in enumerate(requests):
        if len(ctx) == 0:
            raise UserError(
                f"request {i} has an empty context: condition on at least one token"
                " (the end-of-text id for a document start)"
            )
        for tok in (*ctx, *cont):
            if not 0 <= int(tok) < vocab:
                raise UserError(f"request {i} has token id {tok} outside the vocabulary [0, {vocab})")
        jobs.extend((i, win, n) for win, n in _windows(ctx, cont, context))

    logp = [0.0] * len(requests)
    greedy = [True] * len(requests)
    order = sorted(range(len(jobs)), key=lambda j: -len(jobs[j][1]))
    amp = (
        torch.autocast(device.type, dtype=_DTYPES[dtype])
        if _DTYPES[dtype] is not None
        else nullcontext()
    )
    starts = range(0, len(order), batch_size)
    for start in (track(starts, desc, unit="batch") if desc else starts):
        chunk = [jobs[j] for j in order[start: start + batch_size]]
        width = len(chunk[0][1])  # longest first
        x_BT = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, (_, win, _) in enumerate(chunk):
            x_BT[row, : len(win)] = torch.tensor(win)
        x_BT = x_BT.to(device)
        with amp:
            logits_BTV = model(x_BT[:, :-1], routing_mode="causal").logits
        # gather only the predicted positions of each row: (row, position) pairs
        rows, pos = [], []
        for row, (_, win, n) in enumerate(chunk):
            rows.extend([row] * n)
            pos.extend(range(len(win) - 1 - n, len(win) - 1))
        r = torch.tensor(rows, device=device)
        p = torch.tensor(pos, device=device)
        logits_NV = logits_BTV[r, p].float()
        target_N = x_BT[r, p + 1]
        lp_N = torch.log_softmax(logits_NV, dim=-1).gather(-1, target_N[:, None]).squeeze(-1)
        hit_N = logits_NV.argmax(-1) == target_N
        lp, hit = lp_N.cpu().tolist(), hit_N.cpu().tolist()
        at = 0
        for i, _, n in chunk:
            logp[i] += sum(lp[at: at + n])
            greedy[i] = greedy[i] and all(hit[at: at + n])
            at += n
    return list(zip(logp, greedy, strict=True))


def rolling_logprob(
    model: Transformer,
    token_docs: Sequence[Sequence[int]],
    bos_id: int,
    device: str | torch.device = "cpu",
    batch_size: int = 16,
    dtype: str = "fp32",
    desc: str | None = None,
) -> list[float]:
    """Total log-likelihood (nats) of each tokenised document after ``bos_id``, any length."""
    scored = score_continuations(
        model, [([bos_id], doc) for doc in token_docs], device, batch_size, dtype, desc
    )
    return [lp for lp, _ in scored]
