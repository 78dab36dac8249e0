"""Loss curves of one or more runs on one figure (``xmod plot RUN [RUN ...]``).

From each run's ``metrics.jsonl``: the training loss of every logged step (thin,
faint) and the validation loss of the eval records under top-k routing (solid,
circles) and causal routing (dashed, squares; the inference-time decision). A run
without sparse blocks has one validation loss (the two routings are the same), drawn
once. One colour per run. Figures use :class:`matplotlib.figure.Figure` with the Agg
canvas, never pyplot.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from xmodlm.errors import UserError
from xmodlm.fileio import atomic_savefig
from xmodlm.train.loggers import read_metrics


def run_curves(run_dir: str | Path) -> dict[str, list[Any]]:
    """``train_step``/``train_loss`` and ``eval_step``/``val_topk``/``val_causal`` of a run."""
    run = Path(run_dir)
    if not run.is_dir():
        raise UserError(f"run directory {str(run)!r} not found")
    records = read_metrics(run)
    if not records:
        raise UserError(f"run {str(run)!r} has no metrics.jsonl records: nothing to plot")
    curves: dict[str, list[Any]] = {k: [] for k in
                                     ("train_step", "train_loss", "eval_step", "val_topk",
                                      "val_causal")}
    for r in records:
        if r.get("kind") == "eval" and "val_loss_topk" in r:
            curves["eval_step"].append(r["step"])
            curves["val_topk"].append(r["val_loss_topk"])
            curves["val_causal"].append(r.get("val_loss_causal", r["val_loss_topk"]))
        elif r.get("kind", "train") == "train" and isinstance(r.get("loss"), (int, float)):
            curves["train_step"].append(r["step"])
            curves["train_loss"].append(r["loss"])
    return curves


def _labels(run_dirs: Sequence[str | Path]) -> list[str]:
    """The runs' folder names, with their parent folder where two names collide."""
    names = [Path(r).resolve().name for r in run_dirs]
    return [
        f"{Path(r).resolve().parent.name}/{n}" if names.count(n) > 1 else n
        for r, n in zip(run_dirs, names, strict=True)
    ]


def plot_runs(
    run_dirs: Sequence[str | Path], out: str | Path, labels: Sequence[str] | None = None,
    title: str | None = None,
) -> Path:
    """Draw the loss curves of ``run_dirs`` into ``out`` (PNG, PDF or SVG); return its path."""
    if not run_dirs:
        raise UserError("give at least one run directory to plot")
    labels = list(labels) if labels is not None else _labels(run_dirs)
    fig = loss_figure([run_curves(r) for r in run_dirs], labels, title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_savefig(fig, out)
    return out


def loss_figure(
    all_curves: Sequence[dict[str, list[Any]]], labels: Sequence[str], title: str | None = None
) -> Figure:
    """The figure of :func:`plot_runs` from :func:`run_curves` of each run."""
    fig = Figure(figsize=(9, 5.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colours = colormaps["tab10"].colors
    for i, (label, c) in enumerate(zip(labels, all_curves, strict=True)):
        colour = colours[i % len(colours)]
        if c["train_step"]:
            ax.plot(c["train_step"], c["train_loss"], color=colour, lw=0.8, alpha=0.45,
                    label=f"{label}: train")
        if c["eval_step"]:
            same = all(abs(a - b) < 1e-9 for a, b in zip(c["val_topk"], c["val_causal"],
                                                            strict=True))
            ax.plot(c["eval_step"], c["val_topk"], color=colour, lw=1.8, marker="o", ms=4,
                    label=f"{label}: validation" + ("" if same else " (top-k routing)"))
            if not same:
                ax.plot(c["eval_step"], c["val_causal"], color=colour, lw=1.8, ls="--",
                        marker="s", ms=4, label=f"{label}: validation (causal routing)")
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title or "Loss curves")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=9, loc="upper right", framealpha=0.9)
    fig.tight_layout()
    return fig
