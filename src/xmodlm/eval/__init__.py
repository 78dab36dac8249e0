"""Evaluation of trained runs: held-out losses, routing statistics, downstream tasks."""

from xmodlm.eval.evaluate import evaluate_run
from xmodlm.eval.tasks import TASKS

__all__ = ["TASKS", "evaluate_run"]
