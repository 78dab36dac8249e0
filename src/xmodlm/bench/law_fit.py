"""The law-fit benchmark (``xmod bench`` reports it as ``law_fit_s``)."""

from __future__ import annotations

import time

from xmodlm.law.fit import fit_law
from xmodlm.law.synthetic import synthetic_runs


def bench_fit(n_runs: int = 200, n_boot: int = 1000, seed: int = 0) -> float:
    """Seconds for one full ``fit_law`` on ``n_runs`` synthetic runs with ``n_boot`` replicates.

    Full means everything ``xmod law fit`` does: the dense law at each context and
    every delta form, each with its bootstrap, plus held-out form selection.
    Generating the table is not timed.
    """
    runs = synthetic_runs(n_runs, seed=seed)
    start = time.perf_counter()
    fit_law(runs, n_boot=n_boot, seed=seed)
    return time.perf_counter() - start
