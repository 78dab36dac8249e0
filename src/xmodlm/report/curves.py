"""Loss curves of one or more runs on one figure (``xmod plot RUN [RUN ...]``).

From each run's ``metrics.jsonl``: the training loss of every logged step (thin,
faint; optionally with a trailing mean over logged steps drawn over it) and the
validation loss of the eval records under top-k routing (solid, circles) and causal
routing (dashed, squares; the inference-time decision). A run without sparse blocks
has one validation loss (the two routings are the same), drawn once. One colour per
run.

The x axis is training tokens by default: runs of different batch sizes then line
up, and a sweep's runs end where their budgets do. ``flops`` puts them on training
compute (the run's per-token FLOPs from :func:`xmodlm.flops.count`, times tokens),
the axis on which a sparse model and its FLOP-matched dense partner are compared.
Figures use :class:`matplotlib.figure.Figure` with the Agg canvas, never pyplot.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter

from xmodlm.errors import UserError
from xmodlm.fileio import atomic_savefig
from xmodlm.train.loggers import read_metrics

X_AXES = {
    "step": "optimiser step",
    "tokens": "training tokens",
    "flops": "training compute (FLOPs: 3 x forward per token, from the run's config)",
}
"""What a loss curve can be drawn against, and the axis label of each."""


def run_curves(run_dir: str | Path) -> dict[str, Any]:
    """``train_step``/``train_tokens``/``train_loss``, ``eval_step``/``eval_tokens``/
    ``val_topk``/``val_causal`` and ``flops_per_token`` (training FLOPs per token from
    the run's config, None without one) of a run.

    A record without a token count (older records' evaluations) gets its step times
    the run's tokens per step, read from a record that has both."""
    run = Path(run_dir)
    if not run.is_dir():
        raise UserError(f"run directory {str(run)!r} not found")
    records = read_metrics(run)
    if not records:
        raise UserError(f"run {str(run)!r} has no metrics.jsonl records: nothing to plot")
    curves: dict[str, Any] = {k: [] for k in
                              ("train_step", "train_tokens", "train_loss", "eval_step",
                               "eval_tokens", "val_topk", "val_causal")}
    per_step = next((r["tokens"] / r["step"] for r in records
                     if isinstance(r.get("tokens"), (int, float)) and r.get("step")), None)

    def tokens(r: dict[str, Any]) -> float | None:
        if isinstance(r.get("tokens"), (int, float)):
            return float(r["tokens"])
        return None if per_step is None else r["step"] * per_step

    for r in records:
        if r.get("kind") == "eval" and "val_loss_topk" in r:
            curves["eval_step"].append(r["step"])
            curves["eval_tokens"].append(tokens(r))
            curves["val_topk"].append(r["val_loss_topk"])
            curves["val_causal"].append(r.get("val_loss_causal", r["val_loss_topk"]))
        elif r.get("kind", "train") == "train" and isinstance(r.get("loss"), (int, float)):
            curves["train_step"].append(r["step"])
            curves["train_tokens"].append(tokens(r))
            curves["train_loss"].append(r["loss"])
    curves["flops_per_token"] = None
    if (run / "config.yaml").is_file():
        from xmodlm import flops
        from xmodlm.config import load_config

        curves["flops_per_token"] = flops.count(load_config(run / "config.yaml").model).flops_train
    return curves


def smoothed(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing mean of ``values`` over ``window`` points (fewer at the start), so a
    smoothed point never averages losses the run had not reached yet."""
    x = np.asarray(values, dtype=float)
    if window <= 1 or len(x) == 0:
        return x
    sums = np.cumsum(np.concatenate([[0.0], x]))
    idx = np.arange(1, len(x) + 1)
    lo = np.maximum(idx - window, 0)
    return (sums[idx] - sums[lo]) / (idx - lo)


def _x_values(c: dict[str, Any], kind: str, x: str, label: str) -> list[float]:
    """The x coordinates of ``kind`` (``train`` or ``eval``) points on axis ``x``."""
    if x == "step":
        return list(c[f"{kind}_step"])
    tokens = c[f"{kind}_tokens"]
    if any(t is None for t in tokens):
        raise UserError(f"run {label!r} records no token counts: plot it with --x step")
    if x == "tokens":
        return list(tokens)
    if c["flops_per_token"] is None:
        raise UserError(f"run {label!r} has no config.yaml to count its FLOPs: plot it with"
                        " --x tokens")
    return [t * c["flops_per_token"] for t in tokens]


def _labels(run_dirs: Sequence[str | Path]) -> list[str]:
    """The runs' folder names, with their parent folder where two names collide."""
    names = [Path(r).resolve().name for r in run_dirs]
    return [
        f"{Path(r).resolve().parent.name}/{n}" if names.count(n) > 1 else n
        for r, n in zip(run_dirs, names, strict=True)
    ]


def plot_runs(
    run_dirs: Sequence[str | Path], out: str | Path, labels: Sequence[str] | None = None,
    title: str | None = None, x: str = "tokens", smooth: int = 0,
) -> Path:
    """Draw the loss curves of ``run_dirs`` into ``out`` (PNG, PDF or SVG); return its path.

    ``x``: one of :data:`X_AXES`; ``smooth``: trailing mean of the training loss over
    this many logged steps (0 or 1: none)."""
    if not run_dirs:
        raise UserError("give at least one run directory to plot")
    labels = list(labels) if labels is not None else _labels(run_dirs)
    fig = loss_figure([run_curves(r) for r in run_dirs], labels, title, x=x, smooth=smooth)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_savefig(fig, out)
    return out


def loss_figure(
    all_curves: Sequence[dict[str, Any]], labels: Sequence[str], title: str | None = None,
    x: str = "tokens", smooth: int = 0,
) -> Figure:
    """The figure of :func:`plot_runs` from :func:`run_curves` of each run."""
    if x not in X_AXES:
        raise UserError(f"x axis {x!r} is not one of {', '.join(X_AXES)}")
    if smooth < 0:
        raise UserError(f"smoothing window {smooth} must be >= 0 logged steps")
    fig = Figure(figsize=(9, 5.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colours = colormaps["tab10"].colors
    for i, (label, c) in enumerate(zip(labels, all_curves, strict=True)):
        colour = colours[i % len(colours)]
        if c["train_step"]:
            tx = _x_values(c, "train", x, label)
            if smooth > 1:
                ax.plot(tx, c["train_loss"], color=colour, lw=0.6, alpha=0.2)
                ax.plot(tx, smoothed(c["train_loss"], smooth), color=colour, lw=1.0, alpha=0.7,
                        label=f"{label}: train (mean of {smooth} logged steps)")
            else:
                ax.plot(tx, c["train_loss"], color=colour, lw=0.8, alpha=0.45,
                        label=f"{label}: train")
        if c["eval_step"]:
            ex = _x_values(c, "eval", x, label)
            same = all(abs(a - b) < 1e-9 for a, b in zip(c["val_topk"], c["val_causal"],
                                                            strict=True))
            ax.plot(ex, c["val_topk"], color=colour, lw=1.8, marker="o", ms=4,
                    label=f"{label}: validation" + ("" if same else " (top-k routing)"))
            if not same:
                ax.plot(ex, c["val_causal"], color=colour, lw=1.8, ls="--",
                        marker="s", ms=4, label=f"{label}: validation (causal routing)")
    ax.set_xlabel(X_AXES[x])
    if x != "step":  # 1.2M tokens, 3.4T FLOPs: never an offset or 1e12 on the axis
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title or "Loss curves")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=9, loc="upper right", framealpha=0.9)
    fig.tight_layout()
    return fig
