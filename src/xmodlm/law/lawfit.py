"""A fitted law: what it holds, its JSON, and reading it back.

:func:`xmodlm.law.fit.fit_law` builds a :class:`LawFit`, ``xmod law fit --out``
saves it, and predict, recommend, the report and the plots read it with
:func:`load_fit`. Kept apart from the fitting so that the readers of a saved law
depend on what a law is, not on how one is fitted: the dense law per context and
every fitted delta form, each with its bootstrap draws (the draws are what
prediction intervals and probabilities are computed from), the selection, the
held-out scores and the identification flags (:func:`identification`: whether
the runs pin each parameter down, judged when the law is fitted).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from xmodlm.errors import UserError
from xmodlm.law import dense
from xmodlm.law.delta import FORMS, Form, get_form
from xmodlm.law.robust import interval
from xmodlm.law.table import UNRECORDED_CONTEXT

SCHEMA = "xmodlm.law/1"


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
