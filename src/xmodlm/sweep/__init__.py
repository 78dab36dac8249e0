"""Sweeps: specs expanded into compute-matched runs, executors, the results table."""

from xmodlm.sweep.results import collect_results, write_results
from xmodlm.sweep.runner import run_sweep
from xmodlm.sweep.spec import expand, load_spec

__all__ = ["collect_results", "expand", "load_spec", "run_sweep", "write_results"]
