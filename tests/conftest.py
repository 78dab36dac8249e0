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
    torch.set_num_threads(1)  # tiny models: one thread avoids contention


WORDS = (
    "the a of and to in is was he she it that for on with as his her they at by this had "
    "not are but from or have an which one you were all we when there can said who will "
    "ship whale sea captain king queen union state people law war peace house time day"
).split()


def synthetic_documents(n_docs: int = 60, seed: int = 0) -> list[str]:
    """Pseudo-English documents with some structure (repeated phrases) to learn from."""
    import random

    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        sentences = []
        for _ in range(rng.randint(20, 40)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(4, 12))]
            sentences.append(" ".join(words).capitalize() + ".")
        docs.append(" ".join(sentences))
    return docs


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory: pytest.TempPathFactory):
    """A prepared data directory (vocab 300) built offline from synthetic text files."""
    from xmodlm.data.prepare import prepare

    root = tmp_path_factory.mktemp("corpus")
    src = root / "src"
    src.mkdir()
    for i, doc in enumerate(synthetic_documents()):
        (src / f"doc{i:03d}.txt").write_text(doc)
    out = root / "prepared"
    prepare(out, vocab_size=300, texts=[src])
    return out
