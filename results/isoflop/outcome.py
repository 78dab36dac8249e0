"""The isoflop study's top budget: the registered prediction against what was measured.

Run from the repository root once the top budget's runs have finished::

    python results/isoflop/outcome.py

It reads the prediction committed before the top budget's first run
(``prediction.json``, written by ``predict.py``) and never rewrites it; it
writes ``outcome.json`` and ``outcome.md`` beside itself, and the law refitted on
every finished run (``law.json``).

What is compared, at the top budget:

1. **Each family's isoFLOP minimum** (N*, L*), measured as the report measures it
   (:mod:`xmodlm.report.isoflop`: parabola in ln N, bootstrap over seeds), against
   the law's prediction and the minima's log-linear extrapolation.
2. **Best X-MoD minus best dense and best MoE minus best dense**, measured (the
   paired replicate difference) against both predictions: is the measured point
   inside each predicted 95% interval, and does the measured interval exclude 0?
3. **Every planned size's loss** against the law's prediction for it: the error
   of a law fitted on the lower budgets only, on a budget 3x past them (the one
   held-out test this study was built to run), and how many measured means fall
   inside the law's 95% interval.
4. **X-MoD minus dense at equal active size**, measured (inside the dense sizes
   tried) against the law's.
5. **Best size against best size, paired by seed**, read from the runs alone
   (no parabola): each family's size picked on seed 0, compared with dense's on
   seeds 1-2 (the seeds that played no part in the pick, so seed 0's luck cannot
   flatter the winner) and on all three.
6. The law **refitted on every run**, its identification, and ``xmod recommend``'s
   answer with it at the measured best dense size.

A family run at one seed per size shows no seed noise: its minimum then has no
interval, and the table says so rather than print a zero-wide one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from predict import (  # noqa: E402  (the prediction's own reading of the runs, shared)
    FAMILIES,
    N_BOOT,
    _ci,
    finished,
    measured_minima,
    recommend_answer,
)

from xmodlm.law.fit import fit_law  # noqa: E402
from xmodlm.report.analysis import finished_table, over_seeds  # noqa: E402
from xmodlm.report.isoflop import difference, equal_size  # noqa: E402


def _inside(x: float | None, ci: list[float] | None) -> bool | None:
    if x is None or ci is None:
        return None
    return bool(ci[0] <= x <= ci[1])


def _public(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith("_")}


def tokens_per_param_at(m: dict) -> float | None:
    """Tokens per active parameter at a measured minimum's N*: the profile's D / N,
    interpolated log-log in N (D / N falls steeply and smoothly with N at one budget);
    None where N* lies outside the sizes run (no extrapolation)."""
    if m.get("n_star") is None or "tokens_per_param" not in m:
        return None
    if not m["sizes"][0] <= m["n_star"] <= m["sizes"][-1]:
        return None
    return float(np.exp(np.interp(np.log(m["n_star"]), np.log(m["sizes"]), np.log(m["tokens_per_param"]))))


def per_size(prediction: dict, top_runs: pd.DataFrame) -> list[dict]:
    """Each planned dense and X-MoD size: the law's predicted loss [95%] beside the
    measured mean over its seeds."""
    out = []
    for family in ("dense", "xmod"):
        law = prediction["by_law"][family]
        runs = top_runs[top_runs["family"] == family]
        for n, loss, ci in zip(law["sizes"], law["loss"], law["loss_ci95"], strict=True):
            seeds = runs.loc[np.isclose(runs["params_active"].astype(float), n), "loss"].to_numpy(float)
            mean = float(seeds.mean()) if len(seeds) else None
            out.append({
                "family": family, "params_active": float(n), "predicted": float(loss),
                "predicted_ci95": ci, "measured": mean, "seeds": int(len(seeds)),
                "error": None if mean is None else float(loss - mean),
                "inside": _inside(mean, ci),
            })
    return out


def law_error(rows: list[dict]) -> dict:
    """The law's out-of-budget error over the measured sizes: RMSE and mean error of
    the predicted loss (nats), and how many measured means lie inside its interval."""
    done = [r for r in rows if r["measured"] is not None]
    if not done:
        return {"n": 0}
    err = np.array([r["error"] for r in done])
    return {"n": len(done), "rmse": float(np.sqrt(np.mean(err**2))), "mean_error": float(err.mean()),
            "inside_ci95": int(sum(bool(r["inside"]) for r in done))}


def best_sizes_paired(top_runs: pd.DataFrame) -> dict[str, dict]:
    """Each routed family's best size minus dense's on one budget, paired by seed,
    from the runs.

    A family's best size is its best seed-0 size (the pick that chose which sizes
    got seeds 1-2). Seed 0 then favours the pick by its own luck; seeds 1-2 did not
    take part in it, so their paired difference is the selection-free estimate
    (:func:`xmodlm.report.analysis.over_seeds`: mean +- SE, t-interval). Both are
    given; the parabola's minimum (above) is the headline, this is its check."""
    def pick(family: str) -> tuple[float, pd.Series] | None:
        runs = top_runs[top_runs["family"] == family]
        zero = runs[runs["seed"] == 0]
        if zero.empty:
            return None
        n = float(zero.loc[zero["loss"].idxmin(), "params_active"])
        at = runs[np.isclose(runs["params_active"].astype(float), n)]
        return n, at.set_index(at["seed"].astype(int))["loss"].astype(float)

    dense = pick("dense")
    out: dict[str, dict] = {}
    for family in ("xmod", "moe"):
        routed = pick(family)
        if routed is None or dense is None:
            continue
        (n, a), (n_dense, b) = routed, dense
        entry = {"params_active": n, "dense_params_active": n_dense}
        for name, seeds in (("unpicked_seeds", [s for s in a.index if s != 0]), ("all_seeds", list(a.index))):
            common = sorted(set(seeds) & set(b.index))
            entry[name] = ({"seeds": common, **over_seeds((a[common] - b[common]).to_numpy(float))}
                           if common else None)
        out[family] = entry
    return out


def compare(prediction: dict, minima: dict[str, dict]) -> dict:
    law, extra = prediction["by_law"], prediction["by_minima"]
    fams: dict[str, dict] = {}
    for family in FAMILIES:
        m = minima.get(family)
        fams[family] = {
            "measured": {**_public(m), "tokens_per_param_at_n_star": tokens_per_param_at(m)} if m else None,
            "law": {k: law[family][k] for k in ("n_star", "n_star_ci95", "loss_star", "loss_star_ci95")}
            if family in law else None,
            "minima": {k: extra[family][k] for k in ("n_star", "loss_star", "loss_star_ci95")}
            if family in extra else None,
        }
        if m:
            for src in ("law", "minima"):
                if fams[family][src]:
                    fams[family][src]["measured_inside"] = _inside(
                        m["loss_star"], fams[family][src]["loss_star_ci95"])
    diffs: dict[str, dict] = {}
    dense = minima.get("dense")
    for family in ("xmod", "moe"):
        m = minima.get(family)
        if m is None or dense is None:
            continue
        d = difference(m, dense)
        entry = {"measured": d, "equal_size": equal_size(m, dense)}
        if family == "xmod":  # the law's predictions beside the measured ones
            for q in entry["equal_size"]:
                q["law"] = next((p for p in law["equal_size"]
                                 if np.isclose(p["params_active"], q["params_active"])), None)
            p = law["xmod_minus_dense"]
            entry["law"] = {**p, "measured_inside": _inside(d["minus"], p["ci95"])}
        if "minus_dense" in extra.get(family, {}):
            p = extra[family]
            entry["minima"] = {"minus": p["minus_dense"], "ci95": p["minus_dense_ci95"],
                               "measured_inside": _inside(d["minus"], p["minus_dense_ci95"])}
        diffs[family] = entry
    return {"families": fams, "minus_dense": diffs}


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=HERE / "results.csv")
    parser.add_argument("--prediction", type=Path, default=HERE / "prediction.json")
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--no-refit", action="store_true", help="skip the law refitted on every run")
    args = parser.parse_args()
    prediction = json.loads(args.prediction.read_text())
    top = float(prediction["top_budget"])
    df = finished(args.results)
    table, _ = finished_table(df, args.results)  # the loss compared: causal routing, as the report's
    top_runs = table[np.isclose(table["tier"], top, rtol=0.01)].reset_index(drop=True)
    minima = next((m for c, m in measured_minima(df).items() if np.isclose(c, top, rtol=0.01)), {})
    rows = per_size(prediction, top_runs)
    summary = {
        "top_budget": top,
        "runs_at_top": int(len(top_runs)),
        "seeds_at_top": sorted(int(s) for s in top_runs["seed"].unique()),
        "machine": sorted({f"{k} / {d} / compile {c}" for k, d, c in
                           top_runs[["cpu_kind", "dtype", "compile"]].itertuples(index=False)}),
        **compare(prediction, minima),
        "per_size": rows,
        "law_error": law_error(rows),
        "best_sizes_paired": {f"{c:.3g}": best_sizes_paired(runs) for c, runs in table.groupby("tier")},
    }
    if not args.no_refit:
        fit = fit_law(df.drop(columns=["lr"]), n_boot=N_BOOT, seed=0)
        law_path = args.out / "law.json"
        law_path.write_text(json.dumps(fit.to_json(samples=True)))
        dense = minima.get("dense")
        active = (dense or {}).get("n_star") or (dense or {}).get("best_size")
        summary["refit"] = {
            "runs_fitted": int(len(df)), "selected_form": fit.selected,
            "identification": fit.identification, "heldout": fit.metrics.get("heldout"),
            "recommend": recommend_answer(law_path, top, active) if active else None,
        }
    (args.out / "outcome.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")
    (args.out / "outcome.md").write_text(render(summary) + "\n")
    print(render(summary))


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _yes(x: bool | None) -> str:
    return "-" if x is None else ("yes" if x else "no")


def _law_text(p: dict | None) -> str:
    return "-" if p is None else f"{p['minus']:+.4f} {_ci(p['ci95'])}"


def render(s: dict) -> str:
    lines = [f"# The top budget, C = {s['top_budget']:.2g}: registered prediction against outcome", "",
             f"{s['runs_at_top']} finished runs at the top budget (seeds {s['seeds_at_top']};"
             f" {', '.join(s['machine'])}). The prediction (`prediction.md`) was committed"
             " before the first of them ran. Causal-routing validation loss, nats;"
             " intervals are 95%.", "",
             "## Each family's isoFLOP minimum", "",
             "| family | measured N* | D / N at N* | measured L* | law: L* | inside | minima line: L* | inside | bracketed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for family, f in s["families"].items():
        m = f["measured"]
        if m is None:
            lines.append(f"| {family} | not measured (fewer than 3 sizes) | | | | | | | |")
            continue
        law, mins = f["law"], f["minima"]
        lines.append(
            f"| {family} | {_num(m['n_star'], '.3g')} | {_num(m['tokens_per_param_at_n_star'], '.0f')} |"
            f" {_num(m['loss_star'], '.4f')}"
            f" {_ci(m['loss_star_ci95'], '.4f') if m['pooled_seed_sd'] is not None else '(one seed)'} |"
            f" {_num(law['loss_star'], '.4f') + ' ' + _ci(law['loss_star_ci95'], '.4f') if law else '-'} |"
            f" {_yes(law['measured_inside']) if law else '-'} |"
            f" {_num(mins['loss_star'], '.4f') + ' ' + _ci(mins['loss_star_ci95'], '.4f') if mins else '-'} |"
            f" {_yes(mins['measured_inside']) if mins else '-'} | {_yes(m['bracketed'])} |")
    lines += ["", "## Best family minus best dense", "",
              "| family | measured [95%] | resolved | law [95%] | inside | minima line [95%] | inside |",
              "|---|---|---|---|---|---|---|"]
    for family, d in s["minus_dense"].items():
        m, law, mins = d["measured"], d.get("law"), d.get("minima")
        lines.append(
            f"| {family} | {_num(m['minus'], '+.4f')} {_ci(m['ci95']) if m['ci95'] else '(one seed)'} |"
            f" {_yes(m['resolved']) if m['ci95'] else '-'} |"
            f" {_num(law['minus'], '+.4f') + ' ' + _ci(law['ci95']) if law else '- (no MoE law)'} |"
            f" {_yes(law['measured_inside']) if law else '-'} |"
            f" {_num(mins['minus'], '+.4f') + ' ' + _ci(mins['ci95']) if mins else '-'} |"
            f" {_yes(mins['measured_inside']) if mins else '-'} |")
    e = s["law_error"]
    lines += ["", "## Every planned size against the law fitted on the lower budgets", ""]
    if e["n"]:
        lines += [f"Over {e['n']} measured sizes the law's error is {e['rmse']:.4f} RMSE"
                  f" ({e['mean_error']:+.4f} mean, predicted minus measured);"
                  f" {e['inside_ci95']} of {e['n']} measured means lie inside its 95% interval.", ""]
    lines += ["| family | N | seeds | law [95%] | measured | law minus measured | inside |",
              "|---|---|---|---|---|---|---|"]
    for r in s["per_size"]:
        lines.append(f"| {r['family']} | {r['params_active']:.3g} | {r['seeds']} |"
                     f" {r['predicted']:.4f} {_ci(r['predicted_ci95'], '.4f')} |"
                     f" {_num(r['measured'], '.4f')} | {_num(r['error'], '+.4f')} | {_yes(r['inside'])} |")
    if s["best_sizes_paired"]:
        lines += ["", "## Best size against best size, paired by seed (from the runs, no parabola)", "",
                  "Every budget (the lower ones for the trend). Each family's best seed-0 size"
                  " minus dense's best seed-0 size, by seed. Seeds"
                  " 1-2 took no part in picking the sizes, so their difference carries no"
                  " selection bias; with seed 0 added it does. Mean +- SE, 95% t-interval.", "",
                  "| budget | family | N | dense N | seeds 1-2 [95%] | seeds 0-2 [95%] | resolved (0-2) |",
                  "|---|---|---|---|---|---|---|"]

        def cell(o: dict | None) -> str:
            if o is None:
                return "-"
            if o["se"] is None:
                return f"{o['mean']:+.4f} (one seed)"
            return f"{o['mean']:+.4f} +- {o['se']:.4f} {_ci(o['ci95'])}"
        for budget, family, b in ((c, f, b) for c, per in s["best_sizes_paired"].items() for f, b in per.items()):
            allseeds = b["all_seeds"]
            lines.append(f"| {budget} | {family} | {b['params_active']:.3g} | {b['dense_params_active']:.3g} |"
                         f" {cell(b['unpicked_seeds'])} | {cell(allseeds)} |"
                         f" {_yes(allseeds['resolved']) if allseeds and allseeds['se'] is not None else '-'} |")
    xm = s["minus_dense"].get("xmod")
    if xm and xm["equal_size"]:
        lines += ["", "## X-MoD minus dense at equal active size (measured, inside the dense sizes)", "",
                  "| N | tokens / param | seeds | measured [95%] | law [95%] |", "|---|---|---|---|---|"]
        for q in xm["equal_size"]:
            lines.append(f"| {q['params_active']:.3g} | {_num(q['tokens_per_param'], '.0f')} | {q['seeds']} |"
                         f" {q['minus']:+.4f} {_ci(q['ci95']) if q['ci95'] else '(one seed)'} |"
                         f" {_law_text(q.get('law'))} |")
    if "refit" in s:
        r = s["refit"]
        flags = r["identification"].get("flags") or []
        lines += ["", f"## The law refitted on all {r['runs_fitted']} runs (`law.json`)", "",
                  f"Delta form: {r['selected_form']}. Identified: {'yes' if not flags else 'no'}"
                  + ("" if not flags else " (" + "; ".join(
                      f"{f['law']} {f['param']}: {f['problem']}" for f in flags) + ")") + "."]
        if r.get("heldout"):
            h = r["heldout"]
            lines += ["", f"Held-out error of ln L: RMSE {h.get('rmse', float('nan')):.4f}"
                      f" over {h.get('n', 0)} runs."]
        if r.get("recommend"):
            lines += ["", "```", r["recommend"].rstrip(), "```"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
