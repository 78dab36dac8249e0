"""Training: the loop, optimiser and schedule, checkpoints, loggers."""
