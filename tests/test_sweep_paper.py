"""Sweep specs in the paper's language: families of (K, A, N0) on one backbone, matched
by active depth and compute; and a sweep refusing to start from uncommitted code."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from xmodlm import depth, flops, hardware
from xmodlm.cli import main
from xmodlm.errors import UserError
from xmodlm.sweep import expand, load_spec
from xmodlm.sweep.spec import check_requirements, run_id


def _paper(families: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"name": "paper-tiny", "base": "cpu-d64", "context": [256], "compute": [2.0e12],
            "families": families, "seeds": [0], **extra}


def _one_line(err: pytest.ExceptionInfo[UserError]) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_paper_families_share_active_depth_and_compute() -> None:
    """Every family keeps the backbone's 8 active layers and gets the same C, so a
    sparse model's layout is the paper's construction (not a depth chosen to match
    FLOPs) and it trains on more tokens than dense."""
    runs = expand(_paper([
        {"family": "dense"},
        {"family": "xmod", "sparsity": [2, 4], "anchor_stride": [0.5, 1]},
        {"family": "xmod", "sparsity": 4, "anchor_stride": 1, "balance": "none"},
        {"family": "xmod", "sparsity": 4, "anchor_stride": 1, "anchors": False},
        {"family": "xmod", "sparsity": 4, "anchor_stride": 1, "dense_prefix": 0},
        {"family": "moe", "seeds": [0]},
    ]))
    assert len(runs) == 1 + 4 + 3 + 1
    dense = runs[0].cfg.model
    assert dense.block_layout == "D" * 8
    f_dense = flops.count(dense).flops_train
    for r in runs:
        m = r.cfg.model
        assert r.compute == 2.0e12 and m.active_layers == 8.0
        assert (m.d_model, m.n_heads, m.n_kv_heads, m.head_dim) == (64, 4, 2, 16)
        assert flops.active_depth(m) == pytest.approx(8.0, abs=1e-9)
        if m.mlp == "moe":
            continue
        assert m.block_layout == depth.paper_layout(m.sparsity, m.anchor_stride, m.dense_prefix,
                                                    8, m.anchors)
        if m.sparsity > 1:
            assert r.row()["tokens"] > runs[0].row()["tokens"]
            assert flops.count(m).flops_train < f_dense
    moe = runs[-1].cfg.model  # the paper's 8:64 recipe, read from its preset
    assert (moe.moe_router, moe.n_experts, moe.moe_top_k, moe.moe_shared, moe.expert_dim) == (
        "fine", 64, 6, 2, 24)
    assert {r.cfg.model.balance for r in runs if r.cfg.model.sparsity == 4} == {"token_bias", "none"}


def test_the_paper_mod_and_an_impossible_combination_are_refused_in_one_line() -> None:
    """The construction cannot build K = 3 at A = 1/2 (A K = 1.5 sparse blocks a
    stage), nor the paper's MoD at 8 active layers (1 + 9/8 N1 is never 8 with a
    whole prefix): each refusal names the family and the combination."""
    with pytest.raises(UserError) as err:
        expand(_paper([{"family": "xmod", "sparsity": [2, 3], "anchor_stride": 0.5}]))
    assert "family xmod (K=3, A=0.5, N0=2, active_layers=8)" in _one_line(err)
    with pytest.raises(UserError) as err:
        expand(_paper([{"family": "mod"}]))
    assert "family mod (K=8, A=0.125, N0=1, active_layers=8)" in _one_line(err)
    (mod,) = expand(_paper([{"family": "mod", "active_layers": 7.75}]))
    assert mod.cfg.model.block_layout == "D" + "sD" * 6 and mod.cfg.model.family == "mod"
    assert (mod.cfg.model.gate_scope, mod.cfg.model.balance) == ("ffn", "none")
    with pytest.raises(UserError) as err:
        expand(_paper([{"family": "xmod", "anchor_stride": 1}]))
    assert "needs sparsity" in _one_line(err)


@pytest.mark.parametrize(("spec", "says"), [
    (_paper([{"family": "xmod", "stride": 4, "capacity": 0.25}]), "give sparsity"),
    (_paper([{"family": "dense"}], dense=[{"width": 64, "n_layers": 8}]), "give no dense"),
    (_paper([{"family": "xmod", "sparsity": 8, "anchors": "first"}]), "true or false"),
    (_paper([{"family": "xmod", "sparsity": 0.5}]), "must be >= 1"),
    (_paper([{"family": "xmod", "sparsity": 8, "balance": "loss"}]), "allowed: token_bias"),
    (_paper([{"family": "dense", "optimizer": "sgd"}]), "allowed: adamw, muon"),
    ({"base": "micro", "compute": [1e12], "dense": [{"width": 32, "n_layers": 2}],
      "families": [{"family": "xmod", "sparsity": 8}]}, "paper's (K, A, N0) construction"),
])
def test_keys_of_the_other_language_or_bad_values_are_one_line(spec: dict, says: str) -> None:
    with pytest.raises(UserError) as err:
        expand(spec)
    assert says in _one_line(err)


def test_optimizer_and_rate_cross_and_leave_legacy_ids_alone() -> None:
    """A per-family optimizer and rate cross like any list; in a (stride, capacity)
    spec an optimizer at its default renames no run."""
    runs = expand(_paper([{"family": "dense", "optimizer": ["adamw", "muon"],
                           "lr": [1.6e-3, 3.2e-3]}], seeds=[0, 1]))
    assert {(r.cfg.train.optimizer, r.cfg.train.lr, r.cfg.train.seed) for r in runs} == {
        (o, lr, s) for o in ("adamw", "muon") for lr in (1.6e-3, 3.2e-3) for s in (0, 1)}
    legacy = {"base": "micro", "compute": [1e12], "dense": [{"width": 32, "n_layers": 2}],
              "families": [{"family": "xmod", "stride": 2, "capacity": 0.5}]}
    plain = expand(legacy)
    legacy["families"][0]["optimizer"] = "adamw"
    assert [r.run_id for r in expand(legacy)] == [r.run_id for r in plain]
    legacy["families"][0]["optimizer"] = "muon"
    assert expand(legacy)[0].run_id != plain[0].run_id


def test_batch_tokens_is_the_trainers_own_in_the_paper_language() -> None:
    runs = expand(_paper([{"family": "dense"}], context=[256, 512], batch_tokens=4096))
    assert [(r.cfg.train.batch_tokens, r.steps) for r in runs] == [
        (4096, int(2.0e12 / flops.count(r.cfg.model).flops_train // 4096)) for r in runs]
    assert run_id(runs[0].cfg) != run_id(runs[1].cfg)


def test_shipped_paper_specs() -> None:
    """The study's grid as its header says: 60 runs in paper-cpu, each family at the
    backbone's active depth and its context's one budget, the headline cells and the
    four ablations at three seeds at L = 1024, and at the other contexts dense and
    seed 0's best K (added as seed 0 names it), the MoE beside an X-MoD of its total
    parameters, and at L = 4096 dense alone (the X-MoD there waits for the registered
    prediction); 24 dense runs in paper-cpu-lr. Both meet their design rules (epochs
    need the data: unchecked)."""
    runs = expand(load_spec("paper-cpu"))
    assert len(runs) == 60
    budgets: dict[int, set[float]] = {}
    for r in runs:
        budgets.setdefault(r.cfg.model.context, set()).add(r.compute)
    assert all(len(b) == 1 for b in budgets.values()) and sorted(budgets) == [256, 512, 1024, 2048, 4096]
    assert {r.cfg.model.active_layers for r in runs if r.cfg.model.family != "mod"} == {8.0}
    cells: dict[tuple, set[int]] = {}
    for r in runs:
        m = r.cfg.model
        key = (m.family, m.sparsity, m.anchor_stride, m.dense_prefix, m.anchors, m.gating,
               m.balance, m.context)
        cells.setdefault(key, set()).add(r.cfg.train.seed)
    three = {k for k, seeds in cells.items() if seeds == {0, 1, 2}}
    at_1024 = {k for k in three if k[-1] == 1024}
    assert {(k[0], k[1]) for k in at_1024} == {("dense", 1.0), ("xmod", 8.0), ("xmod", 16.0),
                                               ("mod", 8.0), ("moe", 1.0)}
    assert len(at_1024) == 9
    elsewhere: dict[int, set[str]] = {}
    for k in three - at_1024:  # one best K beside dense at each other context
        elsewhere.setdefault(k[-1], set()).add(k[0])
    assert all(families == {"dense", "xmod"} for families in elsewhere.values())
    assert sorted(elsewhere) == [256, 512]
    assert {r.cfg.model.family for r in runs if r.cfg.model.context == 4096} == {"dense"}
    moe = next(r for r in runs if r.cfg.model.family == "moe")
    twin = next(r for r in runs if r.cfg.model.sparsity == 16 and r.cfg.model.context == 1024
                and r.cfg.model.anchor_stride == 1)
    ratio = flops.count(twin.cfg.model).params_total / flops.count(moe.cfg.model).params_total
    assert ratio == pytest.approx(1.0, abs=0.05)
    spec = load_spec("paper-cpu")
    check_requirements(runs, spec["require"])
    lr_runs = expand(load_spec("paper-cpu-lr"))
    assert len(lr_runs) == 24 and {r.cfg.model.family for r in lr_runs} == {"dense"}
    assert {r.cfg.train.optimizer for r in lr_runs} == {"adamw", "muon"}
    check_requirements(lr_runs, load_spec("paper-cpu-lr")["require"])


def _dirty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hardware, "git_state",
                        lambda: hardware.GitState("0123456789abcdef", True, "/src"))


def test_a_sweep_refuses_a_dirty_tree_unless_allowed(
    tiny_data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Tracked files that differ from the commit: ``xmod sweep`` starts no run (one
    line, exit 2), and a run that is allowed to start records its commit as dirty."""
    from xmodlm.sweep.runner import check_source_tree

    spec = {"name": "tiny", "base": "micro", "compute": [2.0e9], "context": [32],
            "dense": [{"width": 32, "n_layers": 2, "n_heads": 2}], "families": [{"family": "dense"}],
            "set": [f"data.dir={tiny_data_dir}", "model.vocab_size=300", "train.batch_size=4",
                    "train.max_steps=2", "data.val_batches=1", "train.warmup_steps=1"]}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    _dirty(monkeypatch)
    out = tmp_path / "sweep"
    assert main(["sweep", str(path), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--allow-dirty" in err and "uncommitted" in err
    assert not list(out.glob("runs/*"))
    check_source_tree(allow_dirty=True)  # allowed: no refusal
    assert hardware._git_commit() == "0123456789abcdef-dirty"  # what each run records
    monkeypatch.setattr(hardware, "git_state", lambda: None)  # not a git checkout
    check_source_tree(allow_dirty=False)
