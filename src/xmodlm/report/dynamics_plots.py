"""Figures of a sweep's training dynamics: residual RMS per block and sparse depth per token.

The numbers come from :mod:`xmodlm.report.dynamics` (per-configuration means
and standard errors over seeds); this module only draws them. A sweep holds
several budgets and contexts, and the same mechanism settings recur in each, so
one axis of every group would repeat legend labels and hide the comparison a
reader wants (configurations *at one budget*). Groups therefore carry a
``panel`` (the budget and context they were trained at) and get one axis per
panel, and a ``label`` unique within it; a configuration keeps its colour in
every panel, so it can be followed across budgets.

Figures are built on the Agg canvas, never through pyplot: no global figure
state in the caller's process and no display needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from xmodlm.fileio import atomic_savefig

DEPTH_SHARE_SHOWN = 2e-3
"""Sparse depths beyond the last one holding this share of tokens in any group are
not drawn: a stack of 28 blocks puts almost every token below depth 8, and the
empty tail would squeeze the part that differs into the left edge."""


def plot_residual_rms(groups: Sequence[dict[str, Any]], path: str | Path) -> Path | None:
    """Write :func:`residual_rms_figure` to ``path``; None when it has nothing to draw."""
    fig = residual_rms_figure(groups)
    return None if fig is None else _save(fig, path)


def plot_depth_hist(groups: Sequence[dict[str, Any]], path: str | Path) -> Path | None:
    """Write :func:`depth_hist_figure` to ``path``; None when it has nothing to draw."""
    fig = depth_hist_figure(groups)
    return None if fig is None else _save(fig, path)


def residual_rms_figure(groups: Sequence[dict[str, Any]]) -> Any | None:
    """Residual RMS per block, at init (dashed) and at the end (solid), one colour
    per configuration (mean over its seeds); None when no group has either.

    ``groups``: dicts with ``label``, optional ``panel`` and the summaries
    ``residual_rms_init`` / ``residual_rms_end`` of
    :func:`xmodlm.report.dynamics.summarise`. The y axis is logarithmic: the
    stream grows by an order of magnitude in training, and a gate's effect is a
    ratio.
    """
    from matplotlib.lines import Line2D

    drawn = [g for g in groups if g.get("residual_rms_init") or g.get("residual_rms_end")]
    if not drawn:
        return None
    fig, panels = _panel_figure(drawn)
    for ax, members, colours in panels:
        for g in members:
            for key, style in (("residual_rms_init", "--"), ("residual_rms_end", "-")):
                if g.get(key):
                    y = g[key]["mean"]
                    first = key == "residual_rms_end" or not g.get("residual_rms_end")
                    ax.plot(range(len(y)), y, style, color=colours[g["label"]], marker=".",
                            label=g["label"] if first else None)
        ax.set_yscale("log")
        ax.set(xlabel="block index (0 = first block)", ylabel="residual RMS (mean over seeds)")
        handles, labels = ax.get_legend_handles_labels()
        handles += [Line2D([], [], color="grey", ls="--"), Line2D([], [], color="grey", ls="-")]
        labels += ["at init", "at the end"]
        _legend(ax, handles, labels)
    fig.suptitle("residual stream after each block: at init (dashed), end of training (solid)")
    return fig


def depth_hist_figure(groups: Sequence[dict[str, Any]]) -> Any | None:
    """Share of tokens by the number of sparse blocks that processed them (last
    evaluation, top-k routing), one line per configuration with error bars of one
    standard error over seeds (none for a single seed); None when no group has a
    histogram.

    The mean depth is fixed by the capacity (c times the number of sparse blocks),
    so what differs between mechanisms is the spread: balancing should narrow it,
    and a router that sends the same tokens everywhere widens it toward 0 and n.
    """
    drawn = [g for g in groups if g.get("depth_hist")]
    if not drawn:
        return None
    fig, panels = _panel_figure(drawn)
    for ax, members, colours in panels:
        shown = 1 + max(
            int(np.flatnonzero(np.asarray(g["depth_hist"]["mean"]) >= DEPTH_SHARE_SHOWN).max(
                initial=0)) for g in members)
        for g in members:
            y = np.asarray(g["depth_hist"]["mean"])[:shown + 1]
            se = g["depth_hist"]["se"]
            ax.errorbar(np.arange(len(y)), y,
                        yerr=None if se is None else np.asarray(se)[:shown + 1],
                        marker=".", capsize=2, color=colours[g["label"]], label=g["label"])
        ax.set(xlabel="sparse blocks that processed the token", ylabel="share of tokens")
        _legend(ax, *ax.get_legend_handles_labels())
    fig.suptitle("sparse depth per token at the last evaluation"
                 " (mean over seeds, error bars +- 1 SE)")
    return fig


def _panel_figure(groups: Sequence[dict[str, Any]]) -> tuple[Any, list[tuple[Any, list, dict]]]:
    """One axis per distinct ``panel`` of ``groups`` (in order of appearance), stacked,
    titled by the panel; each with its groups and a colour per label shared by all
    panels."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    order: dict[Any, list[dict[str, Any]]] = {}
    for g in groups:
        order.setdefault(g.get("panel"), []).append(g)
    labels = list(dict.fromkeys(g["label"] for g in groups))
    cmap = colormaps["tab20" if len(labels) > 10 else "tab10"]
    colours = {label: cmap(i % cmap.N) for i, label in enumerate(labels)}
    fig = Figure(figsize=(11, 0.6 + 4.2 * len(order)), layout="constrained")
    out = []
    for i, (panel, members) in enumerate(order.items()):
        ax = fig.add_subplot(len(order), 1, i + 1)
        if panel:
            ax.set_title(panel, fontsize=10)
        out.append((ax, members, colours))
    return fig, out


def _legend(ax: Any, handles: list[Any], labels: list[str]) -> None:
    ax.legend(handles, labels, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))


def _save(fig: Any, path: str | Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    atomic_savefig(fig, path, dpi=120, bbox_inches="tight")
    return path
