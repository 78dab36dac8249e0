"""The X-MoD delta law: y = ln(L_x / L_d_hat) as a function of the routing config.

L_d_hat is the *fitted* dense law at the X-MoD run's own (N_ae, D) and context
(DESIGN 5.2), not the loss of a compute-matched dense run: it exists for every
X-MoD run (a sweep need not pair each one with a dense twin), it averages the
seed noise of all dense runs instead of inheriting one run's, and its bootstrap
replicates carry the dense law's uncertainty into the delta's intervals.

Every form is a sum of three named terms, each exactly zero in the dense limit
(S = 1 or c = 1, where rho = 1, ln rho = 0, ln S = 0 or 1 - c = 0):

* ``capacity``: sparse-capacity gain, a function of the expansion ratio rho that
  is negative (lower loss) when g_cap > 0; forms differ only here;
* ``context``: sparse-context correction g_ctx (1 - 1/S)(1 - c) ln(T / T0):
  routed attention sees only c T tokens, so the benefit may change with T;
* ``interaction``: anchor-stride interaction g_int ln S ln rho: the same
  expansion reached with sparser anchors may be worth more or less.

A parameter whose effect the data cannot show (``g_ctx`` with one context,
``g_int`` with one stride, ``kappa`` over less than a factor 2 in N_ae) is held at
its neutral value and reported as fixed rather than fitted to noise.

T0 and N0 are fixed references, not fitted: T0 = 1024 tokens, N0 = 1e8 active
parameters. They are stored in every fit so predictions stay consistent.

Derivatives come from the complex step (f(x + ih) = f(x) + ih f'(x) + O(h^2)):
exact to rounding for any analytic form, so a new form is one formula.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import pandas as pd

from xmodlm.errors import UserError
from xmodlm.law.robust import (
    Optimum,
    best_of,
    distinct,
    huber,
    map_chunks,
    refit_replicate,
    sobol_box,
)

REFERENCE = {"T0": 1024.0, "N0": 1e8}
TERMS = ("capacity", "context", "interaction")
N_SOBOL = 16  # Sobol starts besides the init; every start is run to convergence
N_BOOT_STARTS = 5  # best fit and rival optima; a non-converged replicate retries from all starts
RIVAL_LOSS = 1.25  # as for the dense law: rival optima within 25% seed the bootstrap
_STEP = 1e-20  # complex-step size: no cancellation, so any tiny step is exact
NEEDS = {  # what each kind of variation means, for messages
    "contexts": "at least 2 context lengths",
    "strides": "at least 2 strides",
    "scale": "N_ae spanning at least a factor of 2",
    "curvature": "at least 3 expansion ratios",
}


@dataclass(frozen=True)
class Features:
    """What the delta law sees of each X-MoD run, as columns of length n."""

    ln_rho: np.ndarray
    ln_s: np.ndarray
    sparse: np.ndarray  # (1 - 1/S)(1 - c): the share of (block, token) pairs routed around
    ln_t: np.ndarray  # ln(T / T0)
    ln_n: np.ndarray  # ln(N_ae / N0)
    stride: np.ndarray
    context: np.ndarray

    @classmethod
    def of(cls, frame: pd.DataFrame, reference: Mapping[str, float]) -> Features:
        """Features of validated rows (columns stride, capacity, rho, context, params_active)."""
        s = frame["stride"].to_numpy(float)
        c = frame["capacity"].to_numpy(float)
        t = frame["context"].to_numpy(float)
        return cls(
            ln_rho=np.log(frame["rho"].to_numpy(float)),
            ln_s=np.log(s),
            sparse=(1 - 1 / s) * (1 - c),
            ln_t=np.log(t / reference["T0"]),
            ln_n=np.log(frame["params_active"].to_numpy(float) / reference["N0"]),
            stride=s,
            context=t,
        )

    def subset(self, mask: np.ndarray) -> Features:
        return Features(**{f.name: getattr(self, f.name)[mask] for f in dataclasses.fields(self)})

    def varies(self) -> set[str]:
        """Which kinds of variation the data hold (what each parameter ``needs``)."""
        out = set()
        if len(np.unique(self.context)) > 1:
            out.add("contexts")
        if len(np.unique(self.stride)) > 1:
            out.add("strides")
        if np.ptp(self.ln_n) >= np.log(2):
            out.add("scale")
        if len(np.unique(np.round(self.ln_rho, 9))) > 2:
            out.add("curvature")
        return out


@dataclass(frozen=True)
class Param:
    """One delta-law parameter: its bounds, where starts are drawn, and what identifies it."""

    name: str
    bounds: tuple[float, float]
    start: tuple[float, float]  # the box multi-start draws from (narrower than bounds)
    init: float
    needs: str | None = None  # the data variation that identifies it
    neutral: float | None = 0.0  # its value when the data lack that (None: form unusable)


CapacityTerm = Callable[[Mapping[str, np.ndarray], Features], np.ndarray]


@dataclass(frozen=True)
class Form:
    """One candidate delta law: its parameters and its capacity-gain term."""

    name: str
    summary: str
    params: tuple[Param, ...]
    capacity: CapacityTerm

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def terms(self, theta: np.ndarray, x: Features) -> dict[str, np.ndarray]:
        """The three named terms for params ``theta`` of shape (..., p); each (..., n)."""
        p = {name: np.asarray(theta)[..., i, None] for i, name in enumerate(self.names)}
        return {
            "capacity": self.capacity(p, x),
            "context": p["g_ctx"] * x.sparse * x.ln_t,
            "interaction": p["g_int"] * x.ln_s * x.ln_rho,
        }

    def predict(self, theta: np.ndarray, x: Features) -> np.ndarray:
        """y = ln(L_x / L_d) for params of shape (..., p); result (..., n)."""
        t = self.terms(theta, x)
        return t["capacity"] + t["context"] + t["interaction"]


def _cap_linear(p: Mapping[str, np.ndarray], x: Features) -> np.ndarray:
    return -p["g_cap"] * x.ln_rho


def _cap_scale(p: Mapping[str, np.ndarray], x: Features) -> np.ndarray:
    return -p["g_cap"] * np.exp(-p["kappa"] * x.ln_n) * x.ln_rho


def _cap_saturating(p: Mapping[str, np.ndarray], x: Features) -> np.ndarray:
    return -p["g_cap"] * p["r0"] * np.log1p(x.ln_rho / p["r0"])


def _cap_quadratic(p: Mapping[str, np.ndarray], x: Features) -> np.ndarray:
    return -p["g_cap"] * x.ln_rho + p["g_quad"] * x.ln_rho**2


# Forms hold module-level functions, not lambdas, so bootstrap workers can pickle them.
G_CAP = Param("g_cap", (-2.0, 2.0), (-0.1, 0.2), 0.02)
G_CTX = Param("g_ctx", (-2.0, 2.0), (-0.1, 0.1), 0.0, needs="contexts")
G_INT = Param("g_int", (-2.0, 2.0), (-0.1, 0.1), 0.0, needs="strides")
KAPPA = Param("kappa", (-1.0, 1.0), (-0.3, 0.5), 0.0, needs="scale")
R0 = Param("r0", (0.05, 100.0), (0.2, 3.0), 1.0, needs="curvature", neutral=None)
G_QUAD = Param("g_quad", (-2.0, 2.0), (-0.05, 0.05), 0.0, needs="curvature")

FORMS: dict[str, Form] = {
    form.name: form
    for form in (
        Form(
            "base",
            "capacity gain linear in ln rho: -g_cap ln rho",
            (G_CAP, G_CTX, G_INT),
            _cap_linear,
        ),
        Form(
            "scale",
            "capacity gain shrinking with scale: -g_cap (N_ae/N0)^-kappa ln rho",
            (G_CAP, KAPPA, G_CTX, G_INT),
            _cap_scale,
        ),
        Form(
            "saturating",
            "capacity gain saturating in rho: -g_cap r0 ln(1 + ln rho / r0), slope g_cap at rho = 1",
            (G_CAP, R0, G_CTX, G_INT),
            _cap_saturating,
        ),
        Form(
            "quadratic",
            "capacity gain with curvature: -g_cap ln rho + g_quad (ln rho)^2",
            (G_CAP, G_QUAD, G_CTX, G_INT),
            _cap_quadratic,
        ),
    )
}


def get_form(name: str) -> Form:
    if name not in FORMS:
        raise UserError(f"unknown delta form {name!r}; known forms: {', '.join(FORMS)}")
    return FORMS[name]


def free_mask(form: Form, x: Features) -> np.ndarray:
    """Which parameters the data can identify; UserError when the form cannot be fitted."""
    varies = x.varies()
    free = np.array([p.needs is None or p.needs in varies for p in form.params])
    for p, ok in zip(form.params, free, strict=True):
        if not ok and p.neutral is None:
            raise UserError(
                f"delta form {form.name!r}: parameter {p.name} needs X-MoD runs with {NEEDS[p.needs]}"
            )
    if len(x.ln_rho) <= free.sum():
        raise UserError(
            f"delta form {form.name!r}: {len(x.ln_rho)} X-MoD runs cannot fit {int(free.sum())}"
            f" parameters; need at least {int(free.sum()) + 1}"
        )
    return free


def _objective(
    theta: np.ndarray,
    form: Form,
    full: np.ndarray,
    free: np.ndarray,
    x: Features,
    y: np.ndarray,
    w: np.ndarray,
) -> tuple[float, np.ndarray]:
    """Summed weighted Huber loss of y and its gradient in the free parameters (complex step)."""
    k = len(theta)
    batch = np.tile(full.astype(complex), (k, 1))
    batch[:, free] = theta
    batch[np.arange(k), np.flatnonzero(free)] += 1j * _STEP
    out = form.predict(batch, x)  # row j: prediction with free parameter j moved by i * step
    h, psi = huber(out[0].real - y)
    return float(w @ h), (out.imag / _STEP) @ (w * psi)


@dataclass(frozen=True)
class DeltaFit:
    """The full-data fit of one form, and what its bootstrap restarts from."""

    form: Form
    theta: np.ndarray  # all parameters, fixed ones at their neutral value
    free: np.ndarray
    optimum: Optimum
    n_runs: int
    boot_starts: np.ndarray  # (k, n_free)
    retry_starts: np.ndarray  # (N_SOBOL + 1, n_free): where a non-converged replicate restarts

    @property
    def fixed(self) -> tuple[str, ...]:
        return tuple(n for n, f in zip(self.form.names, self.free, strict=True) if not f)

    def report(self) -> dict[str, object]:
        needs = {p.name: p.needs for p in self.form.params}
        return {
            **self.optimum.report(),
            "starts": N_SOBOL + 1,
            "bootstrap_starts": len(self.boot_starts),
            "fixed": {
                name: f"held at 0: needs X-MoD runs with {NEEDS[needs[name]]}"
                for name in self.fixed
            },
        }


def fit_delta(form: Form, x: Features, y: np.ndarray, rng: np.random.Generator) -> DeltaFit:
    """Fit ``form`` to y = ln(L_x / L_d_hat) by summed Huber loss from the init and Sobol starts."""
    free = free_mask(form, x)
    full = np.array([p.init if f else p.neutral for p, f in zip(form.params, free, strict=True)])
    params = [p for p, f in zip(form.params, free, strict=True) if f]
    bounds = [p.bounds for p in params]
    starts = np.vstack([full[free], sobol_box([p.start for p in params], N_SOBOL, rng)])
    w = np.ones_like(y)
    optima = best_of(lambda t: _objective(t, form, full, free, x, y, w), starts, bounds)
    best = optima[0]
    full[free] = best.x
    rivals = [o for o in optima if o.loss <= RIVAL_LOSS * best.loss]
    return DeltaFit(
        form, full, free, best, len(y), np.array(distinct(rivals, bounds, N_BOOT_STARTS)), starts
    )


def bootstrap_delta(
    fit: DeltaFit, x: Features, y_boot: np.ndarray, weights: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Refit each replicate (targets y_boot[b], run weights weights[b]); (B, p), converged (B,)."""
    rows = np.arange(len(weights))
    return map_chunks(functools.partial(_refit, fit, x, y_boot, weights), rows)


def _refit(
    fit: DeltaFit, x: Features, y_boot: np.ndarray, weights: np.ndarray, rows: np.ndarray
) -> tuple[np.ndarray, int]:
    """Bootstrap refits of replicates ``rows``: all parameters (b, p), converged (b,)."""
    bounds = [p.bounds for p, f in zip(fit.form.params, fit.free, strict=True) if f]
    samples = np.tile(fit.theta, (len(rows), 1))
    converged = np.zeros(len(rows), dtype=bool)
    for i, b in enumerate(rows):
        objective = functools.partial(
            _objective, form=fit.form, full=fit.theta, free=fit.free, x=x, y=y_boot[b], w=weights[b]
        )
        opt = refit_replicate(objective, fit.boot_starts, fit.retry_starts, bounds)
        samples[i, fit.free] = opt.x
        converged[i] = opt.converged
    return samples, converged
