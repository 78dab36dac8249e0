"""Plots of a fitted scaling law: the four a reader checks before trusting one.

* ``law_isoflop.png``: dense loss against N_ae for each compute tier, runs and
  the fitted law (per context), so a bad fit is visible where it matters;
* ``law_delta.png``: ln(L_x / L_d_hat) of each X-MoD run against the expansion
  ratio rho, by stride and context, with the selected form's curves;
* ``law_pred_obs.png``: predicted against observed loss, in-fit runs and
  held-out runs marked apart (a law's training fit proves little);
* ``law_bootstrap.png``: bootstrap distributions of the fitted parameters, named
  for what they are, each with the full-data fit and the 95% interval.

Figures are built with :class:`matplotlib.figure.Figure` (Agg canvas) and never
through pyplot, so nothing global changes in the caller's process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from xmodlm import depth
from xmodlm.fileio import atomic_savefig
from xmodlm.law import dense
from xmodlm.law.delta import Features
from xmodlm.law.fit import fitted_runs, paired_baseline
from xmodlm.law.lawfit import LawFit
from xmodlm.law.predict import predict_samples
from xmodlm.law.robust import interval

_MARKERS = "osD^v<>ph*"


def plot_law(fit: LawFit, df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """Write the law's PNG plots for the runs ``df`` it was fitted on; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    frame = fitted_runs(fit, df)
    figures = {}
    if fit.dense:  # a paired-baseline law may have none: it predicts no absolute loss
        figures = {"law_isoflop.png": _isoflop(fit, frame),
                   "law_pred_obs.png": _pred_obs(fit, frame)}
    if fit.delta is not None and frame["is_sparse"].any():
        figures["law_delta.png"] = _delta(fit, frame)
    figures["law_bootstrap.png"] = _bootstrap(fit)
    paths = []
    for name, fig in figures.items():
        FigureCanvasAgg(fig)
        atomic_savefig(fig, out / name, dpi=120, bbox_inches="tight")
        paths.append(out / name)
    return paths


def _isoflop(fit: LawFit, frame: pd.DataFrame) -> Figure:
    """Dense runs and the dense law along each compute tier, one panel per context.

    Along a tier, D = C / (k N) with k the tier's median FLOPs per token per
    active parameter (6 when FLOPs were not recorded), so the curve passes
    where the runs' models sit.
    """
    runs = frame[~frame["is_sparse"]]
    contexts = sorted(fit.dense)
    fig = Figure(figsize=(5 * len(contexts), 4))
    for i, t in enumerate(contexts):
        ax = fig.add_subplot(1, len(contexts), i + 1)
        at = runs[runs["context"] == t]
        tiers = sorted(at["tier"].unique())
        colors = _colors(len(tiers))
        for color, tier in zip(colors, tiers, strict=True):
            group = at[at["tier"] == tier]
            k = (group["compute"] / group["tokens"] / group["params_active"]).median()
            n = np.geomspace(
                group["params_active"].min() / 2, group["params_active"].max() * 2, 100
            )
            compute = group["compute"].median()
            law = np.exp(dense.log_loss(fit.dense[t].value, np.log(n), np.log(compute / (k * n))))
            ax.plot(n, law, color=color, lw=1)
            ax.scatter(
                group["params_active"],
                group["val_loss"],
                color=color,
                s=18,
                label=f"C ~ 1e{tier:g}",
            )
        ax.set_xscale("log")
        _plain_log_ticks(ax, _count)
        ax.set_xlabel("active parameters N_ae")
        ax.set_ylabel("validation loss (nats)")
        ax.set_title("dense runs" if t == 0 else f"dense runs, context {t}")
        ax.legend(fontsize=9, title="compute tier", title_fontsize=9)
    fig.tight_layout()
    return fig


def _delta(fit: LawFit, frame: pd.DataFrame) -> Figure:
    """Observed y = ln(L_x / L_d_hat) against rho (L_d_hat: the dense law, or the
    run's dense partner under the paired baseline), and the selected form at median N_ae."""
    law = fit.delta
    assert law is not None
    sparse = frame["is_sparse"].to_numpy()
    runs = frame[sparse]
    if fit.baseline == "paired":
        observed = np.log(runs["val_loss"].to_numpy()) - paired_baseline(frame)[sparse]
    else:
        observed = np.log(runs["val_loss"].to_numpy()) - predict_samples(fit, runs).ln_dense
    fig = Figure(figsize=(8.5, 5))
    ax = fig.add_subplot()
    strides = sorted(runs["stride"].unique())
    contexts = sorted(runs["context"].unique())
    colors = dict(zip(contexts, _colors(len(contexts)), strict=True))
    for marker, s in zip(_MARKERS, strides, strict=False):
        for t in contexts:
            at = ((runs["stride"] == s) & (runs["context"] == t)).to_numpy()
            if at.any():
                ax.scatter(
                    runs["rho"][at],
                    observed[at],
                    marker=marker,
                    color=colors[t],
                    s=20,
                    label=f"S={s}, T={t}",
                )
            c = np.linspace(runs["capacity"].min(), 1.0, 50)
            curve = pd.DataFrame(
                {
                    "stride": s,
                    "capacity": c,
                    "context": t,
                    "params_active": runs["params_active"].median(),
                }
            )
            curve["rho"] = [depth.expansion_ratio(depth.legacy_layout(s, s, ci), ci) for ci in c]
            ax.plot(
                curve["rho"],
                law.spec.predict(law.value, Features.of(curve, fit.reference)),
                color=colors[t],
                lw=0.8,
                alpha=0.7,
            )
    ax.axhline(0, color="0.5", lw=0.5)
    ax.set_xscale("log")
    _plain_log_ticks(ax, lambda v: f"{v:g}", minor=True)
    ax.set_xlabel("expansion ratio rho = L / L_active")
    ax.set_ylabel("ln(L_x / L_dense partner)" if fit.baseline == "paired"
                  else "ln(L_x / L_dense law)")
    ax.set_title(f"delta law: {law.form} (lines: the law at median N_ae)")
    ax.legend(fontsize=9, title="stride S, context T", title_fontsize=9,
              loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def _pred_obs(fit: LawFit, frame: pd.DataFrame) -> Figure:
    """Predicted against observed loss; held-out predictions come from refits without them."""
    pred = np.exp(predict_samples(fit, frame).ln_point)
    fig = Figure(figsize=(5, 5))
    ax = fig.add_subplot()
    ax.scatter(frame["val_loss"], pred, s=14, color="tab:blue", label="in fit")
    held = fit.heldout_points
    if held:
        ax.scatter(
            held["observed"],
            held["predicted"],
            s=22,
            facecolors="none",
            edgecolors="tab:red",
            label=f"held out ({held['protocol']})",
        )
    lo = min(frame["val_loss"].min(), pred.min())
    hi = max(frame["val_loss"].max(), pred.max())
    ax.plot([lo, hi], [lo, hi], color="0.4", lw=0.8)
    ax.set_xlabel("observed loss")
    ax.set_ylabel("predicted loss")
    ax.set_title("predicted vs observed")
    ax.legend(fontsize=8)
    return fig


BOOT_FENCE = 3.0
"""The bins of a bootstrap histogram span the 95% interval, widened to the quartiles
+- this many interquartile ranges (Tukey's far fences) where those reach further,
but never past the samples. A few refits that land in another optimum (a parameter
at its bound) would otherwise stretch the axis tenfold and crush the rest into one
bin; they are counted on the panel instead. The interval is always in view, so a
second mode that moves it (more than 2.5% of the refits) is drawn, not hidden."""

PARAM_LABELS = {
    "E": "irreducible loss E",
    "A": "parameter term A",
    "B": "data term B",
    "alpha": "parameter exponent alpha",
    "beta": "data exponent beta",
    "g_cap": "capacity gain g_cap",
    "g_ctx": "context correction g_ctx",
    "g_int": "stride interaction g_int",
    "kappa": "gain's scale exponent kappa",
    "r0": "gain's saturation r0",
    "g_quad": "gain's curvature g_quad",
}
"""What each fitted parameter is, for a reader of the plots who has not read
:mod:`xmodlm.law.dense` and :mod:`xmodlm.law.delta` (the symbol stays, to find
it in a fit's JSON)."""


def _bootstrap(fit: LawFit) -> Figure:
    """Histograms of the bootstrap samples of every fitted parameter (dense law per
    context, then the delta law), each with the full-data fit and the 95% interval."""
    panels = []
    for t, law in sorted(fit.dense.items()):
        for i, name in enumerate(dense.NAMES):
            samples, value, title = law.samples[:, i], law.value[i], PARAM_LABELS[name]
            if name in ("A", "B"):  # heavy right tails: read them on a log scale
                samples, value, title = np.log10(samples), np.log10(value), f"log10 {title}"
            where = "dense law" if t == 0 else f"dense law, context {t}"
            panels.append((f"{title}\n({where})", samples, value))
    if fit.delta is not None:
        d = fit.delta
        panels += [
            (f"{PARAM_LABELS.get(name, name)}\n(delta law, {d.form})", d.samples[:, i], d.value[i])
            for i, name in enumerate(d.spec.names)
            if name not in d.fixed
        ]
    cols = min(5, len(panels))
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(3.2 * cols, 2.6 * rows + 0.8), layout="constrained")
    n_boot = len(panels[0][1]) if panels else 0
    for i, (title, samples, value) in enumerate(panels):
        ax = fig.add_subplot(rows, cols, i + 1)
        _boot_panel(ax, np.asarray(samples, dtype=float), float(value))
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=7)
        if i % cols == 0:
            ax.set_ylabel("bootstrap refits", fontsize=8)
        ax.set_xlabel("parameter value", fontsize=8)
    fig.suptitle(
        f"bootstrap of the law's parameters: {n_boot} refits on resampled runs\n"
        "red line: the fit to all runs; shaded: 95% interval; bins span it, widened to the"
        f" quartiles +- {BOOT_FENCE:g} interquartile ranges; refits beyond are counted, not drawn",
        fontsize=10,
    )
    return fig


def _boot_panel(ax: Any, samples: np.ndarray, value: float) -> None:
    """One parameter: its samples binned as :data:`BOOT_FENCE` says (the fit always in
    view), the full-data fit as a line, the 95% interval shaded, and how many samples
    fell outside the bins."""
    finite = samples[np.isfinite(samples)]
    lo = hi = value
    if len(finite):
        ci = interval(finite, np.asarray(value))  # the interval the fit's JSON reports
        q1, q3 = np.percentile(finite, (25, 75))
        spread = BOOT_FENCE * (q3 - q1)
        lo = min(max(q1 - spread, finite.min()), ci[0])
        hi = max(min(q3 + spread, finite.max()), ci[1])
        ax.axvspan(*ci, color="tab:blue", alpha=0.12, lw=0)
    if not hi - lo > 1e-9 * max(abs(lo), abs(hi)):  # pinned at one value, or all but
        # (draws a rounding error apart): give its single bin some width
        pad = abs(lo) * 0.05 or 0.05
        lo, hi = lo - pad, hi + pad
    inside = (finite >= lo) & (finite <= hi)
    ax.hist(finite[inside], bins=30, range=(lo, hi), color="tab:gray")
    ax.axvline(value, color="tab:red", lw=1.2)
    ax.set_xlim(lo - 0.02 * (hi - lo), hi + 0.02 * (hi - lo))
    outside = len(samples) - int(inside.sum())
    if outside:
        ax.text(0.02, 0.97, f"{outside} outside", transform=ax.transAxes, fontsize=7,
                va="top", color="0.3")


def _count(value: float) -> str:
    """A parameter count as it is spoken: 300k, 2M, 1.5B."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:g}{suffix}"
    return f"{value:g}"


def _plain_log_ticks(ax: object, fmt: object, minor: bool = False) -> None:
    """Plain numbers on a log x axis ("2", "10M"), never "2x10^0": every decade
    labelled, and with ``minor`` (an axis spanning about a decade) also 2..9 of it."""
    formatter = FuncFormatter(lambda v, _pos: fmt(v))  # type: ignore[operator]
    xaxis = ax.xaxis  # type: ignore[attr-defined]
    xaxis.set_major_locator(LogLocator(base=10))
    xaxis.set_major_formatter(formatter)
    if minor:
        xaxis.set_minor_locator(LogLocator(base=10, subs=(1.5, 2, 3, 4, 5, 6, 8)))
        xaxis.set_minor_formatter(formatter)
    else:
        xaxis.set_minor_formatter(NullFormatter())


def _colors(n: int) -> list[tuple[float, float, float, float]]:
    """``n`` colours evenly spaced along viridis (tiers and contexts are ordered)."""
    return [colormaps["viridis"](x) for x in np.linspace(0, 0.9, n)]
