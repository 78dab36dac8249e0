"""``xmod report``: the written report of a sweep, computed from its results table.

Every figure in a sweep's write-up should come from one command, so that it can
be recomputed from the committed table rather than trusted. The report answers
the questions a reader asks first, in this order:

1. What ran: runs per family, compute tiers, widths, contexts, seeds, and runs
   left out (not finished).
2. Sparse vs dense at equal compute: each non-dense run against its FLOP-matched
   dense reference (:mod:`xmodlm.pairing`: the dense run of the same context,
   width, seed and peak learning rate, at the same budget). Differences are in the causal-routing validation loss
   (what decoding gets; the top-k one beside it). Per family and per compute
   tier: how many lose, and the median, best and worst difference in nats; per
   configuration over seeds: the paired mean +- standard error with its 95%
   t-interval, *resolved* only when the interval excludes zero.
   Where the sweep varies the peak learning rate, each model's loss per
   learning rate, and the best one, judged on the seeds every rate has.
3. The dense ladder: at each tier, every dense shape (width, depth, learning rate)
   with its loss over seeds, the best one (on shared seeds) and the others'
   paired difference to it. A best shape at the edge of the tested sizes means the
   compute-optimal size was not bracketed and a dense law fitted on it is an
   extrapolation. Where a budget has dense at several sizes, each routed
   configuration against dense of its own active size (:func:`equal_size`): FLOP
   matching changes the active size, and this separates that from routing. Dense
   runs of control sweeps (``dense_controls``) join these two, never the pairing.
4. Routing at inference: the causal-minus-top-k loss gap of routed runs.
5. Training dynamics, where the run records sit beside the table (``runs/RUN_ID/``
   of the sweep directory): per configuration (as in 2, dense included, and the
   depth), mean +- SE over seeds of loss spikes, gradient-norm peaks, residual
   RMS per block at init and at the end, and the routing at the end
   (:mod:`xmodlm.report.dynamics`); ``residual_rms.png`` draws the residual RMS and
   ``depth_hist.png`` the sparse depth per token.
   A run without ``metrics.jsonl`` is skipped and counted.
6. The paper's claims, where the table holds runs of the paper's construction
   (:mod:`xmodlm.report.claims`): the U in K, the growth of the best K with the
   context, the best X-MoD against dense, the ablations, X-MoD against MoE, and
   from the run records routing with and without the bias and step times;
   ``claims_k.png`` draws the loss against K.
7. Optionally, the law: selected delta form, its parameters with 95% intervals,
   held-out metrics, and the law's plots.

Outputs ``report.md``, ``comparisons.csv`` (one row per matched non-dense run)
and ``report.json`` (the same numbers), all written atomically.

The table's numbers are computed in :mod:`xmodlm.report.analysis` and worded in
:mod:`xmodlm.report.render`; this module gathers what lies beyond the table (the
dense control sweeps, the run records, a law fit) and writes the three files.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from xmodlm import record
from xmodlm.errors import UserError
from xmodlm.fileio import atomic_write_json, atomic_write_text
from xmodlm.law.paper import read_paper_law
from xmodlm.law.table import finished_runs, read_table
from xmodlm.progress import Progress
from xmodlm.report.analysis import (
    CONFIG_KEYS,
    PAIR_KEYS,
    against_dense,
    causal_gap,
    config_label,
    finished_table,
    headline,
    learning_rates,
    match_to_dense,
    run_label,
)
from xmodlm.report.isoflop import isoflop
from xmodlm.report.isoflop_plots import plot_isoflop
from xmodlm.report.ladder import dense_ladder, equal_size
from xmodlm.report.render import render_markdown

if TYPE_CHECKING:
    from xmodlm.law.paper import read_paper_law
from xmodlm.law.lawfit import LawFit


def _law_section(fit: LawFit, fit_path: str | Path) -> dict[str, Any]:
    data = fit.to_json()
    section: dict[str, Any] = {"path": str(fit_path), "runs": data["runs"],
                               "baseline": fit.baseline}
    section["dense"] = [
        {"context": d["context"], "params": {k: v["value"] for k, v in d["params"].items()}}
        for d in data["dense"]
    ]
    if fit.delta is not None:
        form = data["delta"]["forms"][fit.selected]
        section["selected"] = fit.selected
        section["why"] = (fit.selection or {}).get("why", "")
        section["params"] = {
            k: {"value": v["value"], "ci": v["ci"]}
            for k, v in form["params"].items()
            if not v.get("fixed")
        }
        section["terms"] = law_terms(section["params"], form["params"], bool(fit.delta_flags()))
    section["metrics"] = data["metrics"]
    return section


TERM_PARAMS = {"capacity": "g_cap", "context": "g_ctx", "interaction": "g_int"}


def law_terms(
    fitted: dict[str, Any], every: dict[str, Any], flagged: bool = False
) -> dict[str, dict[str, Any]]:
    """Which of the three named terms of the delta law the data resolve.

    Each term has one signed coefficient (``capacity``: g_cap, ``context``:
    g_ctx, ``interaction``: g_int; :mod:`xmodlm.law.delta`). A term is resolved
    when its coefficient was fitted (not held at zero for want of contexts or
    strides), its 95% bootstrap interval excludes zero, and the delta law is
    not ``flagged`` as unidentified (then no interval of it means anything).
    """
    out = {}
    for term, name in TERM_PARAMS.items():
        if name in fitted:
            v = fitted[name]
            lo, hi = v["ci"]
            out[term] = {"param": name, "value": v["value"], "ci": v["ci"], "fixed": False,
                         "resolved": bool(lo > 0 or hi < 0) and not flagged,
                         "flagged": flagged}
        else:
            value = every.get(name, {}).get("value", 0.0)
            out[term] = {"param": name, "value": value, "ci": None, "fixed": True,
                         "resolved": False}
    return out


def dynamics(
    df: pd.DataFrame, results: str | Path, out_dir: str | Path,
    comparisons: pd.DataFrame | None = None,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The training-dynamics section: each finished run's record read from the
    sweep directory of ``results`` (``runs/RUN_ID/``, or ``RUN_ID/`` beside the
    table), grouped as the paired comparison groups (plus the depth, since per-block
    figures only average over one), dense included as the reference; and
    ``residual_rms.png`` in ``out_dir``. Runs without a record are counted.
    ``comparisons`` (:func:`match_to_dense`) names each routed run's dense run, for
    the spikes counted against it. Returns the section and each run's record by run
    id (:func:`~xmodlm.report.dynamics.run_dynamics`), which the claims read too."""
    from xmodlm.report.dynamics import (
        PAIRED_SPIKE_THRESHOLD,
        SPIKE_THRESHOLD,
        SPIKE_WINDOW,
        run_dynamics,
        summarise,
        with_paired_spikes,
    )
    from xmodlm.report.dynamics_plots import plot_depth_hist, plot_residual_rms

    root = Path(results).parent
    runs_root = root / "runs" if (root / "runs").is_dir() else root
    keys = [*PAIR_KEYS, "n_layers"] if "n_layers" in df.columns else list(PAIR_KEYS)
    cache: dict[Any, Any] = {}
    found, skipped = [], 0
    for i, run in df.iterrows():
        run_id = run.get("run_id")
        dyn = None
        if isinstance(run_id, str) and run_id.strip():
            warmup = pd.to_numeric(run.get("warmup_steps"), errors="coerce")
            dyn = run_dynamics(runs_root / run_id.strip(),
                               warmup=int(warmup) if np.isfinite(warmup) else None, cache=cache)
        if dyn is None:
            skipped += 1
        else:
            found.append((i, {**dyn, "run_id": run_id.strip()}))
    if comparisons is not None and not comparisons.empty and "dense_run_id" in comparisons:
        partner = {r: d for r, d in zip(comparisons["run_id"], comparisons["dense_run_id"],
                                        strict=True) if isinstance(r, str) and isinstance(d, str)}
        found = with_paired_spikes(found, partner, runs_root)
    section: dict[str, Any] = {
        "spike_threshold": SPIKE_THRESHOLD, "spike_window": SPIKE_WINDOW,
        "paired_spike_threshold": PAIRED_SPIKE_THRESHOLD,
        "runs": len(found), "skipped_no_metrics": skipped, "configs": [], "plot": None,
    }
    if not found:
        return section, {}
    by_row = dict(found)
    runs = df.loc[list(by_row)]
    for key, g in runs.groupby(keys, dropna=False, sort=True):
        row = dict(zip(keys, key, strict=True))
        depth = f" L={int(row['n_layers'])}" if pd.notna(row.get("n_layers")) else ""
        dyns = [by_row[i] for i in g.index]
        section["configs"].append({
            "config": run_label(row) + depth,
            "tier": float(row["tier"]), "context": int(row["context"]),
            "width": int(row["width"]), "n": len(dyns),
            "seeds": sorted(int(x) for x in g["seed"]),
            "run_ids": [d["run_id"] for d in dyns],
            **summarise(dyns),
        })
    groups = [{**c, **_plot_names(c)} for c in section["configs"]]
    plot = plot_residual_rms(groups, Path(out_dir) / "residual_rms.png")
    section["plot"] = plot.name if plot is not None else None
    depth = plot_depth_hist(groups, Path(out_dir) / "depth_hist.png")
    section["depth_plot"] = depth.name if depth is not None else None
    return section, {d["run_id"]: d for _, d in found}


def paper_claims(
    df: pd.DataFrame, runs: dict[str, dict[str, Any]], out_dir: Path,
    curves: Sequence[dict[str, Any]] = (),
) -> dict[str, Any] | None:
    """The paper's claims (:func:`xmodlm.report.claims.claims`) with ``claims_k.png``,
    the loss against K (with the paper law's ``curves`` where the report has a fit),
    in ``out_dir``; None for a table not of the paper's construction."""
    from xmodlm.report.claims import claims
    from xmodlm.report.claims_plots import plot_loss_by_k

    section = claims(df, runs)
    if section is not None:
        plot = plot_loss_by_k(section["u_shape"], out_dir / "claims_k.png", curves)
        section["plot"] = plot.name if plot is not None else None
    return section


def _plot_names(config: dict[str, Any]) -> dict[str, str]:
    """A dynamics group's ``panel`` (the budget and context it was trained at: the
    same settings recur at each, and only runs of one budget compare) and its legend
    ``label`` within the panel (the configuration and its width d)."""
    return {"panel": f"budget {config['tier']:.2g} FLOPs, context {config['context']}",
            "label": f"{config['config']} d={config['width']}"}


def _with_dense_controls(
    raw: pd.DataFrame, controls: Sequence[str | Path]
) -> tuple[pd.DataFrame, list[dict[str, Any]]]:
    """``raw`` with the dense runs of each control table appended, marked ``_control``.

    A control is another sweep's results on the same budgets (a depth or width
    ladder of dense models): its dense runs join the dense ladder and the
    equal-size comparison, never the FLOP-matched pairing, which stays with the
    reference the routed runs were matched to. A run already in ``raw`` (same
    ``run_id``) is not counted twice."""
    parts, seen, summary = [raw.assign(_control=False)], set(), []
    if "run_id" in raw.columns:
        seen = set(raw["run_id"].dropna().astype(str))
    for path in controls:
        table = read_table(path)
        if "family" not in table.columns:
            raise UserError(f"dense control {str(path)!r} lacks column 'family';"
                            " `xmod sweep` writes it")
        dense = table[record.is_dense(table["family"].astype(str).str.strip().str.lower())]
        if "run_id" in dense.columns:
            dense = dense[~dense["run_id"].astype(str).isin(seen)]
            seen |= set(dense["run_id"].dropna().astype(str))
        summary.append({"path": str(path), "dense_runs": len(dense)})
        parts.append(dense.assign(_control=True))
    return pd.concat(parts, ignore_index=True), summary


def sweep_report(
    results: str | Path, out_dir: str | Path, law: str | Path | None = None,
    dense_controls: Sequence[str | Path] = (),
) -> dict[str, Any]:
    """Write ``report.md``, ``comparisons.csv`` and ``report.json`` for ``results``; return
    the JSON. ``dense_controls``: results tables whose dense runs join the dense ladder
    and the equal-size comparison (:func:`_with_dense_controls`)."""
    bar = Progress(4 + (law is not None), "report", unit="stage")
    raw = read_table(results)
    combined, controls = _with_dense_controls(raw, dense_controls)
    every, _ = finished_table(combined, results)
    left_out = finished_runs(raw)[1]  # of this sweep's runs; the controls' are theirs
    df = every[~every["_control"].astype(bool)].reset_index(drop=True)
    comparisons, unmatched = match_to_dense(df)
    bar.update(1, done="runs read and matched to dense")
    report: dict[str, Any] = {
        "results": str(results),
        "runs": {
            "finished": len(df),
            "left_out": left_out,
            "by_family": {k: int(v) for k, v in df["family"].value_counts().sort_index().items()},
        },
        "loss_source": every.attrs.get("loss_source"),
        "tiers": sorted(float(t) for t in df["tier"].unique()),
        "widths": sorted(int(w) for w in df["width"].unique()),
        "contexts": sorted(int(c) for c in df["context"].unique()),
        "seeds": sorted(int(s) for s in pd.to_numeric(df["seed"]).unique()),
        "unmatched": unmatched,
        "vs_dense": {},
        "vs_dense_by_tier": {},
        "vs_dense_by_config": {},
        "loss": "causal routing where recorded (top-k beside it)",
        "mixed_pairs": [],
        "paired": [],
        "learning_rates": learning_rates(df),
        "dense_controls": controls,
        "dense_ladder": dense_ladder(every),
        "equal_size": equal_size(every),
        "isoflop": isoflop(every, CONFIG_KEYS),
        "isoflop_plot": None,
        "causal_gap": None,
        "dynamics": None,
        "law": None,
        "headline": [],
        "claims": None,
        "mechanisms": [],
        "tasks": [],
    }
    report.update(against_dense(comparisons))  # the keys above keep their order
    report["causal_gap"] = causal_gap(df)
    bar.update(1, done="comparisons summarised")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot = plot_isoflop(report["isoflop"], out / "isoflop.png", config_label)
    report["isoflop_plot"] = plot.name if plot is not None else None
    report["dynamics"], run_records = dynamics(df, results, out, comparisons)
    bar.update(1, done="training dynamics read from the run records")
    fit = None
    paper_law = read_paper_law(str(law)) if law is not None else None
    if paper_law is not None:
        from xmodlm.report.paper_law_section import paper_law_section

        sweep_dir = Path(results) if Path(results).is_dir() else Path(results).parent
        report["law"] = paper_law_section(paper_law, law, raw, sweep_dir, out)
        bar.update(1, done="the paper's law summarised and plotted")
    elif law is not None:
        from xmodlm.law.lawfit import load_fit
        from xmodlm.report.law_plots import plot_law

        fit = load_fit(law)
        report["law"] = _law_section(fit, law)
        plots = plot_law(fit, raw, out / "plots")
        report["law"]["plots"] = [str(p.relative_to(out)) for p in plots]
        bar.update(1, done="law summarised and plotted")
    # after the law: a paper-law fit's curves are drawn on the claims' loss-against-K figure
    report["claims"] = paper_claims(df, run_records, out,
                                    (report["law"] or {}).get("loss_curves") or ())
    report["headline"] = headline(report["paired"], df, fit)
    atomic_write_text(out / "comparisons.csv", comparisons.to_csv(index=False))
    atomic_write_json(out / "report.json", report)
    atomic_write_text(out / "report.md", render_markdown(report, comparisons))
    bar.update(1, done="report written")
    bar.close()
    return report


