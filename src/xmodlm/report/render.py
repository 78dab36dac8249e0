"""The sweep report as Markdown: every number comes from the report's JSON
(:func:`xmodlm.report.sweep_report.sweep_report`) and its comparisons table, so
that ``report.md`` says nothing that ``report.json`` does not hold. The numbers
are computed in :mod:`xmodlm.report.analysis`; this module only words and formats
them, one function per section in the order the report reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from xmodlm.report.analysis import DEFAULT_OPTIMIZER, HEADLINE_FAMILIES, config_label, model_label
from xmodlm.report.claims_render import claims_markdown
from xmodlm.report.isoflop import isoflop_markdown


def _over_seeds_cells(stat: dict[str, Any]) -> str:
    """``mean +- SE | 95% interval | resolved`` of an :func:`over_seeds` summary."""
    se = f" +- {stat['se']:.3f}" if stat["se"] is not None else " (1 seed)"
    ci = f"[{stat['ci95'][0]:+.3f}, {stat['ci95'][1]:+.3f}]" if stat["ci95"] else "-"
    return f"{stat['mean']:+.3f}{se} | {ci} | {'yes' if stat['resolved'] else 'no'}"


def _fmt(x: float) -> str:
    return f"{x:+.3f}"


def render_markdown(report: dict[str, Any], comparisons: pd.DataFrame) -> str:
    """The report as Markdown (every number from ``report`` / ``comparisons``)."""
    runs = report["runs"]
    fams = ", ".join(f"{n} {k}" for k, n in runs["by_family"].items())
    lines = [
        f"# Sweep report: `{report['results']}`",
        "",
        f"{runs['finished']} finished runs ({fams}); {runs['left_out']} left out as not finished.",
        f"Compute tiers {', '.join(f'{t:.2g}' for t in report['tiers'])};"
        f" widths {report['widths']}; contexts {report['contexts']}; seeds {report['seeds']}.",
        "Losses: " + (f"each final checkpoint on the whole `{report['loss_source']}` split."
                      if report.get("loss_source") else
                      "each run's last in-training validation evaluation."),
        *_headline_markdown(report.get("headline") or []),
        *claims_markdown(report.get("claims"), report.get("law")),
        *_vs_dense_markdown(report, comparisons),
        *_over_seeds_markdown(report),
        *_learning_rates_markdown(report["learning_rates"]),
        *_dense_ladder_markdown(report),
        *_mixed_pairs_markdown(report.get("mixed_pairs") or []),
        *_equal_size_markdown(report["equal_size"]),
        *isoflop_markdown(report.get("isoflop") or [], config_label, report.get("isoflop_plot")),
        *_causal_gap_markdown(report["causal_gap"]),
        *_dynamics_markdown(report.get("dynamics")),
        *_law_markdown(report["law"]),
    ]
    return "\n".join(lines) + "\n"


def _vs_dense_markdown(report: dict[str, Any], comparisons: pd.DataFrame) -> list[str]:
    """Each family, budget and configuration against its FLOP-matched dense runs, and
    the runs that beat theirs."""
    lines = [
        "",
        "## Against the FLOP-matched dense model",
        "",
        "Difference in causal-routing held-out loss (nats), run minus its dense reference"
        " of the same context, width, seed and budget; positive means the dense model is"
        " better.",
        "",
    ]
    if report["vs_dense"]:
        lines += ["| group | runs | lose to dense | median | best | worst |", "|---|---|---|---|---|---|"]
        tables = (
            ("", report["vs_dense"]),
            ("C = ", report["vs_dense_by_tier"]),
            ("", report["vs_dense_by_config"]),
        )
        for title, table in tables:
            for key, s in table.items():
                lines.append(
                    f"| {title}{key} | {s['n']} | {s['lose']} | {_fmt(s['median'])} |"
                    f" {_fmt(s['best'])} | {_fmt(s['worst'])} |"
                )
        wins = comparisons[comparisons["delta"] < 0].sort_values("delta")
        if len(wins):
            lines += ["", f"Runs that beat their dense reference ({len(wins)}):", ""]
            for _, w in wins.iterrows():
                lines.append(
                    f"* C = {w['tier']:.2g}, T = {w['context']}, width {w['width']},"
                    f" {model_label(w.to_dict())}: {_fmt(w['delta'])}"
                )
    else:
        lines.append("No non-dense run has a FLOP-matched dense reference in this table.")
    if report["unmatched"]:
        lines += ["", f"{report['unmatched']} non-dense runs have no dense reference and are not compared."]
    return lines


def _over_seeds_markdown(report: dict[str, Any]) -> list[str]:
    """The paired differences over seeds: per configuration, per downstream task and
    per mechanism (empty sections are left out)."""
    lines: list[str] = []
    if report["paired"]:
        lines += [
            "",
            "### Per configuration, paired over seeds",
            "",
            "Mean +- standard error of the paired difference (causal; top-k mean beside it);"
            " resolved when the 95% t-interval excludes zero (never with one seed).",
            "",
            "| C | T | width | configuration | seeds | mean +- SE | 95% interval | resolved | top-k mean |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for p in report["paired"]:
            lines.append(
                f"| {p['tier']:.2g} | {p['context']} | {p['width']} | {p['config']} | {p['n']} |"
                f" {_over_seeds_cells(p)} | {p['mean_topk']:+.3f} |"
            )
    if report.get("tasks"):
        lines += [
            "", "### Downstream tasks, paired over seeds", "",
            "Accuracy on the offline tasks (each run's final checkpoint, causal routing;"
            " `eval.json`) minus its dense run's, mean +- standard error over seeds;"
            " positive: the routed model is better.", "",
            "| C | T | width | configuration | task | seeds | mean +- SE | 95% interval |"
            " resolved |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for t in report["tasks"]:
            lines.append(f"| {t['tier']:.2g} | {t['context']} | {t['width']} | {t['config']} |"
                         f" {t['task']} | {t['n']} | {_over_seeds_cells(t)} |")
    if report.get("mechanisms"):
        lines += [
            "", "### Mechanisms, all else equal", "",
            "Each level minus the reference level of one mechanism, the other mechanisms,"
            " budget, context, width, learning rate and seed held equal (causal loss, nats);"
            " averaged over the matched cells within a seed, then mean +- standard error over"
            " seeds. Negative: the level is better than the reference. *within*: all matched"
            " pairs (the main effect), or only those at one level of another mechanism"
            " (where the effect depends on it, the main effect misleads).", "",
            "| mechanism | level | reference | within | matched pairs | seeds | mean +- SE |"
            " 95% interval | resolved |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for m in report["mechanisms"]:
            within = ", ".join(f"{f} {v}" for f, v in (m.get("within") or {}).items()) or "all"
            lines.append(
                f"| {m['factor']} | {m['level']} | {m['reference']} | {within} | {m['pairs']} |"
                f" {m['seeds']} | {_over_seeds_cells(m)} |"
            )
    return lines


def _learning_rates_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """Each model tried at several peak learning rates, the best one in bold."""
    lines: list[str] = []
    if rows:
        lines += ["", "## Peak learning rate", "",
                  "Models tried at two or more peak learning rates. Causal held-out loss"
                  " on the seeds every rate has (the best in bold: seed noise is as large as"
                  " the rates' effect, so rates are compared on shared seeds), then the mean"
                  " +- standard error over all seeds of each rate.", ""]
        for m in rows:
            shared = m.get("common_seeds") or []

            def bold(e: dict[str, Any], text: str, m: dict[str, Any] = m) -> str:
                return f"**{text}**" if e["lr"] == m["best_lr"] else text

            on = (f"seed{'s' if len(shared) > 1 else ''} {', '.join(map(str, shared))}: "
                  + ", ".join(bold(e, f"{e['lr']:g}: {e['mean_common']:.4f}")
                              for e in m["by_lr"]) + "; all seeds: ") if shared else ""
            cells = ", ".join(
                (f"{e['lr']:g}: {e['mean']:.4f}" if shared
                 else bold(e, f"{e['lr']:g}: {e['mean']:.4f}"))
                + (f" +- {e['se']:.4f}" if e["se"] is not None else "") + f" (n={e['n']})"
                for e in m["by_lr"]
            )
            edge = " (best at the edge of the tried range)" if m["best_at_edge"] else ""
            lines.append(f"* {m['model']}, C = {m['tier']:.2g}, T = {m['context']}:"
                         f" {on}{cells}{edge}")
    return lines


def _dense_ladder_markdown(report: dict[str, Any]) -> list[str]:
    """Every dense shape per budget against the best one, whether the best is at the
    edge of the sizes tried, and where dense runs of control sweeps joined."""
    lines = [
        "", "## Dense ladder", "",
        "Dense shapes on one budget: mean loss +- SE over seeds (n), and each shape minus the"
        " best one, paired by seed (* where the 95% interval excludes zero). The best is"
        " judged on the seeds every shape has.", "",
        "| context | C | width | blocks | lr | active params | loss | minus best |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d in report["dense_ladder"]:
        for e in d["shapes"]:
            se = f" +- {e['se']:.4f}" if e["se"] is not None else ""
            versus = _diff_cell(e["minus_best"]) if "minus_best" in e else "best"
            lr = f"{e['lr']:g}" if e["lr"] is not None else "-"
            lr += f" {e['optimizer']}" if e["optimizer"] != DEFAULT_OPTIMIZER else ""
            params = f"{e['params_active'] / 1e6:.2f}M" if e["params_active"] is not None else "-"
            depth = e["n_layers"] if e["n_layers"] is not None else "-"
            lines.append(f"| {d['context']} | {d['tier']:.2g} | {e['width']} | {depth} |"
                         f" {lr} | {params} | {e['mean']:.4f}{se} ({e['n']}) | {versus} |")
    edges = sum(d["at_edge"] for d in report["dense_ladder"])
    if edges:
        lines += [
            "",
            f"At {edges} of {len(report['dense_ladder'])} budgets the best dense shape is the"
            " smallest or the largest tried: the compute-optimal size is not bracketed there, and"
            " a dense law fitted on these runs extrapolates its optimum.",
        ]
    if report["dense_controls"]:
        lines += ["", "Dense runs from control sweeps on the same budgets join the ladder (never"
                  " the FLOP-matched pairing): " + "; ".join(
                      f"`{c['path']}` ({c['dense_runs']} runs)" for c in report["dense_controls"]
                  ) + "."]
    return lines


def _mixed_pairs_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The compared pairs whose two runs differ in machine, dtype or compile mode."""
    lines: list[str] = []
    if rows:
        lines += ["", f"**{len(rows)} compared pairs mix CPU kinds, dtypes or"
                  " compile modes** (each such pair is two draws, not one paired comparison):", ""]
        lines += [f"* {m['run_id']} vs {m['dense_run_id']}: {m['mixed']}" for m in rows]
    return lines


def _causal_gap_markdown(gap: dict[str, Any] | None) -> list[str]:
    """How much the causal decision costs the routed runs against top-k routing."""
    lines: list[str] = []
    if gap:
        rule = f" ({gap['rule']} threshold)" if gap.get("rule") else ""
        half = gap.get("half")
        lines += [
            "",
            "## Causal routing at inference",
            "",
            f"Causal{rule} minus top-k held-out loss over {gap['n']} routed runs: median"
            f" {_fmt(gap['median'])} (range {_fmt(gap['min'])} to {_fmt(gap['max'])})."
            + (f" Under the fixed threshold of 1/2, over {half['n']}: median"
               f" {_fmt(half['median'])} (range {_fmt(half['min'])} to {_fmt(half['max'])})."
               if half else ""),
        ]
    return lines


def _law_markdown(law: dict[str, Any] | None) -> list[str]:
    """The law section: the fit, its selected delta form with intervals, which terms the
    data resolve, held-out scores and the law's plots (a fit of the paper's law has its
    own, :mod:`xmodlm.report.paper_law_section`)."""
    if law and law.get("kind") == "paper":
        from xmodlm.report.paper_law_section import paper_law_markdown

        return paper_law_markdown(law)
    lines: list[str] = []
    if law:
        baseline = ("each sparse run's delta measured against its FLOP-matched dense run"
                    if law.get("baseline") == "paired"
                    else "each sparse run's delta measured against the dense law at its own size")
        lines += ["", "## Law", "", f"Fit `{law['path']}` ({law['runs']['n']} runs; {baseline})."]
        if law.get("selected"):
            lines += ["", f"Selected delta form `{law['selected']}`: {law['why']}.", ""]
            lines += ["| parameter | value | 95% interval |", "|---|---|---|"]
            for k, v in law["params"].items():
                lines.append(f"| {k} | {v['value']:.4g} | [{v['ci'][0]:.4g}, {v['ci'][1]:.4g}] |")
            lines += ["", "Resolved: the term's coefficient was fitted and its 95% interval"
                      " excludes zero.", "", "| term | coefficient | value | resolved |",
                      "|---|---|---|---|"]
            for term, t in law.get("terms", {}).items():
                state = ("held at 0 (the data cannot show it)" if t["fixed"]
                         else "no (the delta law is not identified)" if t.get("flagged")
                         else "yes" if t["resolved"] else "no")
                lines.append(f"| {term} | {t['param']} | {t['value']:.4g} | {state} |")
        held = law["metrics"].get("heldout") or {}
        by_protocol = law["metrics"].get("heldout_by_protocol") or {}
        if by_protocol:
            lines += _protocols_markdown(by_protocol, law["metrics"].get("heldout_protocol"))
        elif held:
            ratio = held.get("ratio")
            tau = held.get("kendall_tau")
            lines += [
                "",
                f"Held-out ({law['metrics'].get('heldout_protocol')}): RMSE of ln L"
                f" {held['rmse']:.4f} vs {held['in_fit_rmse']:.4f} in fit"
                + (f" (ratio {ratio:.2f})" if ratio is not None else "")
                + (f", Kendall tau {tau:.2f}" if tau is not None else "")
                + ".",
            ]
        for p in law.get("plots", []):
            lines += ["", f"![{Path(p).stem}]({p})"]
    return lines


FAMILY_NAMES = {"xmod": "X-MoD", "mod": "MoD", "moe": "MoE"}


def _headline_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The :func:`headline` table: routed families minus dense per context and budget."""
    if not rows:
        return []
    fams = [f for f in HEADLINE_FAMILIES if any(f in r["families"] for r in rows)]
    with_law = any("law" in r for r in rows)
    head = ["T", "C", "width", *(FAMILY_NAMES[f] for f in fams)] + (["law recommends"] if with_law else [])
    lines = [
        "", "## Headline", "",
        "Each routed family's headline configuration (its one with the most seeds in the"
        " cell) minus the FLOP-matched dense run of the same seed: causal-routing validation"
        " loss, nats, mean +- standard error over seeds (n); * where the 95% interval excludes"
        " zero. Negative: the routed model is better."
        + (" Law: `xmod recommend` at the cell's budget, context and dense size; P is the"
           " smaller of P(beats dense) and P(routing helps), which must both reach its"
           " threshold, and a law flagged as not identified gives no sparse answer."
           if with_law else ""), "",
        "| " + " | ".join(head) + " |", "|" + "---|" * len(head),
    ]
    configs: dict[str, set[str]] = {}
    for r in rows:
        cells = [str(r["context"]), f"{r['tier']:.2g}", str(r["width"])]
        for f in fams:
            p = r["families"].get(f)
            if p is None:
                cells.append("-")
                continue
            if "tied" in p:
                cells.append(f"- ({p['tied']} configurations with {p['n']} seed{'s' if p['n'] != 1 else ''})")
                continue
            configs.setdefault(f, set()).add(p["config"])
            se = f" +- {p['se']:.3f}" if p["se"] is not None else ""
            cells.append(f"{p['mean']:+.3f}{se} ({p['n']}){'*' if p['resolved'] else ''}")
        if with_law:
            law = r.get("law") or {}
            top = law.get("top")
            answer = law.get("answer") or "-"
            if top is not None:
                p = min(top["p_beats_dense"], top["p_routing_helps"])
                answer += (f" (best sparse: S={top['stride']} c={top['capacity']:g},"
                           f" {top['vs_dense']:+.3f} predicted, P {p:.2f}"
                           + ("; law not identified" if not law.get("identified", True) else "")
                           + ")")
            cells.append(answer)
        lines.append("| " + " | ".join(cells) + " |")
    if configs:
        lines.append("")
    for f in fams:
        if configs.get(f):
            lines.append(f"* {FAMILY_NAMES[f]}: {'; '.join(sorted(configs[f]))}")
    return lines


def _protocols_markdown(by_protocol: dict[str, dict[str, Any]], selecting: str | None) -> list[str]:
    """The selected law's held-out scores under each protocol, one row each."""
    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else f"{x:{fmt}}"

    lines = ["", "Held-out scores of the selected law (RMSE of ln L on the held-out runs;"
             " ratio: to the in-fit RMSE of the same refits; Kendall tau and regret within each"
             " choice of configuration):", "",
             "| protocol | runs | RMSE | ratio | Kendall tau | regret |", "|---|---|---|---|---|---|"]
    for protocol, m in by_protocol.items():
        name = protocol + (" (selects the form)" if protocol == selecting else "")
        if "rmse" not in m:
            why = m.get("not_applicable") or m.get("failed") or "-"
            lines.append(f"| {name} | - | {why} | | | |")
            continue
        lines.append(f"| {name} | {m['n']} | {m['rmse']:.4f} | {num(m['ratio'], '.2f')} |"
                     f" {num(m['kendall_tau'], '.2f')} | {num(m['regret'], '.4f')} |")
    return lines


def _diff_cell(stat: dict[str, Any] | None) -> str:
    """``mean +- SE (n)`` of a paired difference, ``*`` when resolved; ``-`` without."""
    if stat is None:
        return "-"
    se = f" +- {stat['se']:.3f}" if stat["se"] is not None else ""
    return f"{stat['mean']:+.3f}{se} ({stat['n']}){'*' if stat['resolved'] else ''}"


def _equal_size_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The section of :func:`equal_size`: empty where no budget has dense at two sizes."""
    if not rows:
        return []
    lines = [
        "", "## At equal active size", "",
        "Each routed configuration minus dense of its own active size on the same budget:"
        " per seed, the dense loss interpolated linearly in ln N_active between the two dense"
        " shapes that bracket it (same context, budget and peak learning rate), then paired over"
        " seeds (* where the 95% interval excludes zero). FLOP matching gives a routed model more"
        " or fewer active parameters than its dense partner, and on a short budget size alone"
        " moves the loss; this takes the size out. Beside it, the paired difference to the"
        " budget's best dense shape, whatever its size.", "",
        "| T | C | width | configuration | active params | dense between | minus dense at its size"
        " | 95% interval | minus best dense |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        stat = r["minus_dense_at_size"]
        if stat is None:
            lo, hi = r["dense_sizes"]
            between = f"outside {lo / 1e6:.2f}M-{hi / 1e6:.2f}M"
            ci = "-"
        else:
            between = " and ".join(f"{b['params_active'] / 1e6:.2f}M" for b in r["bracket"])
            ci = f"[{stat['ci95'][0]:+.3f}, {stat['ci95'][1]:+.3f}]" if stat["ci95"] else "-"
        lr = f" lr={r['lr']:g}" if r["lr"] is not None else ""
        depth = f" L={r['n_layers']}" if r["n_layers"] is not None else ""
        best = r["best_dense"]
        shape = ", ".join(
            ([f"width {best['width']}"] if best["width"] != r["width"] or best["n_layers"] is None
             else []) + ([f"{best['n_layers']} blocks"] if best["n_layers"] is not None else [])
        )
        lines.append(
            f"| {r['context']} | {r['tier']:.2g} | {r['width']} | {r['config']}{depth}{lr} |"
            f" {r['params_active'] / 1e6:.2f}M | {between} | {_diff_cell(stat)} | {ci} |"
            f" {shape}: {_diff_cell(r['minus_best_dense'])} |"
        )
    return lines


def _pm(stat: dict[str, Any] | None, fmt: str, index: int | None = None) -> str:
    """``mean +- SE`` of a :func:`~xmodlm.report.dynamics.mean_se` summary (an element
    of a per-block one with ``index``); the mean alone from one seed, ``-`` without.
    ``fmt`` is a format spec, or ``sig3`` for figures whose scale varies by orders
    of magnitude (the residual RMS: 0.02 at init, up to 70 trained)."""
    if stat is None:
        return "-"
    mean, se = stat["mean"], stat["se"]
    if index is not None:
        mean, se = mean[index], (se[index] if se is not None else None)
    if fmt == "sig3":  # three significant digits in the mean, the error to the same place
        places = max(0, 2 - int(np.floor(np.log10(abs(mean))))) if mean else 3
        fmt = f".{places}f"
    return f"{mean:{fmt}}" + (f" +- {se:{fmt}}" if se is not None else "")


def _dynamics_markdown(dyn: dict[str, Any] | None) -> list[str]:
    """The training-dynamics section of ``report.md`` (nothing when it was not computed)."""
    if dyn is None:
        return []
    lines = ["", "## Training dynamics", ""]
    if not dyn["configs"]:
        return lines + [f"No run records with metrics.jsonl beside the table"
                        f" ({dyn['skipped_no_metrics']} runs skipped)."]
    sources = sorted({s for c in dyn["configs"] for s in c["init_tokens"]})
    lines += [
        f"From the metrics.jsonl of {dyn['runs']} runs"
        + (f" ({dyn['skipped_no_metrics']} without one skipped)" if dyn["skipped_no_metrics"]
           else "")
        + "; mean +- standard error over seeds. Spikes: logged training steps after warmup"
        f" whose loss exceeds the median of the {dyn['spike_window']} logged losses before it"
        f" by more than {dyn['spike_threshold']:g} nats; spikes vs dense: the same rule on"
        " the loss minus the FLOP-matched dense run's at the same step (same seed, so the"
        f" same batches) with {dyn.get('paired_spike_threshold', 0.2):g} nats. Gradient norm"
        " (before clipping):"
        " largest and 99th percentile of the logged steps after warmup. Residual RMS of the"
        f" last block at init ({'; '.join(sources) or 'no record of it and no config'}) and at"
        " the last evaluation; every block in"
        " `residual_rms.png`. Routing at the last evaluation: coverage and Jaccard overlap"
        " averaged over windows and consecutive sparse blocks; depth sd: the standard deviation"
        " of the number of sparse blocks a token passes through (its mean is fixed by the"
        " capacity); the whole histogram in `depth_hist.png`.",
        "",
        "| C | T | width | configuration | seeds | spikes | spikes vs dense | max grad norm |"
        " p99 grad norm | last-block RMS init | last-block RMS end | coverage | depth sd |"
        " Jaccard |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in dyn["configs"]:
        lines.append(
            f"| {c['tier']:.2g} | {c['context']} | {c['width']} | {c['config']} | {c['n']} |"
            f" {_pm(c['spikes'], '.2f')} | {_pm(c.get('paired_spikes'), '.2f')} |"
            f" {_pm(c['grad_norm_max'], '.3f')} |"
            f" {_pm(c['grad_norm_p99'], '.3f')} | {_pm(c['residual_rms_init'], 'sig3', -1)} |"
            f" {_pm(c['residual_rms_end'], 'sig3', -1)} | {_pm(c['coverage_mean'], '.3f')} |"
            f" {_pm(c['sparse_depth_sd'], '.3f')} | {_pm(c['jaccard_mean'], '.3f')} |"
        )
    if dyn["plot"]:
        lines += ["", f"![residual RMS per block]({dyn['plot']})"]
    if dyn.get("depth_plot"):
        lines += ["", f"![sparse depth per token]({dyn['depth_plot']})"]
    return lines
