"""``xmod law fit``, ``law predict`` and ``recommend``: the scaling law from a results
table, and what it says to train.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xmodlm.cli.common import (
    Parser,
    check_out_dir,
    check_out_file,
    count_int,
    finite,
    positive,
    print_json,
    seed_int,
)


class _LazyChoices:
    """argparse ``choices`` read on first use (the law registry imports pandas)."""

    def __init__(self, load: Callable[[], list[str]]) -> None:
        self._load = load
        self._items: list[str] | None = None

    def _all(self) -> list[str]:
        if self._items is None:
            self._items = self._load()
        return self._items

    def __contains__(self, item: object) -> bool:
        return item in self._all()

    def __iter__(self) -> Any:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


def _delta_forms() -> list[str]:
    from xmodlm.law.delta import FORMS

    return ["auto", "paper", *FORMS]


PAPER_BOOT = 200  # each replicate of the paper's fit is two differential evolutions
LN_RATIO_BOOT = 1000


def _out_of_range(text: str) -> tuple[str, float]:
    """``column=threshold`` of an out-of-range group (runs at or above it)."""
    key, sep, value = text.partition("=")
    try:
        if not sep or not key.strip():
            raise ValueError
        return key.strip(), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected COLUMN=THRESHOLD, e.g. context=65536") from None


def law_args(sub: argparse._SubParsersAction) -> None:
    """``xmod law``'s arguments, beside the command that reads them."""
    p = sub.add_parser("law", help="fit and apply the X-MoD scaling law")
    law_sub = p.add_subparsers(dest="law_command", required=True, parser_class=Parser)
    p = law_sub.add_parser("fit", help="fit the dense law and the X-MoD delta law")
    p.add_argument("results", help="results table (CSV or Parquet)")
    p.add_argument("--form", default="auto", choices=_LazyChoices(_delta_forms),
                   help="paper: the paper's Eq. 14 on the additive residual, fitted its way;"
                   " else an ln-ratio delta form (auto: chosen by held-out error)")
    p.add_argument("--curves", default=None, metavar="SWEEP_DIR",
                   help="--form paper: the sweep whose runs' metrics.jsonl give the dense"
                   " validation curves (default: each dense run's final point only)")
    p.add_argument("--out-of-range", type=_out_of_range, action="append", default=None,
                   metavar="COLUMN=THRESHOLD",
                   help="--form paper: runs at or above this value are named out of range"
                   " before fitting, left out and predicted (repeatable; e.g. context=65536)")
    p.add_argument("--holdout", default=None,
                   help="leave-cell-out | top-compute | longest-context; with --form paper:"
                   " leave-context-out,leave-scale-out,leave-a-out (default all) or none")
    p.add_argument("--n-boot", type=int, default=None,
                   help=f"bootstrap replicates (at least 100; default {LN_RATIO_BOOT}, or"
                   f" {PAPER_BOOT} with --form paper, where 0 skips it)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the bootstrap")
    p.add_argument("--loss", default="causal", choices=["causal", "topk"],
                   help="validation loss to fit (default causal: what decoding gets)")
    p.add_argument("--min-steps", type=int, default=1000,
                   help="leave out runs with fewer optimiser steps (default 1000; 0 keeps all)")
    p.add_argument("--family", default="xmod",
                   help="sparse family or variant the delta law is fitted on (default xmod)")
    p.add_argument("--baseline", default="law", choices=["law", "paired"],
                   help="what each sparse run's delta is measured against: the dense law at its"
                   " own size (law, default) or its FLOP-matched dense run (paired)")
    p.add_argument("--lr", type=positive, default=None,
                   help="fit the runs at this peak learning rate (default: the most common)")
    p.add_argument("--out", default=None, help="write the fit JSON here (for predict/recommend)")
    p.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots here")
    p.add_argument("--json", action="store_true", help="print the fit as JSON (a summary)")
    p.add_argument("--samples", action="store_true",
                   help="with --json: include the bootstrap samples")
    p.add_argument("--quiet", action="store_true",
                   help="no progress on stderr (else a bar on a terminal, plain lines when piped)")
    p.set_defaults(func=cmd_law_fit)
    p = law_sub.add_parser("predict", help="predict losses for the rows of a table")
    p.add_argument("fit", help="fit JSON from `xmod law fit --out`")
    p.add_argument("--input", required=True, help="table of configurations (CSV or Parquet)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_law_predict)


def cmd_law_fit(args: argparse.Namespace) -> int:
    from xmodlm.law.fit import fit_law
    from xmodlm.law.table import read_table

    if args.out:
        check_out_file(args.out, (".json",))
    if args.plots:
        check_out_dir(args.plots, None, "--plots")
    if args.form == "paper":
        return _fit_paper(args)
    if args.curves or args.out_of_range:
        from xmodlm.errors import UserError

        raise UserError("--curves and --out-of-range apply to --form paper")
    n_boot = LN_RATIO_BOOT if args.n_boot is None else args.n_boot
    fit = fit_law(read_table(args.results), form=args.form, holdout=args.holdout,
                  n_boot=n_boot, seed=args.seed, loss=args.loss,
                  min_steps=args.min_steps, family=args.family, baseline=args.baseline,
                  lr=args.lr)
    if args.out:
        from xmodlm.fileio import atomic_write_json

        atomic_write_json(Path(args.out), fit.to_json())
    if args.plots:
        from xmodlm.report.law_plots import plot_law

        for path in plot_law(fit, read_table(args.results), args.plots):
            print(f"wrote {path}", file=sys.stderr)
    payload = fit.to_json(samples=args.samples)
    if args.json:
        print_json(payload)
        return 0
    runs = payload["runs"]
    print(f"loss: {fit.loss} validation loss; {runs['n']} runs ({runs['dense']} dense,"
          f" {runs['sparse']} {runs['variant'] or 'sparse'}); left out:"
          f" {runs['dropped_short']} shorter than {runs['min_steps']} steps,"
          f" {runs['dropped_unfinished']} unfinished, {runs['excluded_moe']} MoE,"
          f" other variants {runs['excluded_variants'] or 'none'},"
          f" {runs['excluded_lr']} at another learning rate than {runs['lr']}")
    print(f"delta baseline: {fit.baseline}")
    for note in payload["notes"]:
        print(f"note: {note}")
    d = payload["delta"]
    if d:
        print(f"selected delta form: {d['selected']} ({d['selection'].get('why', '')})")
    for flag in payload["identification"]["flags"]:
        print(f"NOT IDENTIFIED: {flag['law']} {flag['param']}: {flag['problem']}")
    print(json.dumps(payload["metrics"], indent=2))
    return 0


def _fit_paper(args: argparse.Namespace) -> int:
    """``xmod law fit --form paper``: Delta against the dense curves, Eq. 14 fitted the
    paper's way, its grouped held-out tests and bootstrap."""
    from xmodlm.errors import UserError
    from xmodlm.law.paper_fit import PROTOCOLS as PAPER_PROTOCOLS
    from xmodlm.law.paper_fit import fit_paper
    from xmodlm.law.reference import law_frame, read_curves
    from xmodlm.law.table import read_table

    n_boot = PAPER_BOOT if args.n_boot is None else args.n_boot
    if n_boot < 0:
        raise UserError(f"--n-boot {n_boot}: must be >= 0")
    curves = read_curves(args.curves) if args.curves else None
    frame, record = law_frame(read_table(args.results), curves, loss=args.loss,
                              min_steps=args.min_steps, seed=args.seed, family=args.family,
                              lr=args.lr)
    protocols = PAPER_PROTOCOLS
    if args.holdout:
        protocols = () if args.holdout == "none" else tuple(args.holdout.split(","))
        unknown = [p for p in protocols if p not in PAPER_PROTOCOLS]
        if unknown:
            raise UserError(f"--holdout {unknown[0]!r}: with --form paper, one or more of"
                            f" {', '.join(PAPER_PROTOCOLS)} (comma-separated), or none")
    law = fit_paper(frame, n_boot=n_boot, seed=args.seed, protocols=protocols,
                    out_of_range=dict(args.out_of_range or []), reference=record)
    if args.out:
        from xmodlm.fileio import atomic_write_json

        atomic_write_json(Path(args.out), law.to_json())
    if args.plots:
        from xmodlm.report.paper_law_plots import plot_paper_law

        for path in plot_paper_law(law, frame, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    payload = law.to_json(samples=args.samples)
    if args.json:
        print_json(payload)
        return 0
    print(f"paper law (Eq. 14) on {law.provenance['runs']} sparse runs; references:"
          f" {record['references']}; counts: {record['counts']}")
    for note in record["notes"]:
        print(f"note: {note}")
    print(json.dumps({"params": law.value,
                      "metrics": {**(law.metrics or {}), "heldout": law.heldout_scores()}},
                     indent=2))
    return 0


def cmd_law_predict(args: argparse.Namespace) -> int:
    from xmodlm.errors import UserError
    from xmodlm.law.lawfit import load_fit
    from xmodlm.law.predict import predict, predicts_losses
    from xmodlm.law.table import is_moe, read_table

    paper_law = _paper_law(args.fit)
    if paper_law is not None:
        return _predict_paper(args, paper_law)
    fit = load_fit(args.fit)
    table = read_table(args.input)
    moe = is_moe(table)
    if moe.all():
        raise UserError(f"--input {args.input}: every row is MoE, which the sparse-depth law"
                        " does not model; give it dense, MoD or X-MoD rows")
    out = predict(fit, table[~moe].reset_index(drop=True))
    left_out = (f"{int(moe.sum())} MoE row(s) of the input left out: the sparse-depth law"
                " does not model MoE") if moe.any() else None
    what = "loss" if predicts_losses(fit) else "delta"
    why = ("validation loss with its 95% interval (lo, hi)" if what == "loss" else
           "delta = ln L(routed) - ln L(FLOP-matched dense) with its 95% interval: the fit"
           " has no dense law (paired baseline, dense runs of one size), so it predicts"
           " differences from dense, not losses; a fit with --baseline law predicts losses")
    if args.json:
        print_json({"predicts": what, "loss": fit.loss, "left_out": left_out,
                    "predictions": out.to_dict(orient="records")})
    else:
        print(f"predicted: {fit.loss}-routing {why}")
        if left_out:
            print(left_out)
        print(out.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    return 0


def recommend_args(sub: argparse._SubParsersAction) -> None:
    """``xmod recommend``'s arguments, beside the command that reads them."""
    p = sub.add_parser("recommend", help="which routing configuration to train, by the law")
    p.add_argument("--compute", type=finite, required=True, help="training FLOPs C")
    p.add_argument("--context", type=count_int, required=True, help="context length T")
    p.add_argument("--active-params", type=finite, default=None,
                   help="N_ae of the backbone (paper law: N_act; not with --backbone)")
    p.add_argument("--backbone", default=None, metavar="PRESET",
                   help="paper law: build the candidates on this preset's (or YAML's) backbone,"
                   " its dense total as N_act and its active depth, with --vocab-size")
    p.add_argument("--max-total-params", type=finite, default=None,
                   help="largest total parameter count a candidate may have")
    p.add_argument("--vocab-size", type=int, default=4096,
                   help="vocabulary of the models compared (it sets the LM head's FLOPs)")
    p.add_argument("--law", default=None,
                   help="'paper' (the paper's Eq. 14 with its Table 8 fit), a fit JSON of"
                   " either kind (`xmod law fit`, `xmod law fit --form paper`), or nothing"
                   " (the shipped ln-ratio fit)")
    p.add_argument("--loss", default=None, choices=["causal", "topk"],
                   help="the loss to optimise; the law must have been fitted on it"
                   " (default: the law's own, causal unless its table had only top-k)")
    p.add_argument("--extrapolate", action="store_true",
                   help="paper law: let K range over 2-64 beyond the fitted range (each such"
                   " candidate is flagged)")
    p.add_argument("--dense-prefix", type=int, action="append", default=None, metavar="N0",
                   help="paper law: dense prefix N0 to enumerate (repeatable; default 4)")
    p.add_argument("--active-layers", type=count_int, default=28,
                   help="paper law: active-equivalent depth of the backbone (default 28)")
    p.add_argument("--top", type=count_int, default=None,
                   help="paper law: list only the best TOP candidates (all are ranked)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_recommend)


def _predict_paper(args: argparse.Namespace, law: Any) -> int:
    """``xmod law predict`` with a fit of the paper's form: Delta per row."""
    from xmodlm.law.paper_predict import predict_paper
    from xmodlm.law.table import read_table

    out = predict_paper(law, read_table(args.input))
    why = ("Delta = loss(X-MoD) - loss(dense of the same N_act and L at the same FLOPs),"
           " with the 2.5-97.5 percentile of the fit's bootstrap draws")
    if args.json:
        print_json({"predicts": "delta", "law": law.name, "interval": why,
                    "predictions": out.to_dict(orient="records")})
    else:
        print(f"predicted by {law.name}: {why}")
        print(out.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    return 0


def _paper_law(name: str | None) -> Any:
    """The paper's law named by ``--law`` (``paper``, or a JSON of that kind), else None."""
    from xmodlm.law.paper import read_paper_law

    return read_paper_law(name)


def cmd_recommend(args: argparse.Namespace) -> int:
    from xmodlm.errors import UserError
    from xmodlm.law.lawfit import load_fit
    from xmodlm.law.recommend import recommend

    law = _paper_law(args.law)
    if (args.active_params is None) == (law is None or args.backbone is None):
        raise UserError("give --active-params, or with the paper law --backbone PRESET instead"
                        " (its dense total is N_act), not both")
    if law is not None:
        return _recommend_paper(args, law)
    if args.extrapolate or args.dense_prefix or args.top or args.backbone:
        raise UserError("--extrapolate, --dense-prefix, --top and --backbone apply to the paper"
                        " law (--law paper): the ln-ratio law ranks (S, c) FLOP-matched models")
    result = recommend(
        args.compute, args.context, args.active_params,
        law=load_fit(args.law) if args.law else None,
        max_total_params=args.max_total_params,
        loss=args.loss,
        vocab_size=args.vocab_size,
    )
    if args.json:
        print_json(result)
    else:
        print(result["answer"])
        print(result.get("reason", ""))
        print(f"(the law predicts the {result['loss']}-routing validation loss)")
        for w in result.get("warnings", []):
            print(f"warning: {w}", file=sys.stderr)
    return 0


def _recommend_paper(args: argparse.Namespace, law: Any) -> int:
    from xmodlm.law.paper_recommend import recommend_paper

    if args.loss not in (None, "causal"):
        from xmodlm.errors import UserError

        raise UserError("the paper's law predicts the causal-routing loss only (--loss causal)")
    backbone = None
    if args.backbone is not None:
        from xmodlm.config import load_config
        from xmodlm.law.backbone import backbone_of

        backbone = backbone_of(load_config(args.backbone,
                                           [f"model.vocab_size={args.vocab_size}"]).model)
    result = recommend_paper(
        args.compute, args.context, args.active_params or 0.0, law=law,
        max_total_params=args.max_total_params, extrapolate=args.extrapolate,
        dense_prefixes=args.dense_prefix or (4,), active_layers=args.active_layers,
        top=args.top, backbone=backbone,
    )
    if args.json:
        print_json(result)
        return 0
    o = result["optimum"]
    print(result["answer"])
    print(f"law: {result['law']['name']} ({result['law']['form']})")
    khat = "none (no interior minimum)" if o["k_hat"] is None else f"{o['k_hat']:.1f}"
    if o["k_hat_outside_range"]:
        khat += " (outside the fitted K range)"
    at1 = o["grid_best_at_a1"]
    best_at1 = (f"; best grid K at A = 1: {at1['sparsity']:g} (Delta {at1['delta']:+.3f})"
                if at1 else "")
    print(f"K_hat (Eq. 14 minimised over K at A = 1): {khat}{best_at1}")
    print(f"{'K':>4} {'A':>4} {'N0':>3} {'blocks':>6} {'N total':>9} {'phi/phiD':>8}"
          f" {'Delta':>7}  outside")
    for e in result["candidates"][: args.top or 10]:
        print(f"{e['sparsity']:>4g} {e['anchor_stride']:>4g} {e['dense_prefix']:>3}"
              f" {e['blocks']:>6} {e['params_total'] / 1e9:>8.3g}B {e['flops_ratio']:>8.2f}"
              f" {e['delta']:>+7.3f}  {'; '.join(e['outside'])}")
    for w in result["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    return 0
