from __future__ import annotations

import dataclasses

import pytest
import torch

from xmodlm.config import ModelConfig


def tiny_model_cfg(**changes: object) -> ModelConfig:
    """A very small model (width 32, context 32) for fast CPU tests."""
    base = ModelConfig(vocab_size=97, d_model=32, n_layers=4, n_heads=4, context=32)
    cfg = dataclasses.replace(base, **changes)
    cfg.validate()
    return cfg


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
