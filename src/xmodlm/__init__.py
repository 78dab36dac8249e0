"""xmod-lm: sparse-depth language models with decoupled capacity and anchor stride."""

__version__ = "0.1.0"
