"""Fit the whole law, choose the delta form, save it as JSON, predict with it.

``fit_law``: validate the runs (the causal-routing loss by default; runs
shorter than ``min_steps`` optimiser steps left out and counted); keep the
sparse runs of one family variant (X-MoD with its own mechanisms by default:
MoD and ablation variants are fitted apart, with ``family``); fit the dense law
per context with bootstrap intervals; fit every delta form on the sparse runs
with bootstrap intervals; refit all of them under a held-out protocol; keep the
simplest form within one standard error of the lowest held-out error of ln L
(never the best training fit; see :func:`one_se_choice`).

The bootstrap is stratified, clustered and paired. Replicate b resamples, with
replacement, the dense *configurations* of each context and the sparse
configurations (all seeds of a drawn configuration come along, so seed noise
widens the intervals), refits the dense laws, recomputes y = ln L_x - ln L_d_hat
with *those* dense laws, and refits each delta form. A delta interval
therefore includes the dense law's uncertainty, and the dense and delta
parameters of replicate b together are one draw of the whole law, which is what
prediction intervals and P(beats dense) are computed from. A replicate whose
refit does not converge (after a retry from more starts) is dropped from every
law at once, so the draws stay paired, and counted. Under the paired baseline
(:func:`paired_baseline`) y is measured against each run's dense partner
instead, and the replicates draw partners as well as configurations.

Identification is checked, not assumed (:func:`identification`): a parameter at
a bound of its box, an interval spanning more than a decade, or a fit that did
not converge is a flag in the JSON and the plain output, and ``recommend``
gives no sparse answer from a flagged law.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from xmodlm.errors import UserError
from xmodlm.law import dense
from xmodlm.law.delta import (
    FORMS,
    REFERENCE,
    TERMS,
    Features,
    Form,
    bootstrap_delta,
    fit_delta,
    get_form,
)
from xmodlm.law.holdout import (
    DENSE_ONLY,
    PROTOCOLS,
    HeldOut,
    check_protocol,
    default_protocol,
    evaluate,
    folds,
)
from xmodlm.law.robust import HUBER_DELTA, interval, resample_weights
from xmodlm.law.table import DEFAULT_MIN_STEPS, UNRECORDED_CONTEXT, validate
from xmodlm.pairing import NO_PARTNER, dense_partners
from xmodlm.progress import Progress

SCHEMA = "xmodlm.law/1"
MIN_BOOT = 100  # below this the 2.5/97.5 percentiles rest on two or three draws
DEFAULT_FAMILY = "xmod"
BASELINES = ("law", "paired")  # what a sparse run's delta is measured against
BOOT_STEPS = 20  # bootstrap progress is reported in up to this many blocks of replicates
BOOT_BLOCK_MIN = 50  # replicates per block at least (each block starts its worker processes)


def _param_table(
    names: tuple[str, ...], value: np.ndarray, samples: np.ndarray, fixed: tuple[str, ...] = ()
) -> dict[str, dict[str, Any]]:
    """``{name: {"value": v, "ci": [lo, hi]}}``, 95% bootstrap percentile intervals."""
    ci = interval(samples, value)
    out = {}
    for name, v, (lo, hi) in zip(names, value, ci, strict=True):
        out[name] = {"value": float(v), "ci": [float(lo), float(hi)]}
        if name in fixed:
            out[name]["fixed"] = True
    return out


@dataclass
class DenseLaw:
    """The dense law at one context: (E, A, B, alpha, beta) and bootstrap samples."""

    context: int
    value: np.ndarray
    samples: np.ndarray  # (n_boot, 5)
    n_runs: int
    diagnostics: dict[str, Any]

    def to_json(self, samples: bool = True) -> dict[str, Any]:
        return {
            "context": self.context,
            "n_runs": self.n_runs,
            "params": _param_table(dense.NAMES, self.value, self.samples),
            "optimizer": self.diagnostics,
            **({"samples": self.samples.tolist()} if samples else {}),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DenseLaw:
        value = np.array([data["params"][n]["value"] for n in dense.NAMES], dtype=float)
        samples = np.array(data["samples"], dtype=float).reshape(-1, dense.N_PARAMS)
        return cls(int(data["context"]), value, samples, int(data["n_runs"]), data["optimizer"])


@dataclass
class DeltaLaw:
    """One fitted delta form: parameters in the form's order and bootstrap samples."""

    form: str
    value: np.ndarray
    fixed: tuple[str, ...]  # held at their neutral value: the data cannot identify them
    samples: np.ndarray  # (n_boot, p)
    n_runs: int
    diagnostics: dict[str, Any]

    @property
    def spec(self) -> Form:
        return FORMS[self.form]

    def to_json(self, samples: bool = True) -> dict[str, Any]:
        return {
            "form": self.form,
            "summary": self.spec.summary,
            "n_runs": self.n_runs,
            "params": _param_table(self.spec.names, self.value, self.samples, self.fixed),
            "optimizer": self.diagnostics,
            **({"samples": self.samples.tolist()} if samples else {}),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DeltaLaw:
        names = get_form(data["form"]).names
        params = data["params"]
        return cls(
            form=data["form"],
            value=np.array([params[n]["value"] for n in names], dtype=float),
            fixed=tuple(n for n in names if params[n].get("fixed")),
            samples=np.array(data["samples"], dtype=float).reshape(-1, len(names)),
            n_runs=int(data["n_runs"]),
            diagnostics=data["optimizer"],
        )


@dataclass
class LawFit:
    """A fitted law: what ``xmod law fit --json`` writes and predict/recommend read."""

    dense: dict[int, DenseLaw]
    deltas: dict[str, DeltaLaw]
    selected: str | None
    selection: dict[str, Any] | None
    skipped: dict[str, str]
    ranges: dict[str, Any]
    metrics: dict[str, Any]
    heldout_points: dict[str, Any] | None
    runs: dict[str, Any]
    settings: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    fit_seconds: float = 0.0
    identification: dict[str, Any] = field(default_factory=lambda: {"ok": True, "flags": []})

    @property
    def loss(self) -> str:
        """The validation loss the law was fitted on (``causal`` or ``topk``)."""
        return str(self.settings.get("loss", "topk"))

    @property
    def delta(self) -> DeltaLaw | None:
        """The selected delta form (None for a law fitted on dense runs only)."""
        return self.deltas[self.selected] if self.selected else None

    @property
    def reference(self) -> dict[str, float]:
        return self.settings["reference"]

    @property
    def baseline(self) -> str:
        """What the delta is measured against: ``law`` (the dense law at the run's own
        N_ae and D) or ``paired`` (the run's FLOP-matched dense partner)."""
        return str(self.settings.get("baseline", "law"))

    def blocking_flags(self) -> list[dict[str, str]]:
        """The identification flags that forbid a sparse recommendation.

        Under the dense-law baseline every flag does: P(beats dense) is computed
        through the dense law. Under the paired baseline it is P(delta < 0), which
        the dense law does not enter, so only the delta law's flags do (the dense
        law's still make the absolute losses unreliable, and are warned about).
        """
        if self.baseline == "paired":
            return self.delta_flags()
        return list(self.identification.get("flags", []))

    def delta_flags(self) -> list[dict[str, str]]:
        """The identification flags of the selected delta law (none of its intervals
        then means anything)."""
        return [f for f in self.identification.get("flags", []) if f["law"].startswith("delta")]

    def to_json(self, samples: bool = True) -> dict[str, Any]:
        """The whole fit; ``samples=False`` leaves out the bootstrap draws (a summary:
        what ``law fit --json`` prints; a saved fit keeps them for predict)."""
        return {
            "schema": SCHEMA,
            "runs": self.runs,
            "notes": self.notes,
            "settings": self.settings,
            "identification": self.identification,
            "dense": [self.dense[t].to_json(samples) for t in sorted(self.dense)],
            "delta": None
            if not self.deltas
            else {
                "selected": self.selected,
                "selection": self.selection,
                "skipped": self.skipped,
                "forms": {name: law.to_json(samples) for name, law in self.deltas.items()},
            },
            "ranges": self.ranges,
            "metrics": self.metrics,
            "heldout_points": self.heldout_points,
            "fit_seconds": self.fit_seconds,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LawFit:
        """Rebuild a fit from :meth:`to_json` output; UserError if it is not one."""
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise UserError(
                f"not a law fit: expected JSON with schema {SCHEMA!r} (from `xmod law fit --out`)"
            )
        if any("samples" not in d for d in data.get("dense") or []):
            raise UserError(
                "law fit JSON has no bootstrap samples (a `--json` summary): use the file"
                " written by `xmod law fit --out`, or print with --samples"
            )
        try:
            laws = [DenseLaw.from_json(d) for d in data["dense"]]
            delta = data["delta"] or {
                "selected": None,
                "selection": None,
                "skipped": {},
                "forms": {},
            }
            return cls(
                dense={law.context: law for law in laws},
                deltas={n: DeltaLaw.from_json(d) for n, d in delta["forms"].items()},
                selected=delta["selected"],
                selection=delta["selection"],
                skipped=delta["skipped"],
                ranges=data["ranges"],
                metrics=data["metrics"],
                heldout_points=data["heldout_points"],
                runs=data["runs"],
                settings=data["settings"],
                notes=data["notes"],
                fit_seconds=data["fit_seconds"],
                identification=data.get("identification", {"ok": True, "flags": []}),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise UserError(
                f"law fit JSON is incomplete or corrupt ({type(err).__name__}: {err})"
            ) from None


def load_fit(path: str | Path) -> LawFit:
    """Read a law fit written by ``xmod law fit --json``."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"law fit {str(path)!r} not found")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"law fit {str(path)!r} is not valid JSON") from None
    fit = LawFit.from_json(data)
    _check_finite_params(fit, path)
    return fit


def _check_finite_params(fit: LawFit, path: Path) -> None:
    """Every fitted parameter is a finite number. JSON admits NaN and Infinity, and
    one such parameter (a hand edit, a broken writer) would make every prediction
    NaN while the command still succeeds."""
    laws = [(f"dense law (context {t})", law.value, dense.NAMES) for t, law in fit.dense.items()]
    laws += [(f"delta form {n}", d.value, d.spec.names) for n, d in fit.deltas.items()]
    for what, value, names in laws:
        bad = np.flatnonzero(~np.isfinite(value))
        if bad.size:
            raise UserError(
                f"law fit {str(path)!r}: {what} parameter {names[bad[0]]} is {value[bad[0]]},"
                " not a finite number: refit with `xmod law fit --out`"
            )


def _logs(frame: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    return np.log(frame["params_active"].to_numpy(float)), np.log(frame["tokens"].to_numpy(float))


def _span(values: pd.Series) -> list[float] | None:
    return [float(values.min()), float(values.max())] if len(values) else None


def fit_law(
    df: pd.DataFrame,
    form: str = "auto",
    holdout: str | None = None,
    n_boot: int = 1000,
    seed: int = 0,
    loss: str = "causal",
    min_steps: int = DEFAULT_MIN_STEPS,
    family: str = DEFAULT_FAMILY,
    baseline: str = "law",
    lr: float | None = None,
) -> LawFit:
    """Fit the dense law per context and the delta law, select a form, validate held out.

    ``form``: ``auto`` fits every registered form and keeps the simplest within one
    standard error of the lowest held-out error; a form name fits only that one.
    ``holdout``: the protocol for selection and the reported held-out metrics;
    None picks leave-cell-out when there are two or more (S, c) cells, else
    top-compute when there are two or more compute tiers, else none. ``loss``:
    ``causal`` (default) or ``topk``. ``min_steps``: shorter runs are left out and
    counted (0 keeps all; the table needs a ``steps`` column otherwise).
    ``family``: the sparse runs the delta law is fitted on: a family (``xmod``,
    ``mod``: its own-mechanism variant, else its largest) or a variant label from
    the table (``xmod[gating=sigmoid]``); every other sparse run is left out and
    counted by variant. ``baseline``: what each sparse run's delta is measured
    against, ``law`` (the dense law at the run's own N_ae and D) or ``paired``
    (the observed loss of its FLOP-matched dense partner, :mod:`xmodlm.pairing`;
    see :func:`paired_baseline`). ``lr``: the peak learning rate whose runs are
    fitted (None: the table's most common one; runs at others are left out and
    counted, since a law pools one training recipe).
    """
    started = time.perf_counter()
    if n_boot < MIN_BOOT:
        raise UserError(
            f"n_boot={n_boot}: need at least {MIN_BOOT} bootstrap replicates (1000 recommended)"
        )
    candidates = list(FORMS.values()) if form == "auto" else [get_form(form)]
    if holdout is not None:
        check_protocol(holdout)
    if baseline not in BASELINES:
        raise UserError(f"baseline={baseline!r}: must be one of {', '.join(BASELINES)}")
    runs = validate(df, loss=loss, min_steps=min_steps)
    frame, lr_used, excluded_lr = _one_lr(runs.frame, lr)
    frame, variant, excluded = _one_variant(frame, family)
    frame = frame.reset_index(drop=True)
    sparse = frame["is_sparse"].to_numpy()
    context = frame["context"].to_numpy()
    if sparse.all():
        raise UserError(
            "table has no dense runs (stride 1 or capacity 1); the law measures X-MoD"
            " against a dense law fitted to them"
        )
    orphans = sorted(set(context[sparse]) - set(context[~sparse]))
    if orphans:
        raise UserError(
            f"X-MoD runs at context {orphans[0]} have no dense runs at that context;"
            " the dense law is fitted per context"
        )
    ln_paired = paired_baseline(frame) if baseline == "paired" else None
    rng = np.random.default_rng(seed)
    notes = list(runs.notes)
    try:
        dense_fits, dense_laws, dense_ok = _fit_dense_laws(frame, n_boot, rng)
    except UserError as err:
        if ln_paired is not None and sparse.any():
            # the paired delta needs no dense law; only absolute losses would
            dense_fits, dense_laws, dense_ok = {}, {}, np.ones(n_boot, dtype=bool)
            notes.append(f"no dense law: {err}; the paired delta law needs none, but the"
                         " law cannot predict absolute losses")
        else:
            why = ""
            if runs.dropped_short:
                why = (f" ({runs.dropped_short} runs shorter than min_steps={min_steps} were"
                       " left out: early training measures warmup; --min-steps lowers the bar,"
                       " at that cost)")
            elif sparse.any() and "width" in frame and "seed" in frame and (
                    dense_partners(frame, ~sparse)[sparse] != NO_PARTNER).all():
                why = ("; every sparse run has a FLOP-matched dense run of its seed, so the"
                       " delta can be fitted against those instead (--baseline paired)")
            if not why:
                raise
            raise UserError(f"{err}{why}") from None
    deltas, skipped, delta_ok = {}, {}, np.ones(n_boot, dtype=bool)
    if sparse.any():
        deltas, skipped, delta_ok = _fit_deltas(
            frame, candidates, dense_laws, n_boot, rng, explicit=form != "auto",
            ln_paired=ln_paired,
        )
    dropped_replicates = _keep_replicates(dense_laws, deltas, dense_ok & delta_ok)
    protocol = holdout or default_protocol(frame)
    if form == "auto" and len(deltas) > 1 and protocol is None:
        raise UserError(
            "cannot choose a delta form by held-out error: the X-MoD runs are in one"
            " (stride, capacity) cell and one compute tier; pass a form name instead of auto"
        )
    forms = [FORMS[name] for name in deltas]
    results, failed = {}, {}
    if protocol:
        n_folds = len(folds(frame, protocol))
        with Progress(1, f"law fit: held-out {protocol}, {n_folds} folds x"
                      f" {max(1, len(forms))} laws", unit="protocol") as bar:
            results, failed = evaluate(
                frame, protocol, forms, dense_fits, REFERENCE, rng, ln_paired
            )
            bar.update(1)
    selected, selection = _select(form, deltas, results, failed, protocol)
    by_protocol = _other_protocols(frame, protocol, selected, dense_fits, rng, ln_paired)
    if protocol:
        held_sel = results.get(selected or DENSE_ONLY)
        by_protocol[protocol] = held_sel.metrics if held_sel else {
            "failed": failed.get(selected or DENSE_ONLY, "no held-out result")}
    ln_point = _in_fit(frame, dense_laws, deltas.get(selected) if selected else None, ln_paired)
    ln_obs = np.log(frame["val_loss"].to_numpy(float))
    scored = np.isfinite(ln_point) & (sparse if ln_paired is not None else True)
    err = (ln_point - ln_obs)[scored]
    held = results.get(selected or DENSE_ONLY)
    return LawFit(
        dense=dense_laws,
        deltas=deltas,
        selected=selected,
        selection=selection,
        skipped=skipped,
        ranges={
            "compute": _span(frame["compute"]),
            "params_active": _span(frame["params_active"]),
            "tokens": _span(frame["tokens"]),
            "context": sorted(int(t) for t in np.unique(context)),
            "stride": _span(frame.loc[sparse, "stride"]),
            "capacity": _span(frame.loc[sparse, "capacity"]),
            "rho": _span(frame.loc[sparse, "rho"]),
        },
        metrics={
            "in_fit": {
                "n": len(err),
                "rmse": float(np.sqrt(np.mean(err**2))),
                "mae": float(np.mean(np.abs(err))),
            },
            "heldout": held.metrics if held else None,
            "heldout_protocol": protocol,
            "heldout_by_protocol": {k: by_protocol[k] for k in PROTOCOLS if k in by_protocol},
        },
        heldout_points=_points(held, ln_obs) if held else None,
        runs={
            "n": len(frame),
            "dense": int((~sparse).sum()),
            "sparse": int(sparse.sum()),
            "configurations": int(frame["config"].nunique()),
            "variant": variant,
            "dropped_unfinished": runs.dropped_unfinished,
            "dropped_short": runs.dropped_short,
            "min_steps": min_steps,
            "excluded_moe": runs.excluded_moe,
            "excluded_variants": excluded,
            "lr": lr_used,
            "excluded_lr": excluded_lr,
        },
        settings={
            "loss": runs.loss,
            "n_boot": n_boot,
            "replicates_kept": n_boot - dropped_replicates,
            "seed": seed,
            "huber_delta": HUBER_DELTA,
            "reference": dict(REFERENCE),
            "baseline": baseline,
            "bootstrap": "clustered by configuration (seeds of a configuration drawn together)"
            + ("; and by dense partner (a run's weight: its configuration's count times its"
               " partner's)" if baseline == "paired" else ""),
        },
        notes=notes,
        fit_seconds=time.perf_counter() - started,
        identification=identification(dense_fits, dense_laws, deltas, selected,
                                      n_configs=int(frame.loc[sparse, "config"].nunique())),
    )


def fitted_runs(fit: LawFit, df: pd.DataFrame) -> pd.DataFrame:
    """The rows of the table ``df`` that ``fit`` was fitted on (its loss, minimum
    length, learning rate and sparse variant), validated, in table order."""
    frame = validate(df, loss=fit.loss, min_steps=int(fit.runs.get("min_steps", 0))).frame
    frame, _, _ = _one_lr(frame, fit.runs.get("lr"))
    variant = fit.runs.get("variant")
    if variant:
        frame = frame[~frame["is_sparse"] | (frame["variant"] == variant)]
    return frame.reset_index(drop=True)


def paired_baseline(frame: pd.DataFrame) -> np.ndarray:
    """ln L of each sparse run's FLOP-matched dense partner (NaN on dense rows).

    The paired baseline suits a study that gives every routed run a dense run of
    the same seed, context, width and budget but trains dense at one width per
    context: its dense law cannot be identified in N, so a delta measured
    against it would carry that law's whole uncertainty, while the paired
    difference cancels the seed's data order and needs no dense law at all.
    What it measures differs slightly: routed minus the dense reference at the
    same compute, the reference's size included (the dense-law baseline takes
    the dense law at the routed run's own N_ae and D). Every sparse run must have
    a partner; the first that has none is named.
    """
    missing = [c for c in ("width", "seed") if c not in frame]
    if missing:
        raise UserError(
            f"baseline paired needs column(s) {', '.join(missing)} to find each run's dense"
            " partner; use baseline law"
        )
    sparse = frame["is_sparse"].to_numpy()
    partners = dense_partners(frame, ~sparse)
    lonely = np.flatnonzero(sparse & (partners == NO_PARTNER))
    if len(lonely):
        row = frame.iloc[lonely[0]]
        raise UserError(
            f"baseline paired: {len(lonely)} sparse run(s) have no FLOP-matched dense run of the"
            f" same context, width, seed and budget (first: context {int(row['context'])},"
            f" width {row['width']:g}, seed {row['seed']:g}, compute {row['compute']:.3g});"
            " train their dense partners or use baseline law"
        )
    ln_l = np.log(frame["val_loss"].to_numpy(float))
    return np.where(sparse, ln_l[np.maximum(partners, 0)], np.nan)


def _one_lr(frame: pd.DataFrame, lr: float | None) -> tuple[pd.DataFrame, float | None, int]:
    """The runs at one peak learning rate (``lr``, else the most common), the rate,
    and how many runs at other rates were left out; tables without ``lr`` pass."""
    if "lr" not in frame:
        if lr is not None:
            raise UserError(f"lr={lr:g}: the table has no lr column to select runs by")
        return frame, None, 0
    rates = pd.to_numeric(frame["lr"], errors="coerce")
    counts = rates.value_counts()
    if counts.empty:
        if lr is not None:
            raise UserError(f"lr={lr:g}: the table records no learning rate")
        return frame, None, 0
    if lr is None:
        top = counts[counts == counts.max()]
        if len(top) > 1:
            raise UserError(
                f"runs at {len(counts)} peak learning rates, {len(top)} of them equally common"
                f" ({', '.join(f'{r:g}' for r in sorted(top.index))}); a law pools one recipe:"
                " pass the one to fit (--lr)"
            )
        lr = float(top.index[0])
    elif not np.isclose(counts.index.to_numpy(float), lr, rtol=1e-9, atol=0).any():
        raise UserError(
            f"lr={lr:g}: no runs at that peak learning rate; the table has"
            f" {', '.join(f'{r:g}' for r in sorted(counts.index))}"
        )
    keep = np.isclose(rates.to_numpy(float), lr, rtol=1e-9, atol=0) | rates.isna().to_numpy()
    return frame[keep], float(lr), int((~keep).sum())


def _one_variant(frame: pd.DataFrame, family: str) -> tuple[pd.DataFrame, str | None, dict]:
    """Dense runs plus the sparse runs of one variant; the others counted by variant."""
    sparse = frame["is_sparse"]
    variants = frame.loc[sparse, "variant"].value_counts()
    if variants.empty:
        return frame, None, {}
    if family in variants.index:
        chosen = family
    else:
        own = [v for v in variants.index if v.split("[")[0] == family]
        if not own:
            raise UserError(
                f"family {family!r} has no sparse runs in the table; it has:"
                f" {', '.join(sorted(variants.index))}"
            )
        chosen = family if family in own else max(own, key=lambda v: (variants[v], v))
    excluded = {str(v): int(n) for v, n in variants.items() if v != chosen}
    return frame[~sparse | (frame["variant"] == chosen)], str(chosen), excluded


def _other_protocols(
    frame: pd.DataFrame,
    protocol: str | None,
    selected: str | None,
    dense_fits: dict[int, dense.DenseFit],
    rng: np.random.Generator,
    ln_paired: np.ndarray | None = None,
) -> dict[str, dict[str, Any]]:
    """Held-out scores of the selected law under every protocol but the selecting one.

    Selection uses one protocol; the others test the chosen law on what it was
    not chosen for (a held-out routing cell, the top compute tier, the longest
    context), refitting only that law on each fold, after the bootstrap (so
    the fitted parameters and intervals do not depend on them). A protocol the
    table cannot support (no such folds, or a fold that leaves too few dense runs
    to refit the dense law) is recorded as ``{"not_applicable": why}``: it tests
    the law, and a small design should still be fitted.
    """
    out: dict[str, dict[str, Any]] = {}
    name = selected or DENSE_ONLY
    law = [FORMS[selected]] if selected else []
    runnable = []
    for other in PROTOCOLS:
        if other == protocol:
            continue
        try:
            folds(frame, other)
            runnable.append(other)
        except UserError as err:
            out[other] = {"not_applicable": str(err)}
    if not runnable:
        return out
    with Progress(len(runnable), f"law fit: {name} held out under {', '.join(runnable)}",
                  unit="protocol") as bar:
        for other in runnable:
            try:
                results, failed = evaluate(frame, other, law, dense_fits, REFERENCE, rng,
                                           ln_paired)
            except UserError as err:  # a fold too small to refit the dense law on
                out[other] = {"not_applicable": str(err)}
            else:
                out[other] = results[name].metrics if name in results else {
                    "failed": failed.get(name, "no held-out result")}
            bar.update(1)
    return out


def _keep_replicates(
    dense_laws: dict[int, DenseLaw], deltas: dict[str, DeltaLaw], keep: np.ndarray
) -> int:
    """Drop the replicates that did not converge in some law from every law (they stay
    paired); returns how many were dropped."""
    if keep.all():
        return 0
    if keep.sum() < MIN_BOOT // 2:
        raise UserError(
            f"only {int(keep.sum())} of {len(keep)} bootstrap refits converged; the law is not"
            " identified by these runs (see the optimiser reports)"
        )
    for law in [*dense_laws.values(), *deltas.values()]:
        law.samples = law.samples[keep]
    return int((~keep).sum())


DECADE = 10.0
MIN_SPARE_CONFIGS = 2  # sparse configurations beyond the delta law's free parameters
# A and B absorb the exponents' uncertainty (ln A moves by ln N x d alpha, and ln N
# is ~10-20), so a decade in A is only ~0.15 in alpha: well-posed ladders of 80 runs
# give A and B intervals of 10-20x. They are flagged past three decades.
PREFACTOR_SPAN = 1e3


def identification(
    dense_fits: dict[int, dense.DenseFit],
    dense_laws: dict[int, DenseLaw],
    deltas: dict[str, DeltaLaw],
    selected: str | None,
    n_configs: int | None = None,
) -> dict[str, Any]:
    """Flags for parameters the runs do not pin down, and fits that did not converge.

    A parameter is flagged when its full-data optimum sits on a bound of its box
    (the data push it outside the family the law allows), or when it is positive
    by construction and its 95% interval spans more than a decade (hi / lo > 10;
    three decades for the prefactors A and B, see ``PREFACTOR_SPAN``).
    Signed delta parameters are judged by their intervals in the report instead
    (resolved or not), since an effect near zero is a finding, not a failure;
    but a delta law with fewer than ``MIN_SPARE_CONFIGS`` more sparse
    configurations (``n_configs``; seeds of one are one) than free parameters
    is flagged whole: the bootstrap draws configurations, and from so few it
    returns intervals as narrow as they are meaningless.
    """
    flags: list[dict[str, str]] = []
    for t, fit in dense_fits.items():
        name = f"dense (context {t})" if t != UNRECORDED_CONTEXT else "dense"
        law = dense_laws[t]
        if not fit.optimum.converged:
            flags.append({"law": name, "param": "-", "problem": "full-data fit did not converge"})
        theta = fit.optimum.x
        theta_names = ("A", "B", "E", "alpha", "beta")  # the log-space order of dense.BOUNDS
        for pname, x, (lo, hi) in zip(theta_names, theta, dense.BOUNDS, strict=True):
            if _at_bound(x, lo, hi):
                side = "lower" if x - lo < hi - x else "upper"
                flags.append({"law": name, "param": pname, "problem": f"at its {side} bound"})
        ci = interval(law.samples, law.value)
        for pname, (lo, hi) in zip(dense.NAMES, ci, strict=True):
            span = PREFACTOR_SPAN if pname in ("A", "B") else DECADE
            if lo > 0 and hi / lo > span:
                flags.append({"law": name, "param": pname,
                              "problem": f"95% interval spans more than {math.log10(span):.0f}"
                              f" decade(s) ({lo:.3g} to {hi:.3g})"})
    for form_name, law in deltas.items():
        if form_name != selected:
            continue
        name = f"delta ({form_name})"
        free = len(law.spec.params) - len(law.fixed)
        if n_configs is not None and n_configs < free + MIN_SPARE_CONFIGS:
            flags.append({"law": name, "param": "-", "problem":
                          f"{n_configs} sparse configurations for {free} free parameters (needs"
                          f" {free + MIN_SPARE_CONFIGS}): its intervals mean nothing"})
        if not law.diagnostics.get("converged", True):
            flags.append({"law": name, "param": "-", "problem": "full-data fit did not converge"})
        ci = interval(law.samples, law.value)
        for p, x, (lo_ci, hi_ci) in zip(law.spec.params, law.value, ci, strict=True):
            if p.name in law.fixed:
                continue
            if _at_bound(x, *p.bounds):
                flags.append({"law": name, "param": p.name, "problem": "at a bound of its box"})
            elif p.bounds[0] > 0 and lo_ci > 0 and hi_ci / lo_ci > DECADE:
                flags.append({"law": name, "param": p.name,
                              "problem": f"95% interval spans more than a decade ({lo_ci:.3g} to {hi_ci:.3g})"})
    return {"ok": not flags, "flags": flags}


def _at_bound(x: float, lo: float, hi: float) -> bool:
    return min(x - lo, hi - x) <= 1e-6 * (hi - lo)


def _fit_dense_laws(
    frame: pd.DataFrame, n_boot: int, rng: np.random.Generator
) -> tuple[dict[int, dense.DenseFit], dict[int, DenseLaw], np.ndarray]:
    """Dense law and bootstrap per context, from the dense runs of that context; and
    which replicates converged in every context."""
    ln_n, ln_d = _logs(frame)
    ln_l = np.log(frame["val_loss"].to_numpy(float))
    context, sparse = frame["context"].to_numpy(), frame["is_sparse"].to_numpy()
    configs = frame["config"].to_numpy()
    fits, laws = {}, {}
    ok = np.ones(n_boot, dtype=bool)
    for t in sorted(set(context[~sparse])):
        rows = (context == t) & ~sparse
        where = "dense runs" if t == UNRECORDED_CONTEXT else f"dense runs at context {t}"
        with Progress(1, f"law fit: {where}", unit="fit") as bar:
            fit = dense.fit_dense(ln_n[rows], ln_d[rows], ln_l[rows], rng, where)
            bar.update(1)
        weights = resample_weights(int(rows.sum()), n_boot, rng, clusters=configs[rows])
        samples, converged = _in_blocks(
            lambda idx, fit=fit, rows=rows, weights=weights: dense.bootstrap_dense(
                fit, ln_n[rows], ln_d[rows], ln_l[rows], weights[idx]
            ),
            n_boot, f"law fit: bootstrap of the {where}",
        )
        fits[int(t)] = fit
        ok &= converged
        diagnostics = {**fit.report(), "bootstrap_converged": float(converged.mean())}
        laws[int(t)] = DenseLaw(int(t), fit.params, samples, fit.n_runs, diagnostics)
    return fits, laws, ok


def _fit_deltas(
    frame: pd.DataFrame,
    candidates: list[Form],
    dense_laws: dict[int, DenseLaw],
    n_boot: int,
    rng: np.random.Generator,
    explicit: bool,
    ln_paired: np.ndarray | None = None,
) -> tuple[dict[str, DeltaLaw], dict[str, str], np.ndarray]:
    """Every candidate form on the X-MoD runs, with bootstrap paired to the dense
    replicates; and which replicates converged in every form.

    With ``ln_paired`` (the paired baseline, one entry per row of ``frame``) y is
    each run's ln L minus its dense partner's, the same in every replicate: the
    dense law does not enter, so neither does its uncertainty; the replicates
    then draw configurations and dense partners both."""
    sparse = frame["is_sparse"].to_numpy()
    runs = frame[sparse]
    ln_n, ln_d = _logs(runs)
    context = runs["context"].to_numpy()
    ln_l = np.log(runs["val_loss"].to_numpy(float))
    if ln_paired is None:
        y = ln_l - dense.log_loss_at(
            {t: law.value for t, law in dense_laws.items()}, context, ln_n, ln_d
        )
        y_boot = ln_l - dense.log_loss_at(
            {t: law.samples for t, law in dense_laws.items()}, context, ln_n, ln_d
        )
    else:
        y = ln_l - ln_paired[sparse]
        y_boot = np.broadcast_to(y, (n_boot, len(y)))
    x = Features.of(runs, REFERENCE)
    weights = resample_weights(len(runs), n_boot, rng, clusters=runs["config"].to_numpy())
    if ln_paired is not None:
        # one dense run is the partner of every cell at its seed, context and budget, so
        # its luck is shared across configurations: draw partners too (a two-way,
        # "pigeonhole" bootstrap: a run's weight is its configuration's count times its
        # partner's), or a term that varies across those groups (context) is overconfident
        partner = dense_partners(frame, ~sparse)[sparse]
        weights = weights * resample_weights(len(runs), n_boot, rng, clusters=partner)
    deltas, skipped = {}, {}
    ok = np.ones(n_boot, dtype=bool)
    for form in candidates:
        try:
            with Progress(1, f"law fit: delta form {form.name}", unit="fit") as bar:
                fit = fit_delta(form, x, y, rng)
                bar.update(1)
        except UserError as err:
            if explicit:
                raise
            skipped[form.name] = str(err)
            continue
        samples, converged = _in_blocks(
            lambda idx, fit=fit: bootstrap_delta(fit, x, y_boot[idx], weights[idx]),
            n_boot, f"law fit: bootstrap of delta form {form.name}",
        )
        ok &= converged
        diagnostics = {**fit.report(), "bootstrap_converged": float(converged.mean())}
        deltas[form.name] = DeltaLaw(
            form.name, fit.theta, fit.fixed, samples, fit.n_runs, diagnostics
        )
    if not deltas:
        name, why = next(iter(skipped.items()))
        raise UserError(f"no delta form can be fitted to these X-MoD runs ({name}: {why})")
    return deltas, skipped, ok


def _in_blocks(
    refit: Any, n_boot: int, desc: str
) -> tuple[np.ndarray, np.ndarray]:
    """``refit(replicate indices) -> (samples, converged)`` over all ``n_boot``
    replicates, in up to :data:`BOOT_STEPS` blocks so progress (and an ETA) shows
    between them. Each replicate is refitted from the same starts whatever its block, so the
    result equals one call over all of them."""
    n_blocks = max(1, min(BOOT_STEPS, n_boot // BOOT_BLOCK_MIN))
    blocks = np.array_split(np.arange(n_boot), n_blocks)
    samples, converged = [], []
    with Progress(n_boot, desc, unit="replicate") as bar:
        for idx in blocks:
            s, c = refit(idx)
            samples.append(s)
            converged.append(c)
            bar.update(len(idx))
    return np.vstack(samples), np.concatenate(converged)


def one_se_choice(results: dict[str, HeldOut], n_params: dict[str, int]) -> tuple[str, str]:
    """The simplest form whose held-out error is within one standard error of the best.

    Held-out RMSEs of related forms often differ by less than their noise (the
    forms nest: every richer form contains ``base``), and picking the raw minimum
    then ships a form whose extra parameters the data cannot identify. The
    standard error is that of the paired per-run difference in squared error
    against the lowest-RMSE form; among the forms within it, the fewest free
    parameters win, then the lower RMSE. Returns (name, reason).
    """
    rmse = {name: r.metrics["rmse"] for name, r in results.items()}
    best = min(rmse, key=lambda n: (rmse[n], n_params[n]))
    err_best = (results[best].ln_pred - results[best].ln_obs) ** 2
    close, gaps = [], {}
    for name, r in results.items():
        diff = (r.ln_pred - r.ln_obs) ** 2 - err_best
        se = float(np.std(diff, ddof=1) / np.sqrt(len(diff))) if len(diff) > 1 else 0.0
        gaps[name] = (float(diff.mean()), se)
        if diff.mean() <= se:
            close.append(name)
    chosen = min(close, key=lambda n: (n_params[n], rmse[n]))
    listing = ", ".join(f"{n} {rmse[n]:.4g}" for n in sorted(rmse, key=rmse.get))
    if chosen == best:
        return chosen, f"lowest held-out RMSE of ln L: {listing}"
    mean, se = gaps[chosen]
    return chosen, (
        f"fewest parameters ({n_params[chosen]}) within one standard error of the lowest"
        f" held-out RMSE ({best}; MSE gap {mean:.2g} <= SE {se:.2g}): {listing}"
    )


def _select(
    form: str,
    deltas: dict[str, DeltaLaw],
    results: dict[str, HeldOut],
    failed: dict[str, str],
    protocol: str | None,
) -> tuple[str | None, dict[str, Any] | None]:
    """The chosen form and why (:func:`one_se_choice` on the forms that refitted)."""
    if not deltas:
        return None, None
    scored = {name: results[name] for name in deltas if name in results}
    if form != "auto":
        selected, why = form, "chosen by the caller (form given)"
    elif len(deltas) == 1:
        selected, why = next(iter(deltas)), "the only form these runs can fit"
    elif not scored:
        name, reason = next(iter(failed.items()))
        raise UserError(
            f"no delta form could be refitted under holdout {protocol} ({name}: {reason})"
        )
    else:
        n_free = {name: len(deltas[name].spec.params) - len(deltas[name].fixed) for name in scored}
        selected, reason = one_se_choice(scored, n_free)
        why = f"{reason} (holdout {protocol})"
    return selected, {
        "rule": "one standard error: the simplest form within 1 SE of the lowest held-out MSE of ln L",
        "protocol": protocol,
        "why": why,
        "heldout": {name: r.metrics for name, r in results.items()},
        "failed": failed,
    }


def _in_fit(
    frame: pd.DataFrame,
    dense_laws: dict[int, DenseLaw],
    law: DeltaLaw | None,
    ln_paired: np.ndarray | None = None,
) -> np.ndarray:
    """Point predictions of ln L for the fitted runs (sparse runs from their dense
    partner's observed loss under the paired baseline; NaN for dense runs when the
    law has no dense law)."""
    ln_n, ln_d = _logs(frame)
    values = {t: d.value for t, d in dense_laws.items()}
    out = np.full(len(frame), np.nan)
    if values:
        out = dense.log_loss_at(values, frame["context"].to_numpy(), ln_n, ln_d)
    sparse = frame["is_sparse"].to_numpy()
    if ln_paired is not None:
        out = np.where(sparse, ln_paired, out)
    if law is not None and sparse.any():
        out[sparse] += law.spec.predict(law.value, Features.of(frame[sparse], REFERENCE))
    return out


def _points(held: HeldOut, ln_obs: np.ndarray) -> dict[str, Any]:
    return {
        "protocol": held.protocol,
        "rows": held.rows.tolist(),
        "observed": np.exp(ln_obs[held.rows]).tolist(),
        "predicted": np.exp(held.ln_pred).tolist(),
    }


# --- prediction -------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    """ln L for each row: point estimate, bootstrap draws, and its parts."""

    law_context: np.ndarray  # the fitted context whose dense law each row used
    ln_dense: np.ndarray  # (n,)
    terms: dict[str, np.ndarray]  # the delta's named terms, each (n,); zero for dense rows
    ln_point: np.ndarray  # (n,)
    ln_samples: np.ndarray  # (n_boot, n)
    ln_dense_samples: np.ndarray  # (n_boot, n): the same draws without the delta
    in_range: np.ndarray  # every input inside the fitted ranges


def _law_contexts(fit: LawFit, context: np.ndarray) -> np.ndarray:
    """The fitted context used for each row: its own, else the nearest in ln T."""
    fitted = np.array(sorted(fit.dense))
    if len(fitted) == 1:
        return np.full(len(context), fitted[0])
    if (context == UNRECORDED_CONTEXT).any():
        raise UserError(
            f"rows need a context column: the law has dense fits at contexts {fitted.tolist()}"
        )
    nearest = np.abs(np.log(context)[:, None] - np.log(fitted)[None, :]).argmin(axis=1)
    return fitted[nearest]


def _inside(values: np.ndarray, span: list[float] | None) -> np.ndarray:
    if span is None:
        return np.zeros(len(values), dtype=bool)
    return (values >= span[0]) & (values <= span[1])


def predict_samples(fit: LawFit, frame: pd.DataFrame) -> Prediction:
    """Predict validated rows (``table.validate(rows, need_loss=False).frame``).

    A paired-baseline law fitted without a dense law (its dense runs were of one
    size) predicts deltas only: ``ln_dense`` is then 0, so ``ln_point`` is the
    delta; callers check ``fit.dense`` before calling it a loss.
    """
    ln_n, ln_d = _logs(frame)
    context = frame["context"].to_numpy()
    if fit.dense:
        used = _law_contexts(fit, context)
        ln_dense = dense.log_loss_at({t: d.value for t, d in fit.dense.items()}, used, ln_n, ln_d)
        ln_dense_samples = dense.log_loss_at(
            {t: d.samples for t, d in fit.dense.items()}, used, ln_n, ln_d
        )
    else:
        if fit.delta is None:
            raise UserError("the law has neither a dense law nor a delta law to predict with")
        used = context
        ln_dense = np.zeros(len(frame))
        ln_dense_samples = np.zeros((len(fit.delta.samples), len(frame)))
    ln_samples = ln_dense_samples.copy()
    terms = {name: np.zeros(len(frame)) for name in TERMS}
    sparse = frame["is_sparse"].to_numpy()
    ranges = fit.ranges
    in_range = _inside(frame["params_active"].to_numpy(), ranges["params_active"])
    in_range &= _inside(frame["tokens"].to_numpy(), ranges["tokens"]) & (used == context)
    if sparse.any():
        law = fit.delta
        if law is None:
            raise UserError(
                "the law was fitted on dense runs only; it cannot predict X-MoD rows (stride > 1, capacity < 1)"
            )
        x = Features.of(frame[sparse], fit.reference)
        for name, term in law.spec.terms(law.value, x).items():
            terms[name][sparse] = term
        ln_samples[:, sparse] += law.spec.predict(law.samples, x)
        in_range[sparse] &= _inside(frame.loc[sparse, "stride"].to_numpy(), ranges["stride"])
        in_range[sparse] &= _inside(frame.loc[sparse, "capacity"].to_numpy(), ranges["capacity"])
    ln_point = ln_dense + sum(terms.values())
    return Prediction(used, ln_dense, terms, ln_point, ln_samples, ln_dense_samples, in_range)


def predicts_losses(fit: LawFit) -> bool:
    """Whether ``fit`` predicts losses (it has a dense law) or only differences from
    dense: a paired-baseline law fitted on dense runs of one size measures each
    routed run against its partner's observed loss, so it knows ln L(routed) -
    ln L(dense) at a configuration but not L itself."""
    return bool(fit.dense)


def predict(fit: LawFit, rows: pd.DataFrame) -> pd.DataFrame:
    """One prediction per row: loss with 95% interval, dense loss, delta and its three terms.

    Rows need ``params_active`` and ``tokens``; ``stride``/``capacity`` default to
    dense and ``context`` to the law's only context. The interval is the 2.5-97.5
    percentile of the bootstrap draws of the whole law (dense and delta paired).
    A law without a dense law (:func:`predicts_losses` false) predicts the
    difference instead: ``delta`` = ln L(routed) - ln L(FLOP-matched dense) with
    its interval ``delta_lo``/``delta_hi`` (0 on dense rows), and no loss columns.
    """
    frame = validate(rows, need_loss=False).frame
    p = predict_samples(fit, frame)
    out = frame[["params_active", "tokens", "context", "stride", "capacity", "rho"]].copy()
    out["law_context"] = p.law_context
    delta = p.ln_point - p.ln_dense
    if predicts_losses(fit):
        ci = interval(np.exp(p.ln_samples), np.exp(p.ln_point))
        out["pred_loss"] = np.exp(p.ln_point)
        out["lo"], out["hi"] = ci[:, 0], ci[:, 1]
        out["dense_loss"] = np.exp(p.ln_dense)
        out["delta"] = delta
    else:
        ci = interval(p.ln_samples - p.ln_dense_samples, delta)
        out["delta"] = delta
        out["delta_lo"], out["delta_hi"] = ci[:, 0], ci[:, 1]
    for name in TERMS:
        out[f"{name}_term"] = p.terms[name]
    out["in_range"] = p.in_range
    return out
