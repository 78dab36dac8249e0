"""The report's section on the paper's claims, worded: every number comes from the
``claims`` part of ``report.json`` (:func:`xmodlm.report.claims.claims`), the
paper's figure beside each of ours. One function per claim, in the claims' order."""

from __future__ import annotations

from typing import Any

from xmodlm.report.claims import ABLATIONS


def _stat(s: dict[str, Any] | None) -> str:
    """A paired difference over seeds in one phrase: mean +- SE, 95% interval, n and
    whether the interval excludes zero; ``-`` without one."""
    if s is None:
        return "-"
    if s["se"] is None:
        return f"{s['mean']:+.3f} (1 seed, no interval)"
    lo, hi = s["ci95"]
    mixed = f", {s['mixed_pairs']} pairs across machines" if s.get("mixed_pairs") else ""
    return (f"{s['mean']:+.3f} +- {s['se']:.3f} [{lo:+.3f}, {hi:+.3f}] ({s['n']} seeds"
            f"{mixed}){' resolved' if s['resolved'] else ''}")


def _pm(s: dict[str, Any] | None, fmt: str) -> str:
    """``mean +- SE (n)`` of a :func:`~xmodlm.report.dynamics.mean_se` summary."""
    if s is None:
        return "-"
    se = f" +- {s['se']:{fmt}}" if s["se"] is not None else ""
    return f"{s['mean']:{fmt}}{se} ({s['n']})"


def claims_markdown(claims: dict[str, Any] | None, law: dict[str, Any] | None = None
                    ) -> list[str]:
    """The section; nothing when the table is not of the paper's construction. ``law``:
    the report's law section, whose held-out and unseen-run scores are the law's claim
    when it is a fit of the paper's law."""
    if claims is None:
        return []
    paper = claims["paper"]
    return [
        "", "## The paper's claims", "",
        "Each claim of the X-MoD paper beside this sweep's figure. Loss: causal routing,"
        " nats. The main model is the paper's recipe (token-choice bias, variance-scaled"
        " gate, dense anchors, a dense prefix) at A = 1; dense is K = 1. Differences are"
        " a run minus its FLOP-matched partner of the same seed (same CPU kind, dtype and"
        " compile mode where there is one): mean +- SE over seeds [95% t-interval],"
        " *resolved* when the interval excludes zero.",
        *_u_shape(claims["u_shape"], paper, claims.get("plot")),
        *_growth(claims["growth"], paper),
        *_best_vs_dense(claims["best_vs_dense"], paper),
        *_ablations(claims["ablations"], paper),
        *_moe(claims["moe"]),
        *_routing(claims.get("routing_bias")),
        *_step_time(claims.get("step_time")),
        *_law(law, paper),
    ]


def _law(law: dict[str, Any] | None, paper: dict[str, Any]) -> list[str]:
    """The law's claim in one table: its grouped held-out errors and its predictions
    for runs it did not see, each beside the constant-Delta baseline."""
    if not law or law.get("kind") != "paper":
        return []
    from xmodlm.report.paper_law_section import heldout_table, unseen_table

    fit = law.get("in_fit") or {}
    lines = ["", "### The law", "", f"Paper: {paper['law']}. Ours: Eq. 14 fitted on"
             f" {fit.get('n', '?')} runs (R^2_Delta {fit.get('r2_delta', float('nan')):.3f},"
             f" RMSE {fit.get('rmse', float('nan')):.4f}); the law section below has its"
             " parameters and plots."]
    return lines + heldout_table(law) + unseen_table(law.get("unseen"))


def _u_shape(entries: list[dict[str, Any]], paper: dict[str, Any], plot: str | None) -> list[str]:
    ks = sorted({p["K"] for e in entries for p in e["by_k"]})
    head = ["L", "C", *(("K=1 (dense)" if k == 1 else f"K={k:g}") for k in ks), "judged on",
            "lowest", "interior"]
    lines = ["", "### 1. A U in K at every context", "", f"Paper: {paper['u_shape']}."
             " Ours: mean loss over the seeds each K has (n); one seed has no error bar."
             " The lowest K is judged on the seeds every K of the context has (judged on),"
             " so that seeds' luck does not rank a three-seed mean against one seed.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in entries:
        at = {p["K"]: p for p in e["by_k"]}
        cells = [f"{at[k]['mean']:.4f} ({at[k]['n']})" if k in at else "-" for k in ks]
        common = e["common_seeds"]
        seeds = (("seed " if len(common) == 1 else "seeds ") + ", ".join(map(str, common))
                 if common else "all (no seed in common)")
        lines.append(f"| {e['context']} | {e['tier']:.2g} | " + " | ".join(cells)
                     + f" | {seeds} | K={e['argmin']:g} | {'yes' if e['interior'] else 'no'} |")
    interior = sum(e["interior"] for e in entries)
    lines += ["", f"The lowest K is interior (a U) at {interior} of {len(entries)} contexts."]
    if plot:
        lines += ["", f"![loss against K]({plot})"]
    return lines


def _growth(growth: dict[str, Any], paper: dict[str, Any]) -> list[str]:
    lines = ["", "### 2. The best K grows with the context", "",
             f"Paper: K* grows about as L^{paper['exponent']:g}. Ours: K* is the vertex of the"
             " parabola in ln K through the lowest K and its two neighbours, or that K itself"
             " where it is the smallest or largest run (an edge: the minimum is not"
             " bracketed and K* is a bound).", ""]
    lines += [f"* L = {s['context']}: K* = {s['k_star']:.2f}"
              + (" (edge)" if s["at_edge"] else
                 f" (through K = {', '.join(f'{k:g}' for k in s['through'])})")
              for s in growth["by_context"]]
    if growth["exponent"] is None:
        lines += ["", f"Exponent not fitted: {growth['why']}."]
    else:
        lo, hi = growth["ci95"]
        edge = (f"; K* at the edge at L = {', '.join(map(str, growth['at_edge']))}, so the"
                " slope leans on bounds there" if growth["at_edge"] else "")
        lines += ["", f"Slope of ln K* against ln L (least squares over {growth['n']} contexts):"
                  f" {growth['exponent']:.3f} +- {growth['se']:.3f} [{lo:.3f}, {hi:.3f}]{edge}."]
    return lines


def _best_vs_dense(entries: list[dict[str, Any]], paper: dict[str, Any]) -> list[str]:
    lines = ["", "### 3. The best X-MoD against dense", "",
             f"Paper: {paper['best_vs_dense']}. Ours: the best K is chosen on seed 0 alone;"
             " the choice favours seed 0's difference, so the seeds other than 0 give the"
             " estimate free of it.", "",
             "| L | C | best (seed 0) | minus dense, every seed | minus dense, seeds other than 0 |",
             "|---|---|---|---|---|"]
    for e in entries:
        lines.append(f"| {e['context']} | {e['tier']:.2g} | {e['model']} | {_stat(e['all_seeds'])}"
                     f" | {_stat(e['other_seeds'])} |")
    return lines


def _ablations(entries: list[dict[str, Any]], paper: dict[str, Any]) -> list[str]:
    if not entries:
        return []
    lines = ["", "### 4. Ablations", "",
             "Each ablation minus the full model, paired by seed; positive: the removed"
             " mechanism helps. Rank by our mean (1: removing it costs most).", ""]
    for e in entries:
        ours = ", ".join(a["name"] for a in e["ablations"])
        theirs = ", ".join(ABLATIONS[v] for v in sorted(paper["ablations"],
                                                         key=lambda v: -paper["ablations"][v]))
        lines += [f"{e['model']} at L = {e['context']}, C = {e['tier']:.2g}:", "",
                  "| ablation | paper | ours | rank |", "|---|---|---|---|"]
        lines += [f"| {a['name']} | {a['paper']:+.3f} | {_stat(a)} | {a['rank']} |"
                  for a in e["ablations"]]
        lines += ["", f"Ranking, ours: {ours}; paper: {theirs}.", ""]
    return lines[:-1]


def _moe(entries: list[dict[str, Any]]) -> list[str]:
    if not entries:
        return []
    lines = ["", "### 5. X-MoD against MoE at similar total parameters", "",
             "The main X-MoD whose total parameters are nearest the MoE's (within"
             f" {entries[0]['tolerance']:.0%}), paired by seed.", ""]
    for e in entries:
        head = f"* L = {e['context']}, C = {e['tier']:.2g}: MoE {e['moe_params_total'] / 1e6:.2f}M"
        if e["model"] is None:
            lines.append(f"{head} total parameters; no X-MoD within"
                         f" {e['tolerance']:.0%} of them. MoE minus dense"
                         f" {_stat(e['moe_minus_dense'])}.")
            continue
        lines.append(f"{head}, {e['model']} {e['xmod_params_total'] / 1e6:.2f}M total parameters."
                     f" {e['model']} minus MoE {_stat(e['xmod_minus_moe'])}; {e['model']} minus"
                     f" dense {_stat(e['xmod_minus_dense'])}; MoE minus dense"
                     f" {_stat(e['moe_minus_dense'])}.")
    return lines


def _routing(entries: list[dict[str, Any]] | None) -> list[str]:
    if not entries:
        return []
    lines = ["", "### 6. Routing with and without the token-choice bias", "",
             "At the last evaluation, from the run records: coverage and the Jaccard overlap"
             " of adjacent sparse blocks (as in the training-dynamics section), mean +- SE"
             " over runs (n); the full model's runs are the ablation's partners.", "",
             "| model | L | C | bias | coverage | Jaccard |", "|---|---|---|---|---|---|"]
    for e in entries:
        for side, word in (("with_bias", "with"), ("without_bias", "without")):
            s = e[side]
            lines.append(f"| {e['model']} | {e['context']} | {e['tier']:.2g} | {word} |"
                         f" {_pm(s['coverage'], '.3f')} | {_pm(s['jaccard'], '.3f')} |")
    return lines


def _step_time(entries: list[dict[str, Any]] | None) -> list[str]:
    if not entries:
        return []
    lines = ["", "### 7. Step time", "",
             "Median seconds per optimiser step of each run (its logged steps), mean +- SE"
             " over runs (n), and the ratio to dense. A sweep's runs share their machine (two at"
             " a time in the paper-cpu studies), and a neighbour slows a run unevenly: these"
             " ratios are indicative, not a benchmark.", "",
             "| L | C | model | s / step | ratio to dense |", "|---|---|---|---|---|"]
    for e in entries:
        for m in e["models"]:
            ratio = f"{m['ratio_to_dense']:.2f}" if m["ratio_to_dense"] is not None else "-"
            lines.append(f"| {e['context']} | {e['tier']:.2g} | {m['model']} |"
                         f" {_pm(m, '.3f')} | {ratio} |")
        if e["cpu_kinds"]:
            lines.append(f"\nCPU: {'; '.join(e['cpu_kinds'])}.")
    return lines
