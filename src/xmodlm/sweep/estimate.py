"""How long a sweep's runs will take: what ``xmod sweep --dry-run`` shows and what a
running sweep's ETA weighs its runs by.

A run's wall time is a fixed cost (starting, evaluating, writing) plus its
training FLOPs over a rate: the rate the runs a sweep folder has already
finished reached, where there are some, else the machine's measured matmul peak
at an assumed utilisation.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from xmodlm.sweep.spec import RunSpec

ASSUMED_MFU = 0.3  # small models on CPU reach roughly this share of the matmul peak
# What a run costs besides its training FLOPs, where no finished run measures it:
# the process start and imports, opening the data, the initial evaluation, the
# final checkpoint and summary. A 10-step width-32 run took 7.8 s on a loaded
# 2-core machine, 2.1 s of it in the training loop; a sweep run with an
# evaluation stage (a second process) costs about twice that.
DEFAULT_FIXED_S = 8.0


class MeasuredCost(NamedTuple):
    """What finished runs measured: training FLOP/s a run reached, how many runs,
    and the seconds each spent outside its training loop (None: not measurable)."""

    rate: float
    runs: int
    fixed_s: float | None


def _outside_loop_s(run: Path, loop_s: float) -> float | None:
    """Seconds a finished run spent outside its training loop: from the job's start
    (``sweep_config.yaml``, written as the run is launched) to its last record
    (``eval.json`` where the sweep evaluated it, else ``summary.json``), less the
    loop's own ``wall_s``. None where the files' times cannot be that (copied or
    checked-out results, or a run resumed across sweeps)."""
    try:
        start = (run / "sweep_config.yaml").stat().st_mtime
        end = max((run / name).stat().st_mtime for name in ("summary.json", "eval.json")
                  if (run / name).is_file())
    except (OSError, ValueError):
        return None
    extra = end - start - loop_s
    return extra if 0 < extra < 600 else None


def measured_rate(sweep_dir: str | Path) -> MeasuredCost | None:
    """Training FLOP/s per run measured by the finished runs of a sweep folder (median
    of flops / wall_s over its ``runs/*/summary.json`` with status ok), how many
    runs it comes from, and their median time outside the loop (:func:`_outside_loop_s`);
    None where there are none. The runs' own concurrency is in the figure: it
    predicts a sweep run with as many workers on the same machine."""
    import json
    import statistics

    rates, fixed = [], []
    for path in sorted(Path(sweep_dir).glob("runs/*/summary.json")):
        try:
            s = json.loads(path.read_text())
            if s.get("status") == "ok" and s.get("wall_s", 0) > 0:
                rates.append(float(s["flops"]) / float(s["wall_s"]))
                extra = _outside_loop_s(path.parent, float(s["wall_s"]))
                if extra is not None:
                    fixed.append(extra)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if not rates:
        return None
    return MeasuredCost(statistics.median(rates), len(rates),
                        statistics.median(fixed) if fixed else None)


def estimate_seconds(
    runs: list[RunSpec], workers: int = 1, rate: float | None = None,
    fixed_s: float | None = None,
) -> list[float]:
    """Wall time per run: a fixed cost (``fixed_s``, measured by
    :func:`measured_rate`, else :data:`DEFAULT_FIXED_S`) plus its FLOPs over a rate.
    With ``rate`` (training FLOP/s a run reached in an earlier sweep at this many
    workers, :func:`measured_rate`): compute / rate. Without it, rough: compute /
    (measured matmul peak x ASSUMED_MFU), slowed by sharing the machine's cores
    between ``workers`` concurrent runs. The peak is measured in the dtype the runs
    train in here (the first run's ``train.dtype``, ``auto`` resolved on this
    machine): an fp32 study on a CPU with fast bf16 would otherwise be estimated at
    the bf16 peak, and timing bf16 on a CPU that only emulates it would take seconds
    and mislead. The fixed cost matters: a small sweep's runs spend more time
    starting and evaluating than training."""
    fixed = DEFAULT_FIXED_S if fixed_s is None else fixed_s
    if rate is None:
        import torch

        from xmodlm.hardware import matmul_peak_gflops, resolve_dtype

        asked = runs[0].cfg.train.dtype if runs else "auto"
        dtype = resolve_dtype(asked, torch.device("cpu"))
        rate = matmul_peak_gflops(dtype, "cpu") * 1e9 * ASSUMED_MFU / max(1, workers)
    return [fixed + r.compute / rate for r in runs]
