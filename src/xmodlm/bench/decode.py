"""Decode speed of the model family.

Decoding is timed on untrained models. Their causal thresholds are calibrated on
random tokens (:func:`calibrate_untrained_`), as training calibrates them on text,
so each sparse block routes the fraction it would be trained at.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import torch

from xmodlm.config import ModelConfig
from xmodlm.errors import UserError
from xmodlm.flops import active_depth, kv_bytes_formula
from xmodlm.model.generate import Decoder, sample_next
from xmodlm.model.transformer import Transformer


@torch.no_grad()
def calibrate_untrained_(
    model: Transformer, *, batch: int = 32, seq_len: int | None = None, seed: int = 0
) -> list[float]:
    """Calibrate an untrained model's causal thresholds on random tokens
    (``Transformer.calibrate_thresholds_``); returns the fraction each sparse block
    then routes on *other* random tokens (the target is k / T)."""
    cfg = model.cfg
    gen = torch.Generator().manual_seed(seed)
    device = model.embed.weight.device
    T = seq_len or cfg.context
    calib, check = (
        torch.randint(0, cfg.vocab_size, (batch, T), generator=gen).to(device) for _ in range(2)
    )
    model.calibrate_thresholds_(calib)
    return model(check, routing_mode="causal", return_stats=True).stats.get("capacity_used", [])


@torch.inference_mode()
def decode_benchmark(
    model: Transformer,
    batch: int = 1,
    prompt_len: int = 128,
    new_tokens: int = 128,
    *,
    repeats: int = 3,
    temperature: float = 1.0,
    seed: int = 0,
    sparse_alloc: str = "expected",
    prompts: list[list[int]] | None = None,
) -> dict[str, Any]:
    """Decode speed and KV memory of ``model`` on random prompts (or ``prompts``,
    ``batch`` lists of ``prompt_len`` token ids: real text for a trained model).

    Prefills ``batch`` random prompts of ``prompt_len`` tokens, then times
    ``new_tokens`` decode steps (each feeds one token per sequence and samples
    the next; sampling at ``temperature`` 1 keeps the token stream, and so the
    routing, like random text; greedy decoding of an untrained model repeats
    one token). One untimed warm-up run, then the median of ``repeats``.

    Returns ``tokens_per_s`` (decoded tokens per second, summed over the batch),
    ``prefill_tokens_per_s``, ``kv_bytes_allocated`` and ``kv_bytes_used`` at the
    end of decoding, ``routed_fraction`` (mean over sparse blocks of cached /
    fed tokens; None for a model without sparse blocks) and per block, and the
    number of cache growths.
    """
    cfg = model.cfg
    if prompt_len < 1 or new_tokens < 1 or batch < 1:
        raise UserError("decode benchmark: batch, prompt_len and new_tokens must be >= 1")
    max_len = prompt_len + new_tokens
    if max_len > cfg.context:
        raise UserError(
            f"decode benchmark: prompt_len {prompt_len} + new_tokens {new_tokens} exceed the"
            f" model's context {cfg.context}"
        )
    device = model.embed.weight.device
    gen = torch.Generator().manual_seed(seed)
    if prompts is None:
        prompts = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=gen).tolist()
    elif len(prompts) != batch or any(len(p) != prompt_len for p in prompts):
        raise UserError(f"decode benchmark: prompts must be {batch} lists of {prompt_len} tokens")

    def run(steps: int) -> tuple[float, float, Decoder]:
        sgen = torch.Generator(device=device).manual_seed(seed)
        dec = Decoder(model, batch, max_len, sparse_alloc=sparse_alloc)
        t0 = time.perf_counter()
        logits = dec.prefill(prompts)
        t1 = time.perf_counter()
        for _ in range(steps):
            logits = dec.step(sample_next(logits, temperature, generator=sgen))
        logits.sum().item()  # finish queued device work
        return t1 - t0, time.perf_counter() - t1, dec

    run(min(new_tokens, 8))
    times = [run(new_tokens) for _ in range(max(1, repeats))]
    prefill_s = statistics.median(t[0] for t in times)
    decode_s = statistics.median(t[1] for t in times)
    cache = times[-1][2].cache
    fed = batch * max_len
    sparse = [n / fed for n, b in zip(cache.routed_tokens(), cache.blocks, strict=True) if b.sparse]
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "tokens_per_s": batch * new_tokens / decode_s,
        "decode_s": decode_s,
        "prefill_tokens_per_s": batch * prompt_len / prefill_s,
        "kv_bytes_allocated": cache.bytes_allocated(),
        "kv_bytes_used": cache.bytes_used(),
        "kv_bytes_positions": cache.bytes_positions(),
        "kv_grows": cache.n_grows(),
        "routed_fraction": sum(sparse) / len(sparse) if sparse else None,
        "routed_fraction_per_block": sparse,
        "threads": torch.get_num_threads(),
    }


PROMPT_LEN = 128  # prompt tokens and new tokens of the decode timing
QUICK_PROMPT_LEN = 32


DECODE_BATCHES = (1, 8)
DECODE_ROUNDS = 3
ROUTED = ("xmod_s4_c0125", "xmod_s8_c0125")  # the bench family's X-MoD models


def same_active_depth(dense: ModelConfig, xmod: ModelConfig) -> ModelConfig:
    """``dense`` at the depth nearest ``xmod``'s active-equivalent depth: the dense
    model that does per token the block work X-MoD does (the fair decode partner;
    the FLOP-matched one also pays for X-MoD's training-time attention savings)."""
    return dataclasses.replace(dense, n_layers=max(1, round(active_depth(xmod))))


@torch.no_grad()
def decode(configs: dict[str, ModelConfig], quick: bool, seed: int = 0) -> dict[str, Any]:
    """Decode and prefill speed and KV bytes of X-MoD against two dense models.

    For each X-MoD model of the family (S = 4 and 8, c = 1/8; thresholds
    calibrated on random tokens, :func:`calibrate_untrained_`): the FLOP-matched
    dense model and dense of the same active-equivalent depth
    (:func:`same_active_depth`). Batches 1 and 8, a random prompt of half the
    context (at most :data:`PROMPT_LEN`), then as many new tokens. The models take
    turns for :data:`DECODE_ROUNDS` rounds, order reversed every other round;
    ratios are medians of per-round ratios (paired), X-MoD over dense.
    """
    torch.manual_seed(seed)
    dense_cfg = configs["dense"]
    models = {"dense": Transformer(dense_cfg).eval()}
    reached = {}
    for name in ROUTED:
        models[name] = Transformer(configs[name]).eval()
        reached[name] = calibrate_untrained_(models[name])
        partner = same_active_depth(dense_cfg, configs[name])
        models.setdefault(f"dense_{partner.n_layers}", Transformer(partner).eval())
    prompt = new = min(QUICK_PROMPT_LEN if quick else PROMPT_LEN, dense_cfg.context // 2)
    rounds = 1 if quick else DECODE_ROUNDS
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {
        name: {b: [] for b in DECODE_BATCHES} for name in models
    }
    for r in range(rounds):
        names = list(models) if r % 2 == 0 else list(models)[::-1]
        for batch in DECODE_BATCHES:
            for name in names:
                runs[name][batch].append(decode_benchmark(
                    models[name], batch=batch, prompt_len=prompt, new_tokens=new, repeats=1,
                    seed=seed,
                ))
    out: dict[str, Any] = {"prompt_len": prompt, "new_tokens": new, "rounds": rounds,
                           "threads": torch.get_num_threads(), "models": {}}
    for name, per_batch in runs.items():
        cfg = models[name].cfg
        row: dict[str, Any] = {"layout": cfg.block_layout, "active_depth": active_depth(cfg)}
        for batch, res in per_batch.items():
            row[f"batch{batch}"] = {
                "tokens_per_s": statistics.median(x["tokens_per_s"] for x in res),
                "prefill_tokens_per_s": statistics.median(x["prefill_tokens_per_s"] for x in res),
                "kv_bytes_used": res[-1]["kv_bytes_used"],
                "routed_fraction": res[-1]["routed_fraction"],
            }
        out["models"][name] = row
    for name in ROUTED:
        partners = {"vs_dense": "dense",
                    "vs_dense_same_active": f"dense_{same_active_depth(dense_cfg, configs[name]).n_layers}"}
        cmp: dict[str, Any] = {"calibrated_routed_fraction": reached[name]}
        for key, partner in partners.items():
            cmp[key] = {"model": partner}
            for batch in DECODE_BATCHES:
                mine, theirs = runs[name][batch], runs[partner][batch]
                cmp[key][f"batch{batch}"] = {
                    fig: statistics.median(a[fig] / b[fig] for a, b in zip(mine, theirs, strict=True))
                    for fig in ("tokens_per_s", "prefill_tokens_per_s")
                }
                cmp[key][f"batch{batch}"]["kv_bytes_used"] = (
                    mine[-1]["kv_bytes_used"] / theirs[-1]["kv_bytes_used"])
        ideal = kv_bytes_formula(configs[name], 1) / kv_bytes_formula(dense_cfg, 1)
        cmp["kv_over_ideal"] = cmp["vs_dense"]["batch1"]["kv_bytes_used"] / ideal
        out[name] = cmp
    return out


def decode_runs(
    run_dirs: list[str], rounds: int = 5, device: str = "cpu"
) -> dict[str, Any]:
    """Decode speed and KV-cache bytes of trained runs, side by side.

    Each run's newest checkpoint decodes the same real prompt, the first window
    of its test split cut at half the context, for as many new tokens (batch 1,
    sampling at temperature 1 with one seed), under causal routing as trained.
    The runs take turns, ``rounds`` times, order reversed every other round, so
    a machine's drift hits all alike; each figure is a median, and every run's
    tokens/s is also given relative to the first run's, per round (paired).
    Meant for the best X-MoD run of a study and its FLOP-matched dense run.
    """
    from xmodlm.data.batches import load_split
    from xmodlm.hardware import environment_record
    from xmodlm.runs import load_run

    if len(run_dirs) < 2:
        raise UserError("--decode-runs: give at least two run directories, comma-separated")
    models, prompts = {}, {}
    for run in run_dirs:
        cfg, model, _ = load_run(run, device=device)
        model.eval()
        half = cfg.model.context // 2
        window = load_split(cfg.data.dir, "test").tokens[:half]
        models[run], prompts[run] = model, [[int(t) for t in window]]
    figures: dict[str, list[dict[str, Any]]] = {run: [] for run in run_dirs}
    for r in range(rounds):
        for run in run_dirs if r % 2 == 0 else run_dirs[::-1]:
            half = len(prompts[run][0])
            figures[run].append(decode_benchmark(
                models[run], batch=1, prompt_len=half, new_tokens=half, repeats=1,
                prompts=prompts[run],
            ))
    first = run_dirs[0]
    env = environment_record()
    out: dict[str, Any] = {
        "command": " ".join(["xmod", "bench", "--decode-runs", ",".join(run_dirs)]),
        "machine": {k: env.get(k) for k in ("cpu", "cpu_count", "torch", "git_commit")},
        "rounds": rounds, "threads": torch.get_num_threads(), "runs": {},
    }
    for run in run_dirs:
        res = figures[run]
        out["runs"][run] = {
            "family": models[run].cfg.family,
            "layout": models[run].layout,
            "prompt_len": res[0]["prompt_len"],
            "tokens_per_s": statistics.median(x["tokens_per_s"] for x in res),
            "prefill_tokens_per_s": statistics.median(x["prefill_tokens_per_s"] for x in res),
            "kv_bytes_used": res[-1]["kv_bytes_used"],
            "routed_fraction": res[-1]["routed_fraction"],
            "tokens_per_s_vs_first": statistics.median(
                a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(res, figures[first], strict=True)
            ),
            "kv_bytes_vs_first": res[-1]["kv_bytes_used"] / max(1, figures[first][-1]["kv_bytes_used"]),
            "threshold_rule": models[run].threshold_rule() if models[run].routed_blocks() else None,
        }
    return out
