"""The report's section on a fit of the paper's law (``xmod report --law FIT`` with a
fit written by ``xmod law fit --form paper``).

What a reader of a study needs from the law, in the paper's terms:

* its parameters, each with the 95% interval of the fit's bootstrap draws;
* how well it explains the runs it was fitted on, and each grouped held-out test
  (leave one context, scale or A out) beside the constant-Delta baseline, the bar a
  law must clear to be worth using;
* its predictions for the runs of the table it has **not** seen. These are runs
  trained after the fit, so a prediction committed before its runs (a study's
  out-of-range context) is scored here against the outcome. Each gets its predicted
  Delta, the bootstrap interval, and whether the measured Delta fell inside the
  interval and inside the paper's +-0.02-nat band.

The unseen runs' Deltas are measured as the fit measured its own: the same loss,
variant and learning rate, read from the fit's record, and the same kind of dense
reference (:func:`xmodlm.law.reference.law_frame`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from xmodlm.law import paper
from xmodlm.law.paper_fit import BAND, point_of, scales, scores
from xmodlm.law.paper_predict import INTERVAL, with_interval


def paper_law_section(law: paper.PaperLaw, path: str | Path, df: pd.DataFrame,
                      sweep_dir: str | Path | None, out_dir: str | Path) -> dict[str, Any]:
    """The section's numbers (JSON-ready) and its two plots under ``out_dir/plots``.
    ``df``: the report's results table; ``sweep_dir``: where its runs' curves are, for
    a fit whose references came from dense validation curves."""
    from xmodlm.report.paper_law_plots import plot_paper_law

    record = law.reference or {}
    metrics = law.metrics or {}
    draws = law.samples
    params = {}
    for i, name in enumerate(paper.NAMES):
        ci = None if draws is None else [float(v) for v in np.percentile(draws[:, i], INTERVAL)]
        params[name] = {"value": float(law.value[name]), "ci": ci}
    section: dict[str, Any] = {
        "kind": "paper", "path": str(path), "name": law.name,
        "variant": record.get("variant"), "loss": record.get("loss"), "lr": record.get("lr"),
        "ranges": law.ranges, "params": params, "in_fit": metrics.get("in_fit"),
        "heldout": law.heldout_scores(),
        "out_of_range": metrics.get("out_of_range"),
        "unseen": None, "plots": [], "loss_curves": [],
    }
    fitted = law.fitted_runs()
    if fitted is None:
        section["note"] = ("the fit keeps no record of its runs (refit with this version of"
                           " `xmod law fit --form paper`): nothing to score or draw")
        return section
    new = unseen_runs(law, fitted, df, sweep_dir)
    if len(new):
        section["unseen"] = score_unseen(law, new, fitted["delta"].to_numpy(float))
    frame = pd.concat([fitted, new], ignore_index=True)
    oor = np.r_[np.zeros(len(fitted), bool), np.ones(len(new), bool)]
    plots = plot_paper_law(law, frame, Path(out_dir) / "plots", oor=oor)
    section["plots"] = [str(p.relative_to(out_dir)) for p in plots]
    section["loss_curves"] = loss_curves(law, frame)
    return section


def loss_curves(law: paper.PaperLaw, frame: pd.DataFrame) -> list[dict[str, Any]]:
    """The law's loss against K at A = 1, per context and backbone (``params_active``:
    the scale, :func:`xmodlm.law.paper_fit.scales`), for the runs of ``frame`` (fitted
    and unseen, with their Eq. 14 inputs and dense reference): at each K the mean over
    its runs of the reference loss plus Eq. 14's Delta. So the report's loss-against-K
    figure can set the law's curve beside the measured losses, in the same units.
    Dense (K = 1) is the measured reference itself, not drawn here."""
    a1 = frame[np.isclose(frame["anchor_stride"].to_numpy(float), 1.0)]
    if a1.empty:
        return []
    a1 = a1.assign(law_loss=a1["reference_loss"].to_numpy(float)
                   + paper.delta(point_of(a1), law.value),
                   scale=scales(a1["params_active"].to_numpy(float)))
    out = []
    for (context, scale), g in a1.groupby(["context", "scale"], sort=True):
        by_k = g.groupby("sparsity", sort=True)["law_loss"].mean()
        out.append({"context": int(context), "params_active": float(scale),
                    "K": [float(k) for k in by_k.index], "loss": [float(v) for v in by_k]})
    return out


def unseen_runs(law: paper.PaperLaw, fitted: pd.DataFrame, df: pd.DataFrame,
                sweep_dir: str | Path | None) -> pd.DataFrame:
    """The runs of ``df`` of the fit's variant that the fit did not see, with their
    Delta measured the fit's way; empty when there are none (or none has a reference)."""
    from xmodlm.errors import UserError
    from xmodlm.law.reference import law_frame, read_curves

    record = law.reference or {}
    curves = read_curves(sweep_dir) if record.get("curves") and sweep_dir else None
    try:
        now, _ = law_frame(df, curves, loss=record.get("loss", "causal"),
                           family=record.get("variant") or "xmod", lr=record.get("lr"),
                           counts=law.counts())
    except UserError:  # no sparse run of that variant in the table
        return fitted.iloc[:0]
    return now[~now["run_id"].isin(fitted["run_id"])].reset_index(drop=True)


def score_unseen(law: paper.PaperLaw, new: pd.DataFrame, fitted_delta: np.ndarray
                 ) -> dict[str, Any]:
    """Each unseen run's prediction beside its outcome, and the pooled scores (against
    the constant-Delta baseline: the fitted runs' mean Delta)."""
    observed = new["delta"].to_numpy(float)
    predicted, lo, hi = with_interval(law, point_of(new))
    rows = []
    for i, r in enumerate(new.itertuples()):
        point = {k: float(getattr(r, k)) for k in paper.TABLE8_RANGE}
        rows.append({
            "run_id": r.run_id, "context": int(r.context), "K": float(r.sparsity),
            "A": float(r.anchor_stride), "observed": float(observed[i]),
            "predicted": float(predicted[i]),
            "interval": None if np.isnan(lo[i]) else [float(lo[i]), float(hi[i])],
            "in_interval": None if np.isnan(lo[i]) else bool(lo[i] <= observed[i] <= hi[i]),
            "in_band": bool(abs(predicted[i] - observed[i]) <= BAND),
            "outside": law.outside(point),
        })
    return {"rows": rows, **scores(observed, predicted, np.full(len(new), fitted_delta.mean()))}


def paper_law_markdown(law: dict[str, Any]) -> list[str]:
    """The section worded; every number from :func:`paper_law_section`."""
    lines = ["", "## Law", "",
             f"The paper's Eq. 14 (`{law['path']}`, fit `{law['name']}`): Delta = L_X-MoD -"
             " L_dense_hat against the dense reference of the same N_act and L at the same"
             f" FLOPs; variant `{law['variant']}`, {law['loss']} loss"
             + (f", peak lr {law['lr']:g}" if law.get("lr") else "") + "."]
    if law.get("note"):
        lines += ["", f"Note: {law['note']}."]
    lines += ["", "| parameter | value | 95% bootstrap interval |", "|---|---|---|"]
    for name, p in law["params"].items():
        ci = f"[{p['ci'][0]:.4g}, {p['ci'][1]:.4g}]" if p["ci"] else "-"
        lines.append(f"| {name} | {p['value']:.4g} | {ci} |")
    fit = law.get("in_fit")
    if fit:
        lines += ["", f"In fit: {fit['n']} runs, RMSE {fit['rmse']:.4f} nats,"
                  f" R^2_Delta {fit['r2_delta']:.3f}. Fitted ranges: "
                  + "; ".join(f"{k} {v[0]:.4g}-{v[1]:.4g}" for k, v in law["ranges"].items())
                  + "."]
    lines += heldout_table(law)
    lines += unseen_table(law.get("unseen"))
    for p in law.get("plots", []):
        lines += ["", f"![{Path(p).stem}]({p})"]
    return lines


def heldout_table(law: dict[str, Any]) -> list[str]:
    """Each held-out protocol (and the out-of-range group named before fitting) beside
    the constant-Delta baseline."""
    groups = dict(law.get("heldout") or {})
    if law.get("out_of_range"):
        groups["out of range (named before fitting)"] = law["out_of_range"]
    if not groups:
        return []
    lines = ["", f"Held out (the law refitted without each group), against the constant-Delta"
             f" baseline (the training runs' mean Delta); band: |error| <= {BAND:g} nats.", "",
             "| group | runs | RMSE, law | RMSE, constant | within band, law | beats constant"
             " | not scored |", "|---|---|---|---|---|---|---|"]
    for name, g in groups.items():
        if "not_applicable" in g:
            lines.append(f"| {name} | - | {g['not_applicable']} | | | | |")
            continue
        lines.append(f"| {name} | {g['n']} | {g['rmse']:.4f} | {g['baseline']['rmse']:.4f} |"
                     f" {g['within_band']:.0%} | {'yes' if g['beats_baseline'] else 'no'} |"
                     f" {g.get('not_scored', 0)} |")
    return lines


def unseen_table(unseen: dict[str, Any] | None) -> list[str]:
    """Predictions for the runs the fit did not see, beside their outcomes."""
    if not unseen:
        return []
    lines = ["", "Runs the fit did not see (trained after it: a registered prediction is"
             " scored here). Delta in nats; interval: the fit's bootstrap"
             f" {INTERVAL[0]:g}-{INTERVAL[1]:g} percentiles.", "",
             "| run | L | K | A | predicted | interval | measured | in interval | within band"
             " | outside the fitted range |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in unseen["rows"]:
        ci = f"[{r['interval'][0]:+.3f}, {r['interval'][1]:+.3f}]" if r["interval"] else "-"
        inside = "-" if r["in_interval"] is None else ("yes" if r["in_interval"] else "no")
        lines.append(f"| {r['run_id']} | {r['context']} | {r['K']:g} | {r['A']:g} |"
                     f" {r['predicted']:+.3f} | {ci} | {r['observed']:+.3f} | {inside} |"
                     f" {'yes' if r['in_band'] else 'no'} | {'; '.join(r['outside']) or '-'} |")
    lines += ["", f"Pooled over {unseen['n']}: RMSE {unseen['rmse']:.4f} (constant Delta"
              f" {unseen['baseline']['rmse']:.4f}), {unseen['within_band']:.0%} within the band."]
    return lines
