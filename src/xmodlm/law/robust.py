"""Huber loss, bounded L-BFGS-B from many starts, and bootstrap resampling.

Shared by the dense law and the delta law so both are fitted the same careful
way (DESIGN 5): Huber loss with delta 1e-3 on ln L, *summed* over runs (an
average shrinks the gradient by 1/n and L-BFGS stops early), bounds, several
starts with the best kept, and the optimiser's own verdict plus the projected
gradient norm reported so a reader can see whether the fit converged.
"""

from __future__ import annotations

import ctypes
import functools
import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy
from scipy.optimize import minimize as _scipy_minimize
from scipy.stats import qmc

HUBER_DELTA = 1e-3

# Tight tolerances. A good fit's summed Huber loss is ~1e-3 and mostly linear
# (|r| > delta), so with scipy's defaults (ftol 2.2e-9, gtol 1e-5) a bootstrap
# refit stops almost where it starts: measured on 200 runs, the dense intervals
# came out 2-10x too narrow. At 1e-13 / 1e-10 they agree with 1e-11 / 1e-9.
_OPTIONS = {"maxiter": 3000, "ftol": 1e-13, "gtol": 1e-10}

Objective = Callable[[np.ndarray], tuple[float, np.ndarray]]
Bounds = Sequence[tuple[float, float]]


@functools.cache
def _scipy_openblas() -> ctypes.CDLL | None:
    """The OpenBLAS that scipy's wheels vendor (and L-BFGS-B links), if this is one."""
    for path in sorted(
        (Path(scipy.__file__).parent.parent / "scipy.libs").glob("libscipy_openblas*.so*")
    ):
        lib = ctypes.CDLL(str(path))  # already loaded: dlopen returns the same handle
        if hasattr(lib, "scipy_openblas_set_num_threads"):
            return lib
    return None


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """Run scipy's OpenBLAS on one thread inside the block, then restore it.

    Every :func:`minimize` runs inside it, whoever calls.

    L-BFGS-B makes a few tiny LAPACK calls per iteration. On a busy 2-core
    machine OpenBLAS's worker threads fight for the cores and every call stalls:
    one bootstrap refit went from 8 ms to 110 ms. Our problems have at most six
    parameters, so one thread is always fastest. Builds whose BLAS is not the
    scipy-openblas wheel library are left as they are.
    """
    lib = _scipy_openblas()
    if lib is None:
        yield
        return
    before = lib.scipy_openblas_get_num_threads()
    lib.scipy_openblas_set_num_threads(1)
    try:
        yield
    finally:
        lib.scipy_openblas_set_num_threads(before)


def huber(r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Huber loss of residuals ``r`` and its derivative, elementwise.

    ``psi * (r - psi / 2)`` equals r^2/2 inside [-delta, delta] and
    delta (|r| - delta/2) outside, without a branch.
    """
    psi = np.clip(r, -HUBER_DELTA, HUBER_DELTA)
    return psi * (r - 0.5 * psi), psi


@dataclass(frozen=True)
class Optimum:
    """One L-BFGS-B run: where it stopped and whether it says it converged."""

    x: np.ndarray
    loss: float
    converged: bool
    grad_norm: float  # Euclidean norm of the projected gradient at x
    message: str
    n_iter: int

    def report(self) -> dict[str, object]:
        return {
            "converged": self.converged,
            "grad_norm": self.grad_norm,
            "loss": self.loss,
            "message": self.message,
            "iterations": self.n_iter,
        }


def projected_gradient(x: np.ndarray, g: np.ndarray, bounds: Bounds) -> np.ndarray:
    """The gradient with components that push against an active bound removed."""
    lo, hi = np.asarray(bounds, dtype=float).T
    out = g.copy()
    out[(x <= lo) & (g > 0)] = 0.0
    out[(x >= hi) & (g < 0)] = 0.0
    return out


def minimize(objective: Objective, x0: np.ndarray, bounds: Bounds) -> Optimum:
    """Bounded L-BFGS-B from ``x0``; ``objective`` returns (loss, gradient)."""
    with one_blas_thread():
        res = _scipy_minimize(
            objective, x0, jac=True, method="L-BFGS-B", bounds=bounds, options=_OPTIONS
        )
    return Optimum(
        x=res.x,
        loss=float(res.fun),
        converged=bool(res.success),
        grad_norm=float(np.linalg.norm(projected_gradient(res.x, res.jac, bounds))),
        message=str(res.message),
        n_iter=int(res.nit),
    )


def best_of(objective: Objective, starts: np.ndarray, bounds: Bounds) -> list[Optimum]:
    """Run L-BFGS-B from every row of ``starts``; optima sorted best first."""
    return sorted((minimize(objective, x0, bounds) for x0 in starts), key=lambda o: o.loss)


def distinct(optima: Sequence[Optimum], bounds: Bounds, limit: int) -> list[np.ndarray]:
    """Up to ``limit`` parameter vectors of *different* optima, best first.

    Two optima are the same when every parameter agrees to 1e-3 of its bound
    range; used to pick bootstrap starts that cover other basins, not re-runs of
    the best one.
    """
    lo, hi = np.asarray(bounds, dtype=float).T
    scale = hi - lo
    kept: list[np.ndarray] = []
    for opt in optima:
        if all(np.max(np.abs(opt.x - k) / scale) > 1e-3 for k in kept):
            kept.append(opt.x)
        if len(kept) == limit:
            break
    return kept


def sobol_box(box: Bounds, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` scrambled Sobol points in the box (n a power of two for balance)."""
    lo, hi = np.asarray(box, dtype=float).T
    unit = qmc.Sobol(len(lo), scramble=True, rng=rng).random(n)
    return lo + unit * (hi - lo)


def n_workers() -> int:
    """Processes for bootstrap refits: one per usable core where ``fork`` exists, else 1.

    ``fork`` because a child then starts in milliseconds with everything already
    imported; the children run only numpy and scipy code.
    """
    if "fork" not in multiprocessing.get_all_start_methods():
        return 1
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def map_chunks(
    fn: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]], rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Apply ``fn`` to one contiguous chunk of ``rows`` per worker; stack the results.

    ``fn`` maps a block of bootstrap rows to (samples for those rows, converged
    flag per row). Results do not depend on the number of workers: each
    replicate is fitted from the same starts whichever process runs it.
    """
    chunks = np.array_split(rows, min(n_workers(), len(rows)))
    if len(chunks) == 1:
        results = [fn(rows)]
    else:
        with ProcessPoolExecutor(
            len(chunks), mp_context=multiprocessing.get_context("fork")
        ) as pool:
            results = list(pool.map(fn, chunks))
    return np.vstack([r[0] for r in results]), np.concatenate([r[1] for r in results])


def refit_replicate(objective: Objective, starts: np.ndarray, retry: np.ndarray,
                    bounds: Bounds) -> Optimum:
    """One bootstrap refit: the best optimum from ``starts``; if L-BFGS-B does not
    report convergence there, again from the larger ``retry`` set. The caller
    drops (and counts) a replicate that still has not converged."""
    opt = min((minimize(objective, x0, bounds) for x0 in starts), key=lambda o: o.loss)
    if not opt.converged:
        opt = min((opt, *(minimize(objective, x0, bounds) for x0 in retry)),
                  key=lambda o: (not o.converged, o.loss))
    return opt


def resample_weights(
    n: int, n_boot: int, rng: np.random.Generator, clusters: np.ndarray | None = None
) -> np.ndarray:
    """Bootstrap replicates as counts: row b says how often each run was drawn.

    Resampling runs with replacement is the same as weighting each run's loss
    by its draw count, which keeps the arrays fixed-size and the fits fast.
    With ``clusters`` (one id per run: the configuration, seeds sharing it) whole
    clusters are drawn and every run of a drawn cluster gets its count, so runs
    that differ only by seed are never treated as independent configurations.
    """
    if clusters is None:
        return rng.multinomial(n, np.full(n, 1.0 / n), size=n_boot).astype(float)
    _, index = np.unique(np.asarray(clusters), return_inverse=True)
    k = int(index.max()) + 1
    draws = rng.multinomial(k, np.full(k, 1.0 / k), size=n_boot).astype(float)
    return draws[:, index]


def interval(samples: np.ndarray, point: np.ndarray) -> np.ndarray:
    """95% percentile interval of ``samples`` over replicates (axis 0), widened to hold ``point``.

    The point estimate is the full-data fit; it lies inside its own bootstrap
    interval unless the bootstrap distribution is strongly skewed, and then the
    interval is stretched to include it rather than reporting lo > value.
    """
    lo, hi = np.percentile(samples, [2.5, 97.5], axis=0)
    return np.stack([np.minimum(lo, point), np.maximum(hi, point)], axis=-1)
