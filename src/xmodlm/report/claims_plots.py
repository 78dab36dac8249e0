"""The paper's first claim drawn: loss against K, one line per context.

The numbers come from :func:`xmodlm.report.claims.loss_by_k`; this module only draws
them. K runs on a log axis (the paper's grid doubles it), dense sits at K = 1, each
context is one colour, a point is filled where several seeds were averaged and
hollow for one, and each context's lowest K (judged on the seeds every K has) is
starred, so a U (or its absence) and the drift of its minimum with the context can
be read off one axis. Where the report has a fit of the paper's law, its curve per
context is dashed in the context's colour
(:func:`xmodlm.report.paper_law_section.loss_curves`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from xmodlm.report.dynamics_plots import _save


def plot_loss_by_k(entries: Sequence[dict[str, Any]], path: str | Path,
                   curves: Sequence[dict[str, Any]] = ()) -> Path | None:
    """Write :func:`loss_by_k_figure` to ``path``; None when there is nothing to draw."""
    fig = loss_by_k_figure(entries, curves)
    return None if fig is None else _save(fig, path)


def loss_by_k_figure(entries: Sequence[dict[str, Any]],
                     curves: Sequence[dict[str, Any]] = ()) -> Any | None:
    """One line per :func:`~xmodlm.report.claims.loss_by_k` entry with two or more K,
    and the law's curve (``curves``: context, K, loss) of each context drawn; None
    without any entry to draw."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter

    drawn = [e for e in entries if len(e["by_k"]) > 1]
    if not drawn:
        return None
    fig = Figure(figsize=(5.6, 4.0))
    ax = fig.subplots()
    several_budgets = len({e["context"] for e in drawn}) < len(drawn)
    for i, e in enumerate(drawn):
        colour = f"C{i}"
        k = np.array([p["K"] for p in e["by_k"]])
        mean = np.array([p["mean"] for p in e["by_k"]])
        several = np.array([p["n"] > 1 for p in e["by_k"]])
        label = f"L = {e['context']}" + (f", C = {e['tier']:.2g}" if several_budgets else "")
        ax.plot(k, mean, color=colour, lw=1.2, label=label)
        ax.scatter(k[several], mean[several], color=colour, s=26, zorder=3)
        ax.scatter(k[~several], mean[~several], facecolors="none", edgecolors=colour, s=26,
                   zorder=3)
        best = int(np.flatnonzero(k == e["argmin"])[0])
        ax.plot([k[best]], [mean[best]], "*", color=colour, ms=12, mec="black", mew=0.5,
                zorder=4)
        mine = [c for c in curves if c["context"] == e["context"]]
        if len(mine) == 1:  # one backbone at this context: the curve is this line's
            ax.plot(mine[0]["K"], mine[0]["loss"], color=colour, lw=1.0, ls="--")
    ticks = sorted({p["K"] for e in drawn for p in e["by_k"]})
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("token sparsity K (1: dense)")
    ax.set_ylabel("loss (causal routing), nats")
    ax.set_title("loss against K at A = 1 (star: lowest; hollow: one seed"
                 + ("; dashed: the law)" if curves else ")"), fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig
