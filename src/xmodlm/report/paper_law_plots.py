"""The paper's law (Eq. 14) drawn against the runs it was fitted on.

* ``paper_k.png``: Delta = L_XMoD - L_dense_hat against K at A = 1, one colour per
  context, on the backbone that has the most A = 1 runs. Points are the runs (the
  mean over seeds, with the standard error where there are several; hollow where
  the fit left the run out as out of range), lines the fitted law at that
  context, dashed beyond the contexts it was fitted on. Dense is the zero line.
  Along a line only K moves: N_act is the backbone's, and N is the straight line
  in K through (1, N_act) and the runs' own totals, which is what the
  construction gives at A = 1 (N = N_layer (N0 + N1 (1 + K)) + embeddings, N1
  fixed by the active depth), so the curve needs no model of the backbone.
* ``paper_pred_true.png``: the law's Delta against the measured one, with the
  paper's +-0.02-nat band: in-fit runs, each held-out protocol's predictions
  (from refits without the group) and the out-of-range runs.

The numbers come from :mod:`xmodlm.law.paper` and :mod:`xmodlm.law.paper_fit`;
this module only draws them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from xmodlm.law import paper
from xmodlm.law.paper_fit import BAND, out_of_range_mask, point_of, scales
from xmodlm.report.dynamics_plots import _save

HELD_MARKERS = {"leave-context-out": "s", "leave-scale-out": "D", "leave-a-out": "^"}


def plot_paper_law(law: paper.PaperLaw, frame: pd.DataFrame, out_dir: str | Path,
                   oor: np.ndarray | None = None) -> list[Path]:
    """Write both figures for ``law`` and the runs ``frame`` it was fitted on (the
    frame :func:`xmodlm.law.reference.law_frame` gave the fit, out-of-range runs
    included); return the paths written. A figure with nothing to draw is skipped.
    ``oor``: which rows the fit did not see (default: those its out-of-range spec
    names)."""
    out = Path(out_dir)
    if oor is None:
        spec = ((law.metrics or {}).get("out_of_range") or {}).get("spec")
        oor = out_of_range_mask(frame, spec)
    paths = []
    fig = k_figure(law, frame, oor)
    if fig is not None:
        paths.append(_save(fig, out / "paper_k.png"))
    paths.append(_save(pred_true_figure(law, frame, oor), out / "paper_pred_true.png"))
    return paths


def total_line(sparsity: np.ndarray, params_total: np.ndarray, params_active: float
               ) -> tuple[float, float]:
    """(intercept, slope) of N against K at A = 1 through (1, N_act) and the runs."""
    k = np.append(sparsity, 1.0)
    n = np.append(params_total, params_active)
    slope, intercept = np.polyfit(k, n, 1)
    return float(intercept), float(slope)


def k_figure(law: paper.PaperLaw, frame: pd.DataFrame, oor: np.ndarray) -> Any | None:
    """Delta against K per context at A = 1 with the law's curves; None without two K."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, FormatStrFormatter, NullLocator

    a1 = frame["anchor_stride"].to_numpy(float) == 1
    if a1.sum() < 2:
        return None
    scale = scales(frame["params_active"].to_numpy(float))
    values, counts = np.unique(scale[a1], return_counts=True)
    backbone = a1 & (scale == values[np.argmax(counts)])
    rows = frame[backbone].assign(oor=oor[backbone])
    if rows["sparsity"].nunique() < 2:
        return None
    n_act = float(rows["params_active"].median())
    intercept, slope = total_line(rows["sparsity"].to_numpy(float),
                                  rows["params_total"].to_numpy(float), n_act)
    fitted_ctx = law.ranges.get("context") or [rows["context"].min(), rows["context"].max()]
    k_max = float(rows["sparsity"].max()) * 1.5
    ks = np.exp(np.linspace(0.0, np.log(k_max), 200))
    fig = Figure(figsize=(5.8, 4.2))
    ax = fig.subplots()
    ax.axhline(0.0, color="0.5", lw=0.8)
    for i, (ctx, group) in enumerate(rows.groupby("context", sort=True)):
        colour = f"C{i}"
        curve = paper.delta(paper.Point.of(n_act, intercept + slope * ks, ctx, ks, 1.0),
                            law.value)
        inside = fitted_ctx[0] * (1 - 1e-9) <= ctx <= fitted_ctx[1] * (1 + 1e-9)
        ax.plot(ks, curve, color=colour, lw=1.2, ls="-" if inside else "--",
                label=f"L = {int(ctx)}" + ("" if inside else " (out of range)"))
        stats = group.groupby("sparsity").agg(
            mean=("delta", "mean"), sd=("delta", "std"), n=("delta", "size"),
            oor=("oor", "all"))
        se = (stats["sd"] / np.sqrt(stats["n"])).where(stats["n"] > 1)
        k = stats.index.to_numpy(float)
        ax.errorbar(k, stats["mean"], yerr=se.fillna(0).to_numpy(), fmt="none",
                    ecolor=colour, elinewidth=0.8, capsize=2)
        hollow = stats["oor"].to_numpy(bool)
        ax.scatter(k[~hollow], stats["mean"][~hollow], color=colour, s=22, zorder=3)
        ax.scatter(k[hollow], stats["mean"][hollow], facecolors="none", edgecolors=colour,
                   s=26, zorder=3)
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator([2.0**i for i in range(int(np.log2(k_max)) + 1)]))
    ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("K (sparse layers per anchor; tokens routed 1/K)")
    ax.set_ylabel("Delta = L_X-MoD - L_dense (nats)")
    ax.set_title(f"Eq. 14 at A = 1, N_act {n_act:.3g}: runs (points) and law (lines)",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def pred_true_figure(law: paper.PaperLaw, frame: pd.DataFrame, oor: np.ndarray) -> Any:
    """The law's Delta against the measured Delta, with the +-BAND band."""
    from matplotlib.figure import Figure

    observed = frame["delta"].to_numpy(float)
    predicted = paper.delta(point_of(frame), law.value)
    fig = Figure(figsize=(5.0, 5.0))
    ax = fig.subplots()
    shown = [observed, predicted]
    rmse = np.sqrt(np.mean((predicted[~oor] - observed[~oor]) ** 2))
    ax.scatter(observed[~oor], predicted[~oor], s=14, color="tab:blue",
               label=f"in fit ({int((~oor).sum())}, RMSE {rmse:.3f})")
    for protocol, result in ((law.metrics or {}).get("heldout") or {}).items():
        points = (result or {}).get("points")
        if not points:
            continue
        obs, pred = np.asarray(points["observed"]), np.asarray(points["predicted"])
        shown += [obs, pred]
        ax.scatter(obs, pred, s=24, facecolors="none", marker=HELD_MARKERS.get(protocol, "o"),
                   edgecolors="tab:orange" if protocol != "leave-a-out" else "tab:green",
                   label=f"{protocol} ({len(obs)}, RMSE {result['rmse']:.3f})")
    if oor.any():
        far = np.sqrt(np.mean((predicted[oor] - observed[oor]) ** 2))
        ax.scatter(observed[oor], predicted[oor], s=30, marker="*", color="tab:red",
                   label=f"out of range ({int(oor.sum())}, RMSE {far:.3f})")
    lo = min(float(np.min(v)) for v in shown) - BAND
    hi = max(float(np.max(v)) for v in shown) + BAND
    diag = np.array([lo, hi])
    ax.plot(diag, diag, color="0.3", lw=0.8)
    ax.fill_between(diag, diag - BAND, diag + BAND, color="0.85", zorder=0,
                    label=f"+-{BAND:g} nats")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_aspect("equal")
    ax.set_xlabel("measured Delta (nats)")
    ax.set_ylabel("Eq. 14's Delta (nats)")
    ax.set_title("predicted against true", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig
