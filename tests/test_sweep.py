"""Sweeps: expansion into compute-matched runs, executors, resume, the results table."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pandas as pd
import pytest
import yaml

from xmodlm import flops
from xmodlm.cli import main
from xmodlm.config import load_config
from xmodlm.errors import UserError
from xmodlm.sweep import collect_results, expand, load_spec, run_sweep, write_results
from xmodlm.sweep.results import COLUMNS


def _spec(tmp_path: Path, data_dir: Path, families: list[dict], **extra) -> Path:
    spec = {
        "name": "tiny",
        "base": "micro",
        "compute": [2.0e9],
        "context": [32],
        "dense": [{"width": 32, "n_layers": 2, "n_heads": 2}],
        "families": families,
        "seeds": [0],
        "set": [f"data.dir={data_dir}", "model.vocab_size=300", "train.batch_size=4",
                "train.max_steps=3", "data.val_batches=1", "train.warmup_steps=1"],
        **extra,
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


FOUR = [{"family": "dense"}, {"family": "xmod", "stride": 2, "capacity": [0.25, 0.5]},
        {"family": "mod"}]


def test_expand_is_compute_matched_with_stable_ids(tiny_data_dir: Path, tmp_path: Path) -> None:
    runs = expand(load_spec(_spec(tmp_path, tiny_data_dir, FOUR)))
    assert len(runs) == 4
    assert {r.cfg.model.family for r in runs} == {"dense", "xmod", "mod"}
    dense = next(r for r in runs if r.cfg.model.family == "dense")
    f_dense = flops.count(dense.cfg.model).flops_train
    for r in runs:
        assert r.cfg.train.compute == 2.0e9
        assert abs(flops.count(r.cfg.model).flops_train / f_dense - 1) < 0.35
        assert r.row()["tokens"] * r.row()["flops_per_token"] == pytest.approx(2.0e9)
    again = expand(load_spec(_spec(tmp_path, tiny_data_dir, FOUR)))
    assert [r.run_id for r in runs] == [r.run_id for r in again]
    assert len({r.run_id for r in runs}) == 4


def test_bad_specs(tmp_path: Path, tiny_data_dir: Path) -> None:
    with pytest.raises(UserError, match="not found"):
        load_spec(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("compute: [1]\ndense: [{width: 32, n_layers: 2}]\nfamilies: [{family: foo}]\n")
    with pytest.raises(UserError, match="family 'foo'"):
        expand(load_spec(bad))
    bad.write_text("compute: [1]\nbogus: 1\n")
    with pytest.raises(UserError, match="bogus"):
        load_spec(bad)


def test_local_sweep_runs_then_skips(tiny_data_dir: Path, tmp_path: Path) -> None:
    runs = expand(load_spec(_spec(tmp_path, tiny_data_dir, FOUR)))
    out = tmp_path / "sweep"
    first = run_sweep(runs, out, executor="local", workers=2, progress=False)
    assert first["ran"] == 4 and first["failed"] == 0, first["outcomes"]
    second = run_sweep(runs, out, executor="local", workers=2, progress=False)
    assert second["ran"] == 0 and second["skipped"] == 4
    table, left_out = collect_results(out)
    assert len(table) == 4 and not left_out
    assert list(table.columns[: len(COLUMNS)]) == COLUMNS
    assert (table["status"] == "ok").all() and (table["val_loss"] > 0).all()
    # the paper law counts N_act with embeddings from this column (xmodlm.law.reference)
    embeddings = table["params_total"] - table["params_non_embedding"]
    assert (embeddings > 0).all() and embeddings.nunique() == 1

    # a corrupt summary is reported and left out, never used
    victim = out / "runs" / runs[0].run_id / "summary.json"
    victim.write_text("{not json")
    table, left_out = collect_results(out)
    assert len(table) == 3 and left_out == {runs[0].run_id: "corrupt summary.json"}
    path, n, _ = write_results(out)
    assert n == 3 and len(pd.read_csv(path)) == 3


def test_failing_run_is_recorded_and_others_finish(tiny_data_dir: Path, tmp_path: Path) -> None:
    runs = expand(load_spec(_spec(tmp_path, tiny_data_dir, [{"family": "dense"}, {"family": "mod"}])))
    # make one run impossible in a way only its own process finds: heads that do not
    # divide the width (the sweep's up-front checks are of the data, not of this)
    bad = runs[1]
    bad.cfg.model.n_heads = 3
    out = tmp_path / "sweep"
    result = run_sweep(runs, out, executor="local", workers=1, max_retries=1, progress=False)
    assert result["failed"] == 1 and result["ran"] == 2
    failure = json.loads((out / "runs" / bad.run_id / "failure.json").read_text())
    assert failure["attempts"] == 1 and "n_heads" in failure["error_tail"]
    result = run_sweep(runs, out, executor="local", max_retries=1, progress=False)
    assert result["ran"] == 1 and result["skipped"] == 1  # retried once more
    result = run_sweep(runs, out, executor="local", max_retries=1, progress=False)
    assert result["ran"] == 0  # retry limit reached


@pytest.mark.slow  # a local Ray cluster takes about a minute to start on 2 cores
def test_ray_executor(tiny_data_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("ray")
    runs = expand(load_spec(_spec(tmp_path, tiny_data_dir, [{"family": "dense"}])))
    result = run_sweep(runs, tmp_path / "sweep", executor="ray", progress=False)
    assert result["ran"] == 1 and result["failed"] == 0, result["outcomes"]


def test_slurm_executor_via_submitit_local(tiny_data_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("submitit")
    runs = expand(load_spec(_spec(tmp_path, tiny_data_dir, [{"family": "dense"}])))
    result = run_sweep(runs, tmp_path / "sweep", executor="slurm", local=True,
                       progress=False)
    assert result["ran"] == 1 and result["failed"] == 0, result["outcomes"]


def test_cli_dry_run(tiny_data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    spec = _spec(tmp_path, tiny_data_dir, FOUR)
    assert main(["sweep", str(spec), "--dry-run"]) == 0
    out = capsys.readouterr().out
    for col in ("id", "family", "stride", "capacity", "n_layers", "params_total",
                "params_active", "flops_per_token", "tokens", "compute", "steps",
                "warmup_steps", "head_frac", "epochs", "est_s"):
        assert col in out
    assert main(["sweep", str(tmp_path / "missing.yaml"), "--dry-run"]) == 2


def test_dry_run_plan_is_what_the_runs_will_record(tiny_data_dir: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    """--plan writes the planned runs as results rows (ids and config columns), the
    input a registered prediction is made from; the rows are those the runs' own
    records will hold."""
    spec = _spec(tmp_path, tiny_data_dir, FOUR)
    plan = tmp_path / "plan.csv"
    assert main(["sweep", str(spec), "--dry-run", "--plan", str(plan)]) == 0
    table = pd.read_csv(plan)
    runs = expand(load_spec(spec))
    assert table["run_id"].tolist() == [r.run_id for r in runs]
    out = tmp_path / "sweep"
    run_sweep(runs[:1], out, progress=False)
    done, _ = collect_results(out)
    for col in ("family", "layout", "params_total", "params_active", "flops_per_token",
                "context", "seed"):  # compute: the budget here, what was spent there
        assert table[col].iloc[0] == done[col].iloc[0], col
    assert main(["sweep", str(spec), "--plan", str(plan)]) == 2  # a plan needs --dry-run
    assert "--dry-run" in capsys.readouterr().err
    assert main(["sweep", str(spec), "--dry-run", "--plan", str(tmp_path / "p.txt")]) == 2


def test_executor_registry_and_options(capsys: pytest.CaptureFixture[str]) -> None:
    from xmodlm.cli import main
    from xmodlm.sweep.executors import (
        EXECUTORS,
        SlurmExecutor,
        make_executor,
        parse_executor_options,
    )

    assert set(EXECUTORS) == {"local", "ray", "slurm"}
    opts = parse_executor_options(["folder=logs", "params.partition=gpu", "params.gpus_per_node=1",
                                   "local=true"])
    ex = make_executor("slurm", **opts)
    assert ex == SlurmExecutor(folder="logs", params={"partition": "gpu", "gpus_per_node": 1},
                               local=True)
    assert make_executor("local", workers=3).workers == 3
    with pytest.raises(UserError, match="unknown option 'folder'; allowed: address"):
        make_executor("ray", folder="x")
    assert main(["sweep", "micro-quick", "--out", "/tmp/never", "--executor", "slurm",
                 "--executor-opt", "partitionn=gpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown option 'partitionn'" in err and len(err.splitlines()) == 1


def test_runs_of_an_older_release_are_recognised(tiny_data_dir: Path, tmp_path: Path) -> None:
    """A finished run recorded before a config field existed keeps its directory: the
    sweep does not train it again under a new id. A run that differs in a real
    setting, or whose recorded config lacks a field now set away from its default,
    is not adopted."""
    from xmodlm.sweep.runner import adopt_earlier_runs

    runs = expand(load_spec(_spec(tmp_path, tiny_data_dir, FOUR)))
    runs_dir = tmp_path / "sweep" / "runs"
    old = runs[0].cfg.to_dict()
    del old["train"]["wandb_tags"]  # a field the older release did not have
    (runs_dir / "0ld0ld0ld0ld").mkdir(parents=True)
    (runs_dir / "0ld0ld0ld0ld" / "config.yaml").write_text(yaml.safe_dump(old))
    other = runs[1].cfg.to_dict()
    other["train"]["lr"] = 0.123  # a different run
    (runs_dir / "0th3r0th3r00").mkdir()
    (runs_dir / "0th3r0th3r00" / "config.yaml").write_text(yaml.safe_dump(other))
    adopted = adopt_earlier_runs(runs, runs_dir)
    assert adopted[0].run_id == "0ld0ld0ld0ld" and adopted[0].cfg == runs[0].cfg
    assert [r.run_id for r in adopted[1:]] == [r.run_id for r in runs[1:]]
    tagged = [dataclasses.replace(runs[0], cfg=runs[0].cfg.merge(["train.wandb_tags=a"]))]
    assert adopt_earlier_runs(tagged, runs_dir)[0].run_id == runs[0].run_id


def test_budgets_per_context_and_family_narrowing(tiny_data_dir: Path, tmp_path: Path) -> None:
    """compute may map each context to its tiers; a family may narrow seeds and compute;
    runs come tier by tier."""
    families = [
        {"family": "dense"},
        {"family": "xmod", "stride": 2, "capacity": 0.5, "seeds": [0],
         "compute": {32: [2.0e9], 64: [4.0e9]}},
    ]
    spec = load_spec(_spec(tmp_path, tiny_data_dir, families, context=[32, 64],
                           compute={32: [2.0e9, 6.0e9], 64: [4.0e9, 1.2e10]}, seeds=[0, 1]))
    runs = expand(spec)
    got = [(r.cfg.model.family, r.cfg.model.context, r.compute, r.cfg.train.seed) for r in runs]
    assert got == [
        ("dense", 32, 2.0e9, 0), ("dense", 32, 2.0e9, 1), ("xmod", 32, 2.0e9, 0),
        ("dense", 64, 4.0e9, 0), ("dense", 64, 4.0e9, 1), ("xmod", 64, 4.0e9, 0),
        ("dense", 32, 6.0e9, 0), ("dense", 32, 6.0e9, 1),
        ("dense", 64, 1.2e10, 0), ("dense", 64, 1.2e10, 1),
    ]
    # a plain list of budgets is the same budgets at every context, ids unchanged by the feature
    plain = expand(load_spec(_spec(tmp_path, tiny_data_dir, [{"family": "dense"}])))
    again = expand(load_spec(_spec(tmp_path, tiny_data_dir, [{"family": "dense"}],
                                   compute={32: [2.0e9]})))
    assert [r.run_id for r in plain] == [r.run_id for r in again]


def test_lr_rule_per_width_scaled_and_narrowed_to_some_sizes(tiny_data_dir: Path,
                                                            tmp_path: Path) -> None:
    """lr_rule gives each width its rate, the same for every family; lr_scale multiplies
    it (crossed); a family's own lr replaces it; a family's dense narrows its sizes."""
    dense = [{"width": 32, "n_layers": 2, "n_heads": 2}, {"width": 64, "n_layers": 2, "n_heads": 2}]
    families = [
        {"family": "dense"},
        {"family": "xmod", "stride": 2, "capacity": 0.5, "lr_scale": [0.5, 2],
         "dense": [{"width": 64, "n_layers": 2}]},
        {"family": "mod", "lr": 1.0e-3},
    ]
    rule = {"lr": 4.0e-3, "width": 32, "power": 1.0}
    runs = expand(load_spec(_spec(tmp_path, tiny_data_dir, families, dense=dense, lr_rule=rule)))
    got = sorted((r.cfg.model.family, r.cfg.model.d_model, r.cfg.train.lr) for r in runs)
    assert got == [
        ("dense", 32, 4.0e-3), ("dense", 64, 2.0e-3),
        ("mod", 32, 1.0e-3), ("mod", 64, 1.0e-3),
        ("xmod", 64, 1.0e-3), ("xmod", 64, 4.0e-3),
    ]
    # at scale 1 a run is the very run of the spec without lr_scale: same id
    one = expand(load_spec(_spec(tmp_path, tiny_data_dir, [{"family": "dense", "lr_scale": [1]}],
                                 dense=dense, lr_rule=rule)))
    plain = expand(load_spec(_spec(tmp_path, tiny_data_dir, [{"family": "dense"}],
                                   dense=dense, lr_rule=rule)))
    assert [r.run_id for r in one] == [r.run_id for r in plain]
    with pytest.raises(UserError, match="not one of the spec's dense entries"):
        load_spec(_spec(tmp_path, tiny_data_dir, [{"family": "dense",
                                                   "dense": [{"width": 48, "n_layers": 2}]}]))
    with pytest.raises(UserError, match="lr_rule"):
        load_spec(_spec(tmp_path, tiny_data_dir, [{"family": "dense"}], lr_rule={"lr": 1e-3}))


def test_design_rules_are_measured_per_run(tiny_data_dir: Path, tmp_path: Path) -> None:
    from xmodlm.sweep.spec import check_requirements

    spec = load_spec(_spec(tmp_path, tiny_data_dir, FOUR))
    runs = expand(spec)
    figures, broken = check_requirements(runs, {}, train_tokens=1000)
    assert broken == []
    for run, fig in zip(runs, figures, strict=True):
        assert fig["min_steps"] == run.steps - run.cfg.train.warmup_steps == 3 - 1
        assert fig["max_warmup_frac"] == pytest.approx(1 / 3)
        assert fig["max_epochs"] == pytest.approx(run.row()["tokens"] / 1000)
        m = run.cfg.model
        head = 2 * m.d_model * m.vocab_size * 3
        assert fig["max_head_frac"] == pytest.approx(head / flops.count(m).flops_train)
    assert check_requirements(runs, {"max_epochs": 1e-9})[0][0]["max_epochs"] is None  # unknown
    with pytest.raises(UserError, match=r"breaks require.max_warmup_frac=0.1: warmup"):
        check_requirements(runs, {"max_warmup_frac": 0.1})
    _, broken = check_requirements(runs, {"max_warmup_frac": 0.1, "min_steps": 1}, strict=False)
    assert len(broken) == 1 and broken[0].endswith("(and 3 more runs)")


def test_shipped_cpu_study_meets_its_design_rules() -> None:
    """Every run of the shipped study: >= 2000 steps after warmup, warmup <= 10%, head
    <= 41%, <= 4 epochs of the default corpus (5.8M training tokens), two contexts 4x
    apart, two tiers 3x apart per context, three seeds on the headline families and
    on the law cells (the lower tier's five X-MoD (S, c) cells at each context)."""
    from xmodlm.sweep.spec import check_requirements

    spec = load_spec("cpu-study")
    runs = expand(spec)
    figures, _ = check_requirements(runs, spec["require"], train_tokens=5_816_633)
    assert min(f["min_steps"] for f in figures) >= 2000
    assert max(f["max_epochs"] for f in figures) <= 4
    assert sorted({r.cfg.model.context for r in runs}) == [128, 512]
    for T in (128, 512):
        tiers = sorted({r.compute for r in runs if r.cfg.model.context == T})
        assert len(tiers) == 2 and tiers[1] / tiers[0] == pytest.approx(3.0)
        for family in ("dense", "xmod", "mod", "moe"):
            for C in tiers:
                seeds = {r.cfg.train.seed for r in runs if r.cfg.model.family == family
                         and r.cfg.model.context == T and r.compute == C
                         and r.cfg.model.stride in (1, 2, 8) and r.cfg.model.capacity in (1, 0.125)
                         and (family != "xmod" or r.cfg.model.stride == 8)}
                assert seeds == {0, 1, 2}, (family, T, C)
        law_cells: dict[tuple[int, float], set[int]] = {}
        for r in runs:
            if (r.cfg.model.family == "xmod" and r.cfg.model.context == T
                    and r.compute == tiers[0] and r.cfg.train.lr == 4e-3):
                cell = (r.cfg.model.stride, r.cfg.model.capacity)
                law_cells.setdefault(cell, set()).add(r.cfg.train.seed)
        assert set(law_cells) == {(2, 0.125), (4, 0.125), (8, 0.125), (4, 0.25), (4, 0.5)}
        assert all(seeds == {0, 1, 2} for seeds in law_cells.values()), law_cells


def test_shipped_depth_control_brackets_the_study_xmod_at_t512() -> None:
    """cpu-study-depth is the size control for the study's T = 512 budgets: the same
    budgets, width, batch, seeds and learning rate, and dense depths on both sides of
    the study's dense reference and of the FLOP-matched X-MoD (S = 8, c = 1/8) there."""
    study_runs = [r for r in expand(load_spec("cpu-study"))
                  if r.cfg.model.context == 512 and r.cfg.train.lr == 4e-3]
    study = {(r.cfg.model.family, r.cfg.model.stride, r.cfg.train.seed): r
             for r in study_runs if r.compute == 2.8e13}
    xmod = study[("xmod", 8, 0)]
    control = [r for r in expand(load_spec("cpu-study-depth")) if r.cfg.model.context == 512]
    assert {r.compute for r in control} == {r.compute for r in study_runs} == {2.8e13, 8.4e13}
    assert {r.cfg.train.seed for r in control} == {0, 1, 2}
    for r in control:
        assert r.cfg.model.family == "dense" and r.cfg.model.context == 512
        for key in ("batch_size", "lr", "warmup_steps", "dtype"):
            assert getattr(r.cfg.train, key) == getattr(xmod.cfg.train, key), key
        assert r.cfg.model.d_model == xmod.cfg.model.d_model
    active = sorted({flops.count(r.cfg.model).params_active for r in control})
    x_active = flops.count(xmod.cfg.model).params_active
    reference = flops.count(study[("dense", 1, 0)].cfg.model).params_active
    assert active[0] < reference < x_active < active[-1]
    assert any(reference < a < x_active for a in active)


def test_dry_run_sizes_from_measured_throughput(tiny_data_dir: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    """--rate-from: times are compute / the FLOP/s finished runs reached (median)."""
    from xmodlm.sweep.estimate import measured_rate

    done = tmp_path / "done"
    for i, (flops_, wall) in enumerate([(1e12, 10.0), (3e12, 10.0), (2e12, 10.0), (5e12, 0.0)]):
        run = done / "runs" / f"r{i}"
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({"status": "ok", "flops": flops_,
                                                      "wall_s": wall}))
    assert measured_rate(done) == (2e11, 3, None)  # the zero-time run is not a measurement
    # a sweep's own runs also measure the time outside the loop: launch to last record
    for i in range(3):
        run = done / "runs" / f"r{i}"
        (run / "sweep_config.yaml").write_text("{}")
        os.utime(run / "sweep_config.yaml", (1000.0, 1000.0))
        os.utime(run / "summary.json", (1000.0 + 10.0 + 4.0 + i, 1000.0 + 10.0 + 4.0 + i))
    assert measured_rate(done) == (2e11, 3, pytest.approx(5.0))
    spec = _spec(tmp_path, tiny_data_dir, [{"family": "dense"}])
    assert main(["sweep", str(spec), "--dry-run", "--rate-from", str(done)]) == 0
    out = capsys.readouterr().out
    assert "2e+11 FLOP/s a run, measured by 3 finished runs" in out
    assert "5.0 s a run to start and evaluate (measured)" in out
    # each run: that fixed cost plus its compute over the rate
    from xmodlm.sweep.estimate import DEFAULT_FIXED_S, estimate_seconds

    runs = expand(load_spec(spec))
    assert estimate_seconds(runs, rate=2e11, fixed_s=5.0) == [5.0 + r.compute / 2e11 for r in runs]
    assert estimate_seconds(runs, rate=2e11)[0] == DEFAULT_FIXED_S + runs[0].compute / 2e11
    assert main(["sweep", str(spec), "--dry-run", "--rate-from", str(tmp_path / "none")]) == 2


def test_dry_run_of_a_resumed_sweep_estimates_only_the_runs_left(
        tiny_data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A run finished in --out is marked done and left out of the estimate, so the
    line's minutes are what the rerun will take (it had summed every run)."""
    from xmodlm.sweep.estimate import estimate_seconds

    spec = _spec(tmp_path, tiny_data_dir, [{"family": "dense"}], seeds=[0, 1, 2])
    runs = expand(load_spec(spec))
    assert len(runs) == 3
    out = tmp_path / "sweep"
    run = out / "runs" / runs[0].run_id
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"status": "ok", "flops": 1e12, "wall_s": 1.0}))
    assert main(["sweep", str(spec), "--dry-run", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    left = sum(estimate_seconds(runs[1:], rate=1e12, fixed_s=None)) / 60
    assert f"{len(runs)} runs, 1 done; the {len(runs) - 1} left estimated {left:.0f} min" in text
    marks = [line.split()[-1] for line in text.splitlines()[1:1 + len(runs)]]
    assert marks == ["done", "-", "-"]


def test_sweep_evaluates_final_checkpoints(tiny_data_dir: Path, tmp_path: Path) -> None:
    """spec eval: each run's final checkpoint is evaluated after training into eval.json
    (causal and top-k loss, downstream tasks), whose figures join the results table; a
    run trained before eval was asked for is evaluated on resume, not retrained."""
    from xmodlm.sweep.spec import eval_args

    families = [{"family": "dense"}, {"family": "xmod", "stride": 2, "capacity": 0.5}]
    plain = load_spec(_spec(tmp_path, tiny_data_dir, families))
    out = tmp_path / "sweep"
    assert run_sweep(expand(plain), out, progress=False)["ran"] == 2
    trained = {p.parent.name: p.stat().st_mtime_ns for p in out.glob("runs/*/summary.json")}
    spec = load_spec(_spec(tmp_path, tiny_data_dir, families,
                           eval={"tasks": ["cloze"], "split": "val", "max_items": 8,
                                 "batches": 1}))
    assert eval_args(spec) == ("--split", "val", "--tasks", "cloze", "--max-items", "8",
                               "--batches", "1")
    result = run_sweep(expand(spec), out, progress=False, eval_args=eval_args(spec))
    assert result["ran"] == 2 and result["failed"] == 0
    for run_id, mtime in trained.items():
        assert (out / "runs" / run_id / "summary.json").stat().st_mtime_ns == mtime  # not retrained
        ev = json.loads((out / "runs" / run_id / "eval.json").read_text())
        assert ev["split"] == "val" and ev["tasks"]["cloze"]["items"] <= 8
        cfg = load_config(out / "runs" / run_id / "config.yaml")
        assert ev["eval_tokens"] == cfg.train.batch_size * cfg.model.context  # one batch
    table, _ = collect_results(out)
    assert table["eval_split"].tolist() == ["val", "val"]
    assert table["task_cloze"].between(0, 1).all()
    assert table["eval_loss_causal"].notna().all()
    xmod = table[table["family"] == "xmod"].iloc[0]
    assert xmod["eval_loss_causal"] != xmod["eval_loss_topk"]
    assert run_sweep(expand(spec), out, progress=False, eval_args=eval_args(spec))["ran"] == 0
    bad = _spec(tmp_path, tiny_data_dir, families, eval={"tasks": ["trivia"]})
    with pytest.raises(UserError, match="unknown task 'trivia'"):
        load_spec(bad)
    bad = _spec(tmp_path, tiny_data_dir, families, eval={"batches": 0})
    with pytest.raises(UserError, match=r"eval.batches=0: must be an integer >= 1"):
        load_spec(bad)


def test_a_family_may_run_at_some_contexts_only(tiny_data_dir: Path, tmp_path: Path) -> None:
    families = [{"family": "dense"}, {"family": "dense", "lr": [1e-3], "compute": {32: [2.0e9]}}]
    spec = load_spec(_spec(tmp_path, tiny_data_dir, families, context=[32, 64],
                           compute={32: [2.0e9], 64: [4.0e9]}))
    got = [(r.cfg.model.context, r.cfg.train.lr) for r in expand(spec)]
    default_lr = expand(spec)[0].cfg.train.lr
    assert got == [(32, default_lr), (32, 1e-3), (64, default_lr)]
    bad = _spec(tmp_path, tiny_data_dir, families, context=[32, 64], compute={32: [2.0e9]})
    with pytest.raises(UserError, match="give each context its budgets"):
        load_spec(bad)  # the spec's own budgets must cover every context


def test_sweep_eta_weighs_runs_by_compute(monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture) -> None:
    """Three runs of 1, 3 and 1 units of compute: when the first (1 unit) ends after
    60 s, 4 units are left, so 4 minutes; counting runs would say 2."""
    from xmodlm import progress

    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    bar = progress.Progress(3, "sweep", unit="done", enabled=True, every_s=0,
                            weights={"a": 1e12, "b": 3e12, "c": 1e12})  # as run_sweep's
    bar.running = 2
    now[0] = 60.0
    bar.finished("a", failed=False)
    now[0] = 120.0
    bar.finished("b", failed=True)
    bar.set_running(2)  # a poll that changes no count writes no line
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["sweep: 1/3 done, 2 running, 1m00s elapsed, ETA 4m00s",
                     "sweep: 1/3 done, 2 running, 1 failed, 2m00s elapsed, ETA 30s"]


def test_sweep_eta_counts_the_estimate_down_until_a_full_pool_has_ended(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two workers, runs of 10, 30 and 20 units (60 over 2 workers: 30 s): the first
    end, of the cheapest run beside one still running, says nothing of the other's
    progress, so the ETA keeps counting the estimate down; once two runs have ended it
    is the time so far corrected by the speed seen; past the estimate with nothing
    ended it says it does not know."""
    from xmodlm import progress

    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    bar = progress.Progress(3, "sweep", unit="done", enabled=False, every_s=0,
                            weights={"a": 10.0, "b": 30.0, "c": 20.0}, parallel=2)
    assert bar.eta() == 30.0
    now[0] = 12.0
    bar.finished("a")
    assert bar.eta() == pytest.approx(18.0)  # 30 - 12, not 12 x 50 / 10 = 60
    now[0] = 33.0
    bar.finished("b")
    assert bar.eta() == pytest.approx(33.0 * 20 / 40)
    late = progress.Progress(2, "sweep", enabled=False, weights={"a": 1.0, "b": 1.0},
                             parallel=2)
    now[0] += 5.0
    assert late.eta() != late.eta()  # nan: shown as "?"


def test_run_set_changes_how_runs_execute_not_their_ids(tiny_data_dir: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    """--run-set passes execution settings to every run under the spec's ids; a setting
    that changes what is trained is refused with one line, before any work."""
    spec = _spec(tmp_path, tiny_data_dir, [{"family": "dense"}])
    (run,) = expand(load_spec(spec))
    out = tmp_path / "sweep"
    assert main(["sweep", str(spec), "--out", str(out), "--quiet", "--allow-dirty",
                 "--run-set", "train.log_every=1", "--run-set", "train.ckpt_every=2"]) == 0
    cfg = yaml.safe_load((out / "runs" / run.run_id / "config.yaml").read_text())
    assert (cfg["train"]["log_every"], cfg["train"]["ckpt_every"]) == (1, 2)
    assert run.cfg.train.log_every != 1  # the spec's config, whose hash is the id
    capsys.readouterr()
    for bad in ("train.lr=1e-3", "model.d_model=64", "train.log_every"):
        assert main(["sweep", str(spec), "--out", str(tmp_path / "x"), "--dry-run",
                     "--run-set", bad]) == 2
        err = capsys.readouterr().err
        assert "--run-set" in err and "train.compile" in err and len(err.strip().splitlines()) == 1
    assert main(["sweep", str(spec), "--dry-run", "--run-set", "train.compile=sometimes"]) == 2
    assert "compile" in capsys.readouterr().err


# (results/lr-depth's ids were renamed by a config field added before ID_NEUTRAL existed)
@pytest.mark.parametrize("name", ["cpu-study", "cpu-study-depth", "deep-ablation"])
def test_committed_sweeps_keep_their_run_ids(name: str) -> None:
    """A shipped spec expands to every run id its committed results table holds (and
    maybe runs still to do), so a config field added since, at its neutral value,
    never reruns a finished sweep."""
    import csv

    table = Path(__file__).resolve().parents[1] / "results" / name / "results.csv"
    with open(table, newline="") as f:
        committed = {row["run_id"] for row in csv.DictReader(f)}
    assert committed <= {r.run_id for r in expand(load_spec(name))}
