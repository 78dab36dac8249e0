"""Every shipped preset builds, matches its analytic parameter count and trains a step;
every shipped sweep spec expands into valid, FLOP-matched runs."""

from __future__ import annotations

from importlib import resources

import pytest
import torch

from xmodlm import flops
from xmodlm.config import load_config
from xmodlm.model import Transformer
from xmodlm.presets import preset_names
from xmodlm.sweep.spec import expand, load_spec

SWEEPS = sorted(
    p.name for p in (resources.files("xmodlm") / "configs" / "sweeps").iterdir()
    if p.name.endswith(".yaml")
)


SHRINK = ("model.d_model=32", "model.head_dim=8", "model.d_ff=64", "model.vocab_size=256",
          "model.context=64")


def test_presets_are_listed() -> None:
    assert {"dense-tiny", "xmod-tiny", "mod-tiny", "moe-tiny", "micro"} <= set(preset_names())


# shrunk, the paper's sizes differ only in what SHRINK overrides: one size stands for all
STEPPED = [n for n in preset_names() if not n.startswith("paper-") or n.startswith("paper-556m-")]


@pytest.mark.parametrize("name", STEPPED)
def test_preset_builds_and_steps(name: str) -> None:
    """Analytic parameter count; then three optimiser steps with the trainer's own
    optimiser and settings on one short batch: every parameter that got a gradient
    moves, and the loss on that batch goes down."""
    from xmodlm.train.optim import build_optimizer

    # the paper's presets (up to 15B parameters) step at a small width, with their
    # layout, gates, balancing, MoE routing and optimiser as given
    cfg = load_config(name, SHRINK if name.startswith("paper-") else ())
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == flops.count(cfg.model).params_total
    T = min(cfg.model.context, 32)  # a short sequence: the step, not the speed, is under test
    idx_BT = torch.randint(cfg.model.vocab_size, (2, T + 1))
    opt = build_optimizer(model, cfg.train)
    for group in opt.param_groups:
        group["lr"] = 1e-3
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = []
    for step in range(3):
        out = model(idx_BT[:, :-1], idx_BT[:, 1:])
        loss = out.total_loss
        loss.backward()
        assert torch.isfinite(loss)
        losses.append(loss.item())
        if step == 0:
            for pname, p in model.named_parameters():
                # an expert may receive no token of so short a batch; everything else must learn
                assert p.grad is not None or ".experts." in pname, pname
                assert p.grad is None or torch.isfinite(p.grad).all(), pname
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert losses[-1] < losses[0], losses
    for pname, p in model.named_parameters():
        if ".experts." not in pname:
            assert not torch.equal(p.detach(), before[pname]), f"{pname} did not move"


@pytest.mark.parametrize("spec", SWEEPS)
def test_sweep_spec_expands(spec: str) -> None:
    runs = expand(load_spec(resources.files("xmodlm") / "configs" / "sweeps" / spec))
    assert runs and len({r.run_id for r in runs}) == len(runs)
    for run in runs:
        counts = flops.count(run.cfg.model)
        assert run.compute / counts.flops_train > 0
