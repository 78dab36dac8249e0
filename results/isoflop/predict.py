"""The isoflop study's prediction of its top budget, from its lower budgets only.

Run from the repository root once the lower budgets have finished and before any
run of the top budget starts; it writes ``prediction.json``, ``prediction.md``
and the law it fitted (``prediction-law.json``) beside itself, and these are
committed before the top budget's first run (the git history shows the order)::

    python results/isoflop/predict.py

What is predicted, for the top budget's planned runs (spec ``isoflop``, its
largest compute):

1. **By the laws.** The dense law and the X-MoD delta law are fitted on the lower
   budgets' runs (``xmod law fit``'s defaults: form chosen by held-out error,
   1000 bootstrap replicates; every run is at its width's rule rate, so the
   table's learning-rate column is left out rather than used to pick one rate).
   Each planned size's loss is predicted with its bootstrap draws; a parabola in
   ln N through each replicate's predicted profile gives that family's isoFLOP
   minimum, the way the outcome's is measured (``xmodlm.report.isoflop``).
   Best X-MoD minus best dense is the replicate-paired difference of vertices,
   and X-MoD minus dense at equal active size is the law's dense loss at the
   X-MoD run's own N with the tokens dense of that N would get.
2. **By the minima.** Each family's measured minima on the lower budgets, N* and
   L* and its difference from dense, extrapolated log-linearly in C to the top
   budget (two budgets: the line through them; the interval carries each
   budget's bootstrap). This is the only prediction for MoE, which has no law.
3. ``xmod recommend``'s answer at the top budget for the predicted best dense
   size, with the law fitted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from xmodlm.law.fit import fit_law, predict_samples
from xmodlm.law.table import validate
from xmodlm.report.analysis import finished_table
from xmodlm.report.isoflop import fit_parabola, minimum, profiles
from xmodlm.sweep.spec import expand, load_spec

HERE = Path(__file__).resolve().parent
SPEC = HERE.parents[1] / "src" / "xmodlm" / "configs" / "sweeps" / "isoflop.yaml"
N_BOOT = 1000
FAMILIES = ("dense", "xmod", "moe")


def _interval(x: np.ndarray) -> list[float] | None:
    x = x[np.isfinite(x)]
    return [float(np.percentile(x, 2.5)), float(np.percentile(x, 97.5))] if len(x) else None


def finished(path: Path) -> pd.DataFrame:
    df = pd.read_csv(path)
    return df[df["status"] == "ok"].reset_index(drop=True)


def planned_top(spec: Path = SPEC) -> tuple[float, pd.DataFrame]:
    runs = expand(load_spec(spec))
    top = max(r.compute for r in runs)
    rows = pd.DataFrame([r.row() for r in runs if r.compute == top])
    return top, rows.drop_duplicates(["family", "width", "n_layers"]).reset_index(drop=True)


def law_profiles(fit, rows: pd.DataFrame) -> dict[str, dict]:
    """Per family with a law: predicted loss per planned size, and the vertex of the
    parabola through each bootstrap replicate's profile."""
    frame = validate(rows[rows["family"].isin(["dense", "xmod"])], need_loss=False).frame
    p = predict_samples(fit, frame)
    out = {}
    for family in ("dense", "xmod"):
        pick = (frame["family"] == family).to_numpy()
        order = np.argsort(frame.loc[pick, "params_active"].to_numpy())
        sizes = frame.loc[pick, "params_active"].to_numpy()[order]
        point = np.exp(p.ln_point[pick][order])
        draws = np.exp(p.ln_samples[:, pick][:, order])
        ln_n, ones = np.log(sizes), np.ones(len(sizes))
        _, x0, l0 = fit_parabola(ln_n, point, ones)
        vert = np.array([fit_parabola(ln_n, d, ones)[1:] for d in draws])
        ok = np.isfinite(vert[:, 1])
        out[family] = {
            "sizes": sizes.tolist(),
            "tokens_per_param": (frame.loc[pick, "tokens"].to_numpy()[order] / sizes).tolist(),
            "loss": point.tolist(),
            "loss_ci95": [_interval(draws[:, i]) for i in range(len(sizes))],
            "best_planned_size": float(sizes[int(np.argmin(point))]),
            "n_star": float(np.exp(x0)) if np.isfinite(x0) else None,
            "n_star_ci95": _interval(np.exp(vert[ok, 0])),
            "loss_star": float(l0) if np.isfinite(l0) else None,
            "loss_star_ci95": _interval(vert[ok, 1]),
            "minimum_inside_planned_sizes": bool(np.isfinite(x0) and sizes[0] < np.exp(x0) < sizes[-1]),
            "replicates_with_a_minimum": float(ok.mean()),
            "_draws": vert[:, 1],
        }
    d = out["xmod"]["_draws"] - out["dense"]["_draws"]
    point = (out["xmod"]["loss_star"] - out["dense"]["loss_star"]
             if out["xmod"]["loss_star"] is not None and out["dense"]["loss_star"] is not None else None)
    out["xmod_minus_dense"] = {"minus": point, "ci95": _interval(d)}
    for family in ("dense", "xmod"):
        out[family].pop("_draws")
    out["equal_size"] = _equal_size(fit, frame)
    return out


def _equal_size(fit, frame: pd.DataFrame) -> list[dict]:
    """X-MoD minus dense at each X-MoD run's own active size N at the top budget: the
    dense law at N with the tokens a dense model of that size gets (C / F_dense(N),
    F interpolated log-log between the planned dense sizes)."""
    dense = frame[frame["family"] == "dense"].sort_values("params_active")
    ln_f = np.interp(np.log(frame["params_active"]), np.log(dense["params_active"]),
                     np.log(dense["compute"] / dense["tokens"]))
    twin = frame.assign(stride=1, capacity=1.0, tokens=frame["compute"] / np.exp(ln_f))
    twin = validate(twin.drop(columns=["family"]).assign(family="dense"), need_loss=False).frame
    px, pd_ = predict_samples(fit, frame), predict_samples(fit, twin)
    out = []
    for i in np.flatnonzero((frame["family"] == "xmod").to_numpy()):
        diff = np.exp(px.ln_samples[:, i]) - np.exp(pd_.ln_samples[:, i])
        out.append({
            "params_active": float(frame["params_active"].iloc[i]),
            "tokens_per_param": float(frame["tokens"].iloc[i] / frame["params_active"].iloc[i]),
            "minus": float(np.exp(px.ln_point[i]) - np.exp(pd_.ln_point[i])),
            "ci95": _interval(diff),
        })
    return out


def measured_minima(df: pd.DataFrame) -> dict[float, dict[str, dict]]:
    """Each lower budget's measured isoFLOP minimum per family, with its draws, read
    as the report reads the outcome (:func:`xmodlm.report.analysis.finished_table`:
    runs grouped into budgets, the causal loss, a dense run's being its loss)."""
    frame, _ = finished_table(df, "results.csv")
    out: dict[float, dict[str, dict]] = {}
    for prof in profiles(frame, ("family",)):
        family = prof.key["config"]["family"]
        out.setdefault(float(prof.key["tier"]), {})[family] = minimum(prof, n_boot=N_BOOT)
    return out


def extrapolate(minima: dict[float, dict[str, dict]], top: float) -> dict[str, dict]:
    """Log-linear in C through the two largest lower budgets: N*, L* and L* minus dense."""
    budgets = sorted(minima)[-2:]
    if len(budgets) < 2:
        return {}
    c1, c2 = budgets
    w = np.log(top / c2) / np.log(c2 / c1)  # the line's step beyond c2, in units of c2 - c1
    out: dict[str, dict] = {}
    for family in FAMILIES:
        m1, m2 = minima[c1].get(family), minima[c2].get(family)
        if m1 is None or m2 is None or m1["n_star"] is None or m2["n_star"] is None:
            continue
        entry = {
            "n_star": float(np.exp(np.log(m2["n_star"]) + w * np.log(m2["n_star"] / m1["n_star"]))),
            "loss_star": float(m2["loss_star"] + w * (m2["loss_star"] - m1["loss_star"])),
            "loss_star_ci95": _interval(m2["_draws"] + w * (m2["_draws"] - m1["_draws"])),
            "from": {str(c1): {"n_star": m1["n_star"], "loss_star": m1["loss_star"],
                               "bracketed": m1["bracketed"]},
                     str(c2): {"n_star": m2["n_star"], "loss_star": m2["loss_star"],
                               "bracketed": m2["bracketed"]}},
        }
        if family != "dense" and "dense" in minima[c1] and "dense" in minima[c2]:
            d1 = m1["_draws"] - minima[c1]["dense"]["_draws"]
            d2 = m2["_draws"] - minima[c2]["dense"]["_draws"]
            p1 = m1["loss_star"] - minima[c1]["dense"]["loss_star"]
            p2 = m2["loss_star"] - minima[c2]["dense"]["loss_star"]
            entry["minus_dense"] = float(p2 + w * (p2 - p1))
            entry["minus_dense_ci95"] = _interval(d2 + w * (d2 - d1))
            entry["minus_dense_measured"] = {str(c1): float(p1), str(c2): float(p2)}
        out[family] = entry
    return out


def recommend_answer(law_path: Path, top: float, active: float) -> str:
    root = HERE.parents[1]  # the command as typed at the repository root
    law = os.path.relpath(law_path.resolve(), root)
    cmd = ["xmod", "recommend", "--compute", f"{top:g}", "--context", "512",
           "--active-params", f"{active:.4g}", "--vocab-size", "1024", "--law", law]
    done = subprocess.run([sys.executable, "-m", "xmodlm", *cmd[1:]], capture_output=True,
                          text=True, cwd=root)
    return "$ " + " ".join(cmd) + "\n" + done.stdout + done.stderr


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=HERE / "results.csv")
    parser.add_argument("--spec", type=Path, default=SPEC, help="the spec whose top budget is predicted")
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()
    df = finished(args.results)
    top, planned = planned_top(args.spec)
    lower = df[df["compute"] < top * 0.99].reset_index(drop=True)
    fit = fit_law(lower.drop(columns=["lr"]), n_boot=N_BOOT, seed=0)
    law_path = args.out / "prediction-law.json"
    law_path.write_text(json.dumps(fit.to_json(samples=True)))
    by_law = law_profiles(fit, planned)
    minima = measured_minima(lower)
    by_minima = extrapolate(minima, top)
    active = by_law["dense"]["n_star"] or by_law["dense"]["best_planned_size"]
    answer = recommend_answer(law_path, top, active)
    summary = {
        "top_budget": top,
        "lower_budgets": sorted(minima),
        "runs_fitted": int(len(lower)),
        "law": {"selected_form": fit.selected, "identification": fit.identification,
                "heldout": fit.metrics.get("heldout"), "in_fit": fit.metrics.get("in_fit"),
                "notes": fit.notes},
        "by_law": by_law,
        "by_minima": by_minima,
        "measured_lower_minima": {
            str(c): {f: {k: v for k, v in m.items() if not k.startswith("_")}
                     for f, m in fams.items()}
            for c, fams in minima.items()},
        "recommend": answer,
    }
    (args.out / "prediction.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")
    (args.out / "prediction.md").write_text(render(summary) + "\n")
    print(render(summary))


def _ci(x: list[float] | None, fmt: str = "+.4f") -> str:
    return f"[{format(x[0], fmt)}, {format(x[1], fmt)}]" if x else "[-]"


def render(s: dict) -> str:
    law, mins = s["by_law"], s["by_minima"]
    lines = [f"# Registered prediction for C = {s['top_budget']:.2g} (T = 512)", "",
             f"Fitted on the {s['runs_fitted']} finished runs of the lower budgets"
             f" ({', '.join(f'{c:.2g}' for c in s['lower_budgets'])}) by `results/isoflop/predict.py`."
             f" Delta form: {s['law']['selected_form']}.", "",
             "## By the laws (dense law + X-MoD delta law)", "",
             "| family | planned sizes | N* [95%] | L* [95%] | best planned size | minimum inside the planned sizes |",
             "|---|---|---|---|---|---|"]
    for f in ("dense", "xmod"):
        m = law[f]
        lines.append(
            f"| {f} | {len(m['sizes'])}: {m['sizes'][0]:.3g}-{m['sizes'][-1]:.3g} |"
            f" {m['n_star'] or float('nan'):.3g} {_ci(m['n_star_ci95'], '.3g')} |"
            f" {m['loss_star'] or float('nan'):.4f} {_ci(m['loss_star_ci95'], '.4f')} |"
            f" {m['best_planned_size']:.3g} | {'yes' if m['minimum_inside_planned_sizes'] else 'no'} |")
    d = law["xmod_minus_dense"]
    lines += ["", f"Best X-MoD minus best dense: {d['minus']:+.4f} {_ci(d['ci95'])} nats.", "",
              "X-MoD minus dense at equal active size:", "",
              "| N | tokens / param | X-MoD minus dense [95%] |", "|---|---|---|"]
    for e in law["equal_size"]:
        lines.append(f"| {e['params_active']:.3g} | {e['tokens_per_param']:.0f} |"
                     f" {e['minus']:+.4f} {_ci(e['ci95'])} |")
    lines += ["", "## By the measured minima, extrapolated log-linearly in C", "",
              "A straight line in ln C through two budgets' minima: its intervals carry the"
              " lower budgets' seed noise (bootstrap), not the doubt that the line is the"
              " right shape, so they are narrower than what is known.", "",
              "| family | N* | L* [95%] | minus dense [95%] | measured minus dense on the lower budgets |",
              "|---|---|---|---|---|"]
    for f, m in mins.items():
        measured = ", ".join(f"{float(c):.2g}: {v:+.4f}" for c, v in m.get("minus_dense_measured", {}).items())
        lines.append(f"| {f} | {m['n_star']:.3g} | {m['loss_star']:.4f} {_ci(m['loss_star_ci95'], '.4f')} |"
                     f" {m['minus_dense']:+.4f} {_ci(m['minus_dense_ci95'])} | {measured} |"
                     if "minus_dense" in m else
                     f"| {f} | {m['n_star']:.3g} | {m['loss_star']:.4f} {_ci(m['loss_star_ci95'], '.4f')} | - | - |")
    lines += ["", "## `xmod recommend` at the top budget", "", "```", s["recommend"].rstrip(), "```"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
