"""Golden losses: a few fp32 training steps of each family must reproduce the committed curve.

Equivalence tests catch a fast path that disagrees with its reference; they do not
catch a change that moves both (an init, a gate, a loss weight, the optimiser's
parameter groups, the data order). These runs do: each family trains 12 steps on
a token stream generated here by integer arithmetic alone (no tokenizer or RNG
library whose next release could change it), and its per-step training loss and final validation loss must
match ``golden/losses.json`` to ``RTOL`` = 2e-5. That absorbs summation-order
differences (1 vs 2 threads: 2e-7 relative at most) and still fails on a 0.3%
change of the learning rate (4e-4), another gate function (1e-3) or a doubled
causal-router loss weight (2.5e-4). Small auxiliary-weight changes stay below
it: the depth-wise balancing loss is about 1e-6 at initialisation, so its weight
does not show in 12 steps; its own tests are in test_model.py.

A deliberate change regenerates the file: ``XMOD_UPDATE_GOLDEN=1 pytest
tests/test_golden.py``, and the diff of ``golden/losses.json`` goes in the commit.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from test_train import small_cfg
from xmodlm.train.loggers import read_metrics
from xmodlm.train.trainer import train

GOLDEN = Path(__file__).parent / "golden" / "losses.json"
RTOL = 2e-5
STEPS = 12
FAMILIES: dict[str, list[str]] = {
    "dense": ["model.stride=1", "model.capacity=1.0"],
    # S = 4: three sparse blocks share an anchor window, so depth-wise balancing acts
    "xmod": ["model.stride=4", "model.capacity=0.25"],
    # the paper's stage of four sparse blocks under the token-choice bias
    "xmod_token_bias": ["model.stride=5", "model.capacity=0.25", "model.n_layers=5",
                        "model.balance=token_bias", "model.token_bias_tau=1.0"],
    "xmod_predictor": ["model.causal_router=predictor"],  # small_cfg: S = 2, c = 0.5
    "mod": ["model.gating=logit", "model.balance_coef=0.0", "model.capacity=0.25"],
    "moe": [
        "model.stride=1", "model.capacity=1.0", "model.mlp=moe", "model.n_experts=4",
        "model.moe_top_k=2", "model.moe_d_ff=48",
    ],
}


def token_stream(n: int, vocab: int, seed: int) -> np.ndarray:
    """A learnable stream: each token is a fixed function of the previous one plus
    LCG noise in {0..3}, with an end-of-text token (0) about every 64 tokens."""
    out, x, prev = np.empty(n, dtype=np.uint16), seed, 1
    for i in range(n):
        x = (1103515245 * x + 12345) % 2**31
        prev = 0 if (x >> 8) % 64 == 0 else 1 + (prev * 37 + (x >> 16) % 4) % (vocab - 1)
        out[i] = prev
    return out


@pytest.fixture(scope="module")
def golden_data_dir(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny corpus's manifest and tokenizer, with its token files replaced by streams."""
    out = tmp_path_factory.mktemp("golden_data") / "data"
    shutil.copytree(tiny_data_dir, out)
    manifest = json.loads((out / "manifest.json").read_text())
    for i, (split, n) in enumerate((("train", 20_000), ("val", 4_000), ("test", 4_000))):
        token_stream(n, manifest["vocab_size"], seed=i + 1).tofile(out / f"{split}.bin")
        manifest["splits"][split]["tokens"] = n
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def _curve(data_dir: Path, run: Path, overrides: list[str]) -> dict[str, list[float] | float]:
    cfg = small_cfg(data_dir, f"train.max_steps={STEPS}", "train.seed=7", *overrides)
    summary = train(cfg, run, progress=False)
    rows = [r for r in read_metrics(run) if r.get("kind") != "eval"]
    return {
        "train_loss": [round(r["loss"], 6) for r in sorted(rows, key=lambda r: r["step"])],
        "final_val_loss": round(summary["final_val_loss"], 6),
    }


@pytest.fixture(scope="module")
def curves(golden_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("golden")
    out = {name: _curve(golden_data_dir, root / name, o) for name, o in FAMILIES.items()}
    if os.environ.get("XMOD_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(out, indent=1) + "\n")
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_golden_losses(curves: dict, family: str) -> None:
    golden = json.loads(GOLDEN.read_text())
    got, want = curves[family], golden[family]
    assert len(got["train_loss"]) == len(want["train_loss"]) == STEPS
    for step, (a, b) in enumerate(zip(got["train_loss"], want["train_loss"], strict=True), 1):
        assert a == pytest.approx(b, rel=RTOL), f"{family}: step {step} loss {a} != golden {b}"
    assert got["final_val_loss"] == pytest.approx(want["final_val_loss"], rel=RTOL)
