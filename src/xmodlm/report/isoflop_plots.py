"""The isoFLOP profiles drawn: loss against active parameters, one panel per budget.

The numbers come from :func:`xmodlm.report.isoflop.isoflop`; this module only
draws them. Each configuration is one colour in every panel (so it can be followed
across budgets): its mean loss per size (a filled marker where several seeds were
run, hollow for one), the parabola in ln N through those means (the same weighted
fit the minimum is read from, drawn over the sizes run only: beyond them it is an
extrapolation the table already flags) and its vertex, with the 95% bootstrap
interval of N* as a horizontal bar where seed noise was measured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from xmodlm.report.dynamics_plots import _save
from xmodlm.report.isoflop import parabola_at, parabola_coefs, profile_name


def plot_isoflop(entries: Sequence[dict[str, Any]], path: str | Path, config_label: Callable[..., str]) -> Path | None:
    """Write :func:`isoflop_figure` to ``path``; None when there is no profile."""
    fig = isoflop_figure(entries, config_label)
    return None if fig is None else _save(fig, path)


def isoflop_figure(entries: Sequence[dict[str, Any]], config_label: Callable[..., str]) -> Any | None:
    """One axis per budget (context, compute) of ``entries``; a configuration is
    named as the report's table names it (:func:`profile_name`). None when no
    budget has a profile."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import NullFormatter

    def name(config: dict[str, Any]) -> str:
        return profile_name(config, config_label)

    entries = [e for e in entries if e["minima"]]
    if not entries:
        return None
    labels = sorted({name(m["config"]) for e in entries for m in e["minima"]},
                    key=lambda s: (s != "dense", s))
    colours = {label: f"C{i}" for i, label in enumerate(labels)}
    fig = Figure(figsize=(4.2 * len(entries), 3.9))
    axes = fig.subplots(1, len(entries), squeeze=False)[0]
    for ax, entry in zip(axes, entries, strict=True):
        for m in entry["minima"]:
            _draw_profile(ax, m, colours[name(m["config"])])
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels of a log axis collide
        ax.set_xlabel("active parameters N")
        ax.set_title(f"C = {entry['tier']:.2g} FLOPs, T = {entry['context']}", fontsize=10)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("validation loss (causal routing), nats")
    handles = [Line2D([], [], color=colours[label], lw=1.2, label=label) for label in labels]
    handles += [
        Line2D([], [], ls="", marker="o", color="grey", label="mean of several seeds"),
        Line2D([], [], ls="", marker="o", mfc="none", color="grey", label="one seed"),
        Line2D([], [], ls="", marker="*", ms=10, color="grey", mec="black", mew=0.5,
               label="minimum (N* 95% interval)"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 3), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.035 * -(-len(handles) // 3) + 0.02, 1, 1))
    return fig


def _draw_profile(ax: Any, m: dict[str, Any], colour: str) -> None:
    sizes = np.asarray(m["sizes"], dtype=float)
    means = np.asarray(m["mean_loss"], dtype=float)
    seeds = np.asarray(m["seeds"], dtype=float)
    several = seeds > 1
    ax.scatter(sizes[several], means[several], color=colour, s=28, zorder=3)
    ax.scatter(sizes[~several], means[~several], facecolors="none", edgecolors=colour, s=28, zorder=3)
    coefs = parabola_coefs(np.log(sizes), means, seeds)
    grid = np.linspace(np.log(sizes[0]), np.log(sizes[-1]), 100)
    ax.plot(np.exp(grid), parabola_at(coefs, grid), color=colour, lw=1.2)
    n_star, l_star = m.get("n_star"), m.get("loss_star")
    if n_star is None or l_star is None or not sizes[0] <= n_star <= sizes[-1]:
        return
    ci = m.get("n_star_ci95") if m.get("pooled_seed_sd") is not None else None
    xerr = None if ci is None else [[max(n_star - ci[0], 0.0)], [max(ci[1] - n_star, 0.0)]]
    ax.errorbar([n_star], [l_star], xerr=xerr, fmt="*", color=colour, ms=11, capsize=3,
                zorder=4, markeredgecolor="black", markeredgewidth=0.5)
