"""What the bench's figures should reach, in one table, and how each is judged.

Every target names a size, a figure inside that size's section of the result
(a dotted path; a summary dict is read at its median) and a bound. Targets are
judged at the bench's main thread count (the process's default, which is what
``xmod train`` uses, when it was measured; else the most threads measured);
the same figure at the other thread counts measured is reported beside it. A
target whose size was not run reads ``value`` None and ``pass`` None, and so do
all of them in quick mode, whose models are too small for the bounds to apply.

All ratios are paired time ratios (this model's step time over the other's,
median over rounds), each model in its faster mode (eager or compiled): below
1 means this model is faster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Target:
    name: str
    size: str | None  # None: a figure of the whole run, not of one size
    figure: str
    kind: str  # "max": the value must be at most the bound; "min": at least
    bound: float
    why: str


TARGETS: tuple[Target, ...] = (
    *(Target(f"xmod_s{stride}_vs_dense@w{width}-t512", None,
             f"width_scan.widths.w{width}.xmod_s{stride}_c0125.best.time_ratio", "max", 1.05,
             f"X-MoD (S={stride}, c=1/8) steps within 5% of FLOP-matched dense at width"
             f" {width}, one thread, where the per-block costs have faded")
      for width in (512, 1024) for stride in (4, 8)),
    *(Target(f"xmod_s{stride}_decode_vs_same_active_dense@{size}", size,
             f"decode.xmod_s{stride}_c0125.vs_dense_same_active.batch1.tokens_per_s", "min", 0.9,
             f"X-MoD (S={stride}) decodes at batch 1 at >= 0.9x dense of its active depth")
      for size in ("w128-t128", "w128-t512", "bench") for stride in (4, 8)),
    Target("dense_vs_gpt2@w256-t256", "w256-t256", "dense_vs_gpt2.best.time_ratio",
           "max", 1.00, "our dense architecture steps no slower than GPT-2's at width 256"),
    Target("dense_vs_gpt2@bench", "bench", "dense_vs_gpt2.best.time_ratio",
           "max", 1.00, "the same at width 512"),
    Target("dense_vs_gpt2_eager@w256-t256", "w256-t256", "dense_vs_gpt2.eager.time_ratio",
           "max", 1.00, "the same in eager mode, at width 256"),
    Target("dense_vs_gpt2_eager@bench", "bench", "dense_vs_gpt2.eager.time_ratio",
           "max", 1.00, "the same in eager mode, at width 512"),
    Target("dense_vs_reference@bench", "bench", "dense_vs_reference.best.time_ratio",
           "max", 1.00, "our dense model is no slower than the same shape written plainly"),
    Target("xmod_same_params_efficiency@bench", "bench", "xmod_vs_dense_same_params.efficiency",
           "min", 0.85,
           "X-MoD's speed-up over dense of equal parameters reaches 85% of its FLOP ratio"),
    Target("dense_mfu@bench", "bench", "train_step.dense.best.mfu",
           "min", 0.40, "dense MFU against the measured matmul peak"),
    Target("xmod_a1k8_time_per_flop@cpu-d64-l2048", None,
           "paper_pair.xmod_vs_dense.time_per_flop_ratio", "max", 1.25,
           "the paper's shape (A1K8, token-choice bias, width 64, L = 2048): a FLOP of X-MoD"
           " costs at most 1.25x the time of one of dense of the same active depth"),
    Target("law_fit_s", None, "law_fit_s.seconds",
           "max", 60.0, "the law fit with 1000 bootstrap replicates takes under a minute"),
)


def lookup(node: Any, path: str) -> float | None:
    """The number at dotted ``path`` in ``node`` (a summary dict's median), else None."""
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    if isinstance(node, dict):
        node = node.get("median")
    return node if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def _judge(target: Target, value: float | None) -> bool | None:
    if value is None:
        return None
    return value <= target.bound if target.kind == "max" else value >= target.bound


def main_threads(measured: list[int], default: int) -> int:
    """The thread count targets are judged at: the default if measured, else the most."""
    return default if default in measured else max(measured)


def evaluate(result: dict[str, Any], threads: int) -> dict[str, Any]:
    """Every target with its value at ``threads`` threads, bound and pass/miss."""
    quick = bool(result.get("quick"))
    out: dict[str, Any] = {}
    for t in TARGETS:
        if t.size is None:
            value, others = lookup(result, t.figure), {}
        else:
            per_threads = result.get("sizes", {}).get(t.size, {}).get("threads", {})
            value = lookup(per_threads.get(str(threads), {}), t.figure)
            others = {
                n: {"value": v, "pass": None if quick else _judge(t, v)}
                for n, section in per_threads.items()
                if n != str(threads) and (v := lookup(section, t.figure)) is not None
            }
        row: dict[str, Any] = {
            "size": t.size, "figure": t.figure, "value": value, t.kind: t.bound,
            "pass": None if quick else _judge(t, value), "why": t.why,
        }
        if t.size is not None:
            row["threads"] = threads
            if value is None:
                row["note"] = f"size {t.size} not run at {threads} threads"
        if others:
            row["other_threads"] = others
        out[t.name] = row
    if quick:
        out["note"] = "quick mode: tiny models, where fixed overheads dominate; no pass/miss"
    return out


def sweep_worker_throughput(result: dict[str, Any]) -> dict[str, Any]:
    """Training tokens per second one sweep worker gets, from the dense w128-t128 step.

    ``xmod sweep --executor local`` gives each of its workers ``cores // workers``
    threads (2 workers on 2 cores: one thread each), and the trainer's
    ``train.compile=auto`` runs eager on a CPU. So the eager dense step at
    w128-t128 and one thread is what one such worker gets, at the bench's dtype;
    a spec or ``--run-set`` with ``train.compile=on`` gets the whole-model
    compiled step (``compiled_model``), given beside it where it was timed.
    """
    section = result.get("sizes", {}).get("w128-t128", {}).get("threads", {}).get("1")
    if section is None:
        return {"unavailable": "needs size w128-t128 at 1 thread (--sizes w128-t128 --threads 1)"}
    steps = section["train_step"]["dense"]
    out: dict[str, Any] = {
        "tokens_per_s": steps["eager"]["tokens_per_s"],
        "ms_per_step": steps["eager"]["ms"],
        "what": "one sweep worker (local executor, one thread per worker on a CPU with as many"
        " cores as workers): dense width 128, 4 blocks, context 128, 16 sequences a step,"
        f" eager, {result.get('dtype')}. Upper bound: workers running side by side share"
        " caches and memory bandwidth. Specs that pin train.dtype=fp32 (lr-depth,"
        " deep-ablation) run fp32, which is slower where the CPU has native bf16.",
    }
    if "compiled_model" in steps:
        out["compiled_model"] = {"tokens_per_s": steps["compiled_model"]["tokens_per_s"],
                                 "ms_per_step": steps["compiled_model"]["ms"],
                                 "what": "the same worker under train.compile=on"}
    return out
