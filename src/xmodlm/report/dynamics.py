"""Training dynamics of a sweep's runs, from their records: what a mechanism
ablation (gate, balancing, anchors) changes besides the final loss.

The final loss says which configuration is better; it does not say whether a
gate trains stably or keeps the residual stream in check. Per run, from its
``metrics.jsonl`` (read with :func:`xmodlm.train.loggers.read_metrics`) and its
``config.yaml``:

* **loss spikes**: logged training steps after warmup whose loss exceeds the
  median of the ``SPIKE_WINDOW`` logged losses before it by more than
  ``SPIKE_THRESHOLD`` nats (a non-finite loss always counts);
* **loss spikes against the dense run**: the same rule on the difference between
  a routed run's logged loss and its FLOP-matched dense run's at the same step
  (:func:`count_paired_spikes`), a far finer test, since the two saw the same
  batches;
* **gradient-norm peaks**: the largest and the 99th-percentile gradient norm
  (before clipping, as the trainer logs it) of the logged steps after warmup;
* **residual RMS per block**, at the end (the last evaluation's ``residual_rms``)
  and at initialisation: the trainer's evaluation at step 0 where the run has one
  (:func:`init_eval`), else, for runs trained before it logged one, measured on
  the model rebuilt from the run's config under the trainer's seeding
  (:func:`init_residual_rms`, with the code checked out now);
* **routing at the end**: coverage, per-token sparse-depth histogram and the
  Jaccard overlap of consecutive sparse blocks, from the last evaluation
  (routed runs only);
* **step time**: the median seconds per logged optimiser step
  (:func:`median_step_time`).

Only logged steps are seen (every ``train.log_every``-th step, and every
non-finite one), so counts and peaks are of those. The summarising functions
are pure, on lists of records, so they are tested on hand-written metrics; the
grouping into configurations is the report's (:mod:`xmodlm.report.sweep_report`)
and :mod:`xmodlm.report.dynamics_plots` draws the figures.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from xmodlm.errors import UserError
from xmodlm.train.loggers import read_metrics

if TYPE_CHECKING:
    import torch

    from xmodlm.config import Config

SPIKE_THRESHOLD = 0.5
"""Nats above the recent median for a logged loss to count as a spike.

A logged loss is one batch (about 2k tokens in the CPU sweeps), so it wanders
with the batch: on the stable runs of ``results/lr-depth`` the largest excess
over the running median after warmup is 0.31 nats, and it comes from particular
batches (the same step in every run of one seed, whatever the model or learning
rate, since a batch is a function of seed and step). 0.5 nats keeps such hard
batches out, so that a counted spike is the optimisation misbehaving, not the
data; at 0.3 nats a hard batch would already count. The median of a falling
curve lags it (there by 0.24-0.48 nats), so a counted spike stands about
0.75-1 nat above the loss around it: the rule finds divergence-like jumps,
not small bumps.
"""

PAIRED_SPIKE_THRESHOLD = 0.2
"""Nats by which a routed run's loss minus its dense run's (same seed, so the same
batches at the same step) must exceed its recent median to count as a spike.

The batch cancels in the difference: on ``results/lr-depth`` its step-to-step
standard deviation is 0.02-0.035 nats against 0.14-0.15 for the loss itself, and
its largest excess over the running median in any run is 0.03-0.10 nats (the
most at the highest learning rate). 0.2 nats is twice that: no stable run
counts one, and a jump of a quarter of what :data:`SPIKE_THRESHOLD` needs does.
"""

SPIKE_WINDOW = 50
"""Logged losses before a step whose median is its reference: at ``log_every = 10``
the last 500 steps, long enough that one hard batch does not move the median,
short enough to follow the falling curve."""

INIT_BATCH = 4
"""Sequences the residual RMS at initialisation is measured on: a forward pass of
a few sequences is enough for a per-block mean over hundreds of tokens, and keeps
the report cheap (one small model per distinct configuration and seed)."""

INIT_RECORDED = "the trainer's evaluation at step 0, on validation data"
"""Where a run's residual RMS at initialisation came from when its record has it."""

INIT_TOKEN_SEED = 0
"""Generator seed of the random tokens used when the run's data directory is absent."""


def train_rows(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The training-step records (those with a loss and no ``kind``), in order."""
    return [r for r in records if "loss" in r and r.get("kind", "train") == "train"]


def last_eval(records: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The last evaluation record, or None when the run logged none."""
    evals = [r for r in records if r.get("kind") == "eval"]
    return evals[-1] if evals else None


def init_eval(records: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The evaluation the trainer logs at step 0, before any update (runs trained
    before it did so have none), or None."""
    return next((r for r in records if r.get("kind") == "eval" and r.get("step") == 0), None)


def _after_warmup(rows: Sequence[dict[str, Any]], warmup: int) -> list[int]:
    return [i for i, r in enumerate(rows) if int(r.get("step", 0)) > warmup]


def _jumps(
    series: Sequence[tuple[int, float]], warmup: int, threshold: float, window: int
) -> int:
    """Points after ``warmup`` (by step) whose value exceeds the median of the (up to)
    ``window`` finite values before it by more than ``threshold``; a non-finite
    value always counts."""
    count = 0
    for i, (step, value) in enumerate(series):
        if step <= warmup:
            continue
        if not math.isfinite(value):
            count += 1
            continue
        before = [x for _, x in series[:i] if math.isfinite(x)][-window:]
        if before and value - float(np.median(before)) > threshold:
            count += 1
    return count


def count_spikes(
    rows: Sequence[dict[str, Any]], warmup: int, threshold: float = SPIKE_THRESHOLD,
    window: int = SPIKE_WINDOW,
) -> int:
    """Logged steps after ``warmup`` whose loss exceeds the median of the (up to)
    ``window`` finite logged losses before it by more than ``threshold``.

    Warmup rows serve as history but are never counted: during warmup the loss
    falls fast and the learning rate is still rising, so a jump there says
    nothing about the configuration. A non-finite loss is always a spike (the
    trainer skips that step; the run survived it, but it is the same failure).
    """
    return _jumps([(int(r.get("step", 0)), float(r["loss"])) for r in rows],
                  warmup, threshold, window)


def count_paired_spikes(
    rows: Sequence[dict[str, Any]], dense_rows: Sequence[dict[str, Any]], warmup: int,
    threshold: float = PAIRED_SPIKE_THRESHOLD, window: int = SPIKE_WINDOW,
) -> int | None:
    """:func:`count_spikes` on the loss minus the dense run's loss at the same logged
    step (steps both logged; the dense run of the same seed saw the same batches, so
    the batch's difficulty cancels). None when the two share no logged step."""
    dense = {int(r["step"]): float(r["loss"]) for r in dense_rows if "step" in r}
    diff = [(int(r["step"]), float(r["loss"]) - dense[int(r["step"])])
            for r in rows if int(r.get("step", -1)) in dense]
    if not diff:
        return None
    return _jumps(diff, warmup, threshold, window)


def grad_norm_peaks(rows: Sequence[dict[str, Any]], warmup: int) -> tuple[float | None, float | None]:
    """(max, 99th percentile) of the finite logged gradient norms after ``warmup``;
    (None, None) without any. Non-finite norms are left to :func:`count_spikes`
    (their step's loss is non-finite too), so one of them does not turn both
    figures into inf."""
    norms = [float(rows[i]["grad_norm"]) for i in _after_warmup(rows, warmup)
             if "grad_norm" in rows[i]]
    norms = [g for g in norms if math.isfinite(g)]
    if not norms:
        return None, None
    return max(norms), float(np.percentile(norms, 99))


def median_step_time(rows: Sequence[dict[str, Any]]) -> float | None:
    """Median seconds per optimiser step over the logged training steps (``step_s``),
    None without any. The median, because the first logged steps carry start-up
    costs and a machine shared with other runs slows some steps and not others."""
    times = [float(r["step_s"]) for r in rows if "step_s" in r]
    times = [t for t in times if math.isfinite(t) and t > 0]
    return float(np.median(times)) if times else None


def sparse_depth_sd(depth_hist: Sequence[float]) -> float:
    """Standard deviation of the number of sparse blocks a token passes through,
    from the histogram (bin i: the fraction of tokens processed by i sparse blocks).

    The mean is fixed by the capacity (c times the number of sparse blocks, since
    each takes its share of every sequence), so the spread is the one-number
    summary that says something: 0 when every token gets the same sparse depth,
    larger when the routers give a few tokens much of the depth.
    """
    h = np.asarray(depth_hist, dtype=float)
    if h.sum() <= 0:
        return 0.0
    i = np.arange(len(h))
    mean = float((i * h).sum() / h.sum())
    return math.sqrt(float(((i - mean) ** 2 * h).sum() / h.sum()))


def init_tokens(cfg: Config, n: int = INIT_BATCH) -> tuple[torch.Tensor, str]:
    """A fixed batch of ``n`` sequences to measure the model at initialisation on,
    and where it came from.

    The run's own validation data where its data directory exists: the first
    ``n`` windows of the first of the fixed validation batches the trainer
    evaluated on, so init and end are measured on the same kind of text. Else
    random tokens from a generator seeded with ``INIT_TOKEN_SEED`` (the source
    says so, since random tokens give a different RMS than text).
    """
    import torch

    from xmodlm.data.batches import load_split, val_batches

    context = cfg.model.context
    data_dir = Path(cfg.data.dir)
    if data_dir.is_dir():
        try:
            val = load_split(data_dir, "val")
            x_BT, _ = val_batches(val, cfg.data.val_batches, cfg.train.batch_size, context)[0]
            return x_BT[:n], f"validation data ({cfg.data.dir})"
        except UserError as exc:
            why = str(exc)
    else:
        why = f"data directory {cfg.data.dir} not found"
    gen = torch.Generator().manual_seed(INIT_TOKEN_SEED)
    x_BT = torch.randint(0, cfg.model.vocab_size, (n, context), generator=gen)
    return x_BT, f"random tokens ({why})"


def init_residual_rms(cfg: Config, tokens_BT: torch.Tensor) -> list[float]:
    """Per-block residual RMS of the run's model at initialisation on ``tokens_BT``.

    The model is built as the trainer builds it: ``torch.manual_seed(train.seed)``
    then ``Transformer(cfg.model)`` on the CPU (its init, gate calibration
    included, draws from nothing else; moving it to a device does not change
    the values), so it is the run's own initial model under the code now
    checked out. The global RNG is left as it was.
    """
    import torch

    from xmodlm.diagnostics import residual_rms
    from xmodlm.model import Transformer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.train.seed)
        model = Transformer(cfg.model).eval()
    return residual_rms(model, tokens_BT)


def run_dynamics(
    run_dir: str | Path, warmup: int | None = None, cache: dict[Any, Any] | None = None,
) -> dict[str, Any] | None:
    """The dynamics of one run directory; None when it has no ``metrics.jsonl``
    records.

    ``warmup`` defaults to the run config's ``train.warmup_steps`` (0 without a
    config). The residual RMS at init needs a readable ``config.yaml`` (else None);
    ``cache`` (keyed by model config, seed and data) spares rebuilding the same
    initial model for runs that differ only in training settings, such as the
    learning rate.
    """
    from xmodlm.config import load_config

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    if not records:
        return None
    cfg = None
    if (run_dir / "config.yaml").is_file():
        try:
            cfg = load_config(run_dir / "config.yaml")
        except UserError:
            cfg = None
    if warmup is None:
        warmup = cfg.train.warmup_steps if cfg is not None else 0
    rows = train_rows(records)
    gmax, g99 = grad_norm_peaks(rows, warmup)
    end = last_eval(records) or {}
    out: dict[str, Any] = {
        "warmup": int(warmup),
        "spikes": count_spikes(rows, warmup),
        "grad_norm_max": gmax,
        "grad_norm_p99": g99,
        "residual_rms_init": None,
        "residual_rms_end": end.get("residual_rms"),
        "init_tokens": None,
        "step_s": median_step_time(rows),
    }
    for key in ("coverage", "depth_hist", "jaccard"):
        out[key] = end.get(key)
    hist = out["depth_hist"]
    out["sparse_depth_sd"] = sparse_depth_sd(hist) if hist else None
    start = init_eval(records)
    if start is not None and start.get("residual_rms"):
        out["residual_rms_init"] = start["residual_rms"]
        out["init_tokens"] = INIT_RECORDED
    elif cfg is not None:
        key = (repr(dataclasses.astuple(cfg.model)), cfg.train.seed, cfg.data.dir,
               cfg.data.val_batches, cfg.train.batch_size)
        if cache is None or key not in cache:
            tokens, source = init_tokens(cfg)
            value = (init_residual_rms(cfg, tokens), source)
            if cache is not None:
                cache[key] = value
        else:
            value = cache[key]
        out["residual_rms_init"] = value[0]
        out["init_tokens"] = f"the model rebuilt from the run's config and seed, on {value[1]}"
    return out


def with_paired_spikes(
    found: list[tuple[Any, dict[str, Any]]], partner: dict[str, str], runs_root: Path
) -> list[tuple[Any, dict[str, Any]]]:
    """Add ``paired_spikes`` (:func:`count_paired_spikes`) to the dynamics of each
    routed run whose dense partner (``partner``: run id -> dense run id) has a
    record under ``runs_root``; other runs get None."""
    rows: dict[str, list[dict[str, Any]]] = {}

    def train_of(run_id: str) -> list[dict[str, Any]]:
        if run_id not in rows:
            rows[run_id] = train_rows(read_metrics(runs_root / run_id))
        return rows[run_id]

    out = []
    for key, dyn in found:
        dense_id = partner.get(dyn["run_id"])
        paired = None
        if dense_id is not None and (runs_root / dense_id).is_dir():
            paired = count_paired_spikes(train_of(dyn["run_id"]), train_of(dense_id),
                                         dyn["warmup"])
        out.append((key, {**dyn, "paired_spikes": paired}))
    return out


def mean_se(values: Sequence[Any]) -> dict[str, Any] | None:
    """Mean and standard error over seeds of a number or of equal-length lists
    (element by element), ignoring runs without the value.

    ``se`` is None with one value (no error bar from one seed), as in the
    report's paired differences; None overall when no run has the value, or
    when lists differ in length (runs of different depth cannot be averaged).
    """
    present = [v for v in values if v is not None]
    if not present:
        return None
    if isinstance(present[0], list) and len({len(v) for v in present}) > 1:
        return None
    x = np.asarray(present, dtype=float)
    n = len(x)
    mean = x.mean(axis=0)
    se = x.std(axis=0, ddof=1) / math.sqrt(n) if n > 1 else None
    return {"n": n, "mean": mean.tolist(),
            "se": se.tolist() if se is not None else None}


SUMMARISED = ("spikes", "paired_spikes", "grad_norm_max", "grad_norm_p99", "residual_rms_init",
              "residual_rms_end", "coverage", "depth_hist", "sparse_depth_sd", "jaccard")


def summarise(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean +- standard error over the runs (the seeds of one configuration) of
    every figure of :func:`run_dynamics`; also the mean coverage and Jaccard over
    windows / block pairs, the one-number versions a table can show."""
    out: dict[str, Any] = {key: mean_se([r.get(key) for r in runs]) for key in SUMMARISED}
    for key in ("coverage", "jaccard"):
        out[f"{key}_mean"] = mean_se([float(np.mean(r[key])) if r.get(key) else None
                                      for r in runs])
    out["init_tokens"] = sorted({r["init_tokens"] for r in runs if r.get("init_tokens")})
    return out
