"""Trainer: exact resume after a hard kill, DDP equivalence, schedules, clear errors."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import shutil
import signal
import socket
from pathlib import Path

import pytest
import torch

from xmodlm.cli import main
from xmodlm.config import Config, TrainConfig, load_config
from xmodlm.errors import UserError
from xmodlm.runs import checkpoint_dirs, load_run
from xmodlm.train import checkpoint as ckpt_io
from xmodlm.train.loggers import read_metrics
from xmodlm.train.optim import lr_at
from xmodlm.train.trainer import train


def small_cfg(data_dir: Path, *extra: str) -> Config:
    """A 4-block X-MoD model of width 32 on the tiny corpus, fp32 for exactness."""
    return load_config(
        "xmod-tiny",
        [
            f"data.dir={data_dir}",
            "data.val_batches=2",
            "model.vocab_size=300",
            "model.d_model=32",
            "model.n_heads=2",
            "model.n_layers=4",
            "model.stride=2",
            "model.capacity=0.5",
            "model.context=32",
            "train.batch_size=4",
            "train.dtype=fp32",
            "train.warmup_steps=5",
            "train.log_every=1",
            "train.eval_every=1000",
            *extra,
        ],
    )


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run) if r.get("kind") != "eval"}


def _train_and_kill(cfg_yaml: str, run: str, kill_at: int) -> None:
    """Child process: train, then SIGKILL itself in the middle of the run."""
    import yaml

    cfg = Config.from_dict(yaml.safe_load(cfg_yaml)).validate()

    def on_step(step: int, record: dict) -> None:
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    train(cfg, run, progress=False, on_step=on_step)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_after_hard_kill_is_exact(tiny_data_dir: Path, tmp_path: Path, optimizer: str) -> None:
    cfg = small_cfg(
        tiny_data_dir, "train.max_steps=40", "train.ckpt_every=20", f"train.optimizer={optimizer}"
    )
    straight = tmp_path / "straight"
    train(cfg, straight, progress=False)

    resumed = tmp_path / "resumed"
    child = mp.get_context("spawn").Process(
        target=_train_and_kill, args=(cfg.to_yaml(), str(resumed), 25)
    )
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL
    assert [p.name for p in checkpoint_dirs(resumed)] == ["step_00000020"]
    assert max(_losses(resumed)) == 25  # steps 21-25 were logged before the kill
    summary = train(cfg, resumed, progress=False)
    assert summary["status"] == "ok" and summary["steps"] == 40

    a, b = _losses(straight), _losses(resumed)
    assert sorted(a) == sorted(b) == list(range(1, 41))
    for step in a:
        assert a[step] == b[step], f"step {step}: {a[step]} != {b[step]}"
    sa = json.loads((straight / "summary.json").read_text())
    sb = json.loads((resumed / "summary.json").read_text())
    assert sa["final_val_loss"] == sb["final_val_loss"]


def _ddp_worker(rank: int, world: int, port: int, cfg_yaml: str, run: str) -> None:
    import yaml

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    cfg = Config.from_dict(yaml.safe_load(cfg_yaml)).validate()
    train(cfg, run, progress=False)
    import torch.distributed as dist

    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_ddp_two_ranks_match_one_rank(tiny_data_dir: Path, tmp_path: Path, optimizer: str) -> None:
    """2 gloo ranks x batch 2 == 1 rank x batch 4 (same global batch), loss within 1e-5."""
    opt = f"train.optimizer={optimizer}"
    one = small_cfg(tiny_data_dir, "train.max_steps=5", "train.batch_size=4", opt)
    train(one, tmp_path / "one", progress=False)
    two = small_cfg(tiny_data_dir, "train.max_steps=5", "train.batch_size=2", opt)
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(target=_ddp_worker, args=(r, 2, port, two.to_yaml(), str(tmp_path / "two")))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    assert all(p.exitcode == 0 for p in procs)
    a, b = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5]
    for step in a:
        assert abs(a[step] - b[step]) < 1e-5, (step, a[step], b[step])


def _launch(world: int, cfg: Config, run: Path) -> None:
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(target=_ddp_worker, args=(r, world, port, cfg.to_yaml(), str(run)))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    assert all(p.exitcode == 0 for p in procs)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_fsdp_two_ranks_match_one_rank_and_resume(
    tiny_data_dir: Path, tmp_path: Path, optimizer: str
) -> None:
    """FSDP2 on 2 gloo ranks: same losses as one process, a checkpoint any process can
    load, and an exact resume across a restart (sharded save and load). Muon gathers
    each sharded matrix, so its update is the unsharded one."""
    opt = f"train.optimizer={optimizer}"
    one = small_cfg(tiny_data_dir, "train.max_steps=5", "train.batch_size=4", opt)
    train(one, tmp_path / "one", progress=False)
    two = small_cfg(
        tiny_data_dir, "train.max_steps=5", "train.batch_size=2", "train.fsdp=true",
        "train.ckpt_every=3", "train.keep_last=2", opt,
    )
    _launch(2, two, tmp_path / "two")
    straight = _losses(tmp_path / "two")
    straight_val = json.loads((tmp_path / "two" / "summary.json").read_text())["final_val_loss"]
    # drop the last checkpoint and the summary: the rerun resumes from step 3
    ckpts = checkpoint_dirs(tmp_path / "two")
    assert [c.name for c in ckpts] == ["step_00000003", "step_00000005"]
    shutil.rmtree(ckpts[-1])
    (tmp_path / "two" / "summary.json").unlink()
    _, model, ckpt = load_run(tmp_path / "two")  # full weights, readable without FSDP
    assert ckpt.name == "step_00000003" and model.blocks[1].gamma.shape == (1,)
    _launch(2, two, tmp_path / "two")
    assert _losses(tmp_path / "two") == straight  # sharded load resumes exactly
    a, b = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5]
    for step in a:
        assert abs(a[step] - b[step]) < 1e-5, (step, a[step], b[step])
    # every rank evaluates the sharded model (a collective forward); rank 0 reports it
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["final_val_loss"] == (
        straight_val
    )
    # the optimiser layouts differ: a sharded checkpoint does not resume unsharded
    with pytest.raises(UserError, match="resume with train.fsdp=true"):
        from xmodlm.train.distributed import load_optimizer

        state = ckpt_io.load_state(checkpoint_dirs(tmp_path / "two")[-1])
        opt = torch.optim.AdamW(model.parameters())
        load_optimizer(model, opt, state["optimizer"], sharded=False)


def test_grad_accum_matches_one_big_batch(tiny_data_dir: Path, tmp_path: Path) -> None:
    """2 micro-batches of 2 == 1 batch of 4: same windows, same losses to 1e-5."""
    big = small_cfg(tiny_data_dir, "train.max_steps=4", "train.batch_size=4")
    acc = small_cfg(tiny_data_dir, "train.max_steps=4", "train.batch_size=2", "train.grad_accum=2")
    train(big, tmp_path / "big", progress=False)
    train(acc, tmp_path / "acc", progress=False)
    a, b = _losses(tmp_path / "big"), _losses(tmp_path / "acc")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert abs(a[step] - b[step]) < 1e-5, (step, a[step], b[step])


def test_corrupt_checkpoint_falls_back_to_previous(
    tiny_data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = small_cfg(tiny_data_dir, "train.max_steps=6", "train.ckpt_every=3", "train.keep_last=3")
    run = tmp_path / "run"
    train(cfg, run, progress=False)
    newest = checkpoint_dirs(run)[-1]
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncate
    _, _, used = load_run(run)
    assert used.name == "step_00000003"
    cfg2 = small_cfg(tiny_data_dir, "train.max_steps=8", "train.ckpt_every=3", "train.keep_last=3")
    summary = train(cfg2, run, progress=False, force=True)  # a longer budget: --force
    err = capsys.readouterr().err
    assert str(newest) in err and "unusable" in err
    assert summary["steps"] == 8


def test_checkpoint_of_other_config_is_a_clear_error(tiny_data_dir: Path, tmp_path: Path) -> None:
    cfg = small_cfg(tiny_data_dir, "train.max_steps=2")
    run = tmp_path / "run"
    train(cfg, run, progress=False)
    other = small_cfg(tiny_data_dir, "train.max_steps=2", "model.d_model=64")
    with pytest.raises(UserError, match="different model"):
        train(other, run, progress=False)
    (run / "config.yaml").write_text(other.to_yaml())
    with pytest.raises(UserError, match="does not match"):
        load_run(run)


def test_bad_inputs_are_clear_errors(tiny_data_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not found"):
        train(small_cfg(tmp_path / "nowhere", "train.max_steps=1"), tmp_path / "r1")
    with pytest.raises(UserError, match="fewer than context"):
        train(small_cfg(tiny_data_dir, "train.max_steps=1", "model.context=1000000"),
              tmp_path / "r2")
    with pytest.raises(UserError, match="less than one batch"):
        train(small_cfg(tiny_data_dir, "train.tokens=10"), tmp_path / "r3")
    with pytest.raises(UserError, match="no training budget"):
        train(small_cfg(tiny_data_dir), tmp_path / "r4")


def test_cli_train_bad_input_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["train", "dense-tiny", "--out", str(tmp_path / "r"),
                 "--set", f"data.dir={tmp_path / 'missing'}", "--set", "train.max_steps=1"])
    assert code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_divergence_stops_the_run(tiny_data_dir: Path, tmp_path: Path) -> None:
    cfg = small_cfg(tiny_data_dir, "train.max_steps=50", "train.max_bad_steps=2",
                    "train.lr=1e30", "train.warmup_steps=0", "train.grad_clip=1e30")
    summary = train(cfg, tmp_path / "run", progress=False)
    assert summary["status"] == "diverged"
    assert summary["skipped_steps"] >= 2 and summary["steps"] < 50
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "diverged"


def test_compute_budget_gives_tokens(tiny_data_dir: Path, tmp_path: Path) -> None:
    from xmodlm import flops
    from xmodlm.budget import resolve_budget

    cfg = small_cfg(tiny_data_dir)
    per_step = 4 * 32
    cfg.train.compute = flops.count(cfg.model).flops_train * per_step * 7.5
    budget = resolve_budget(cfg, 1)
    assert budget.total_steps == 7 and budget.source == "compute"


def test_schedules() -> None:
    t = TrainConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=10, schedule="cosine")
    lrs = [lr_at(s, 100, t) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    w = TrainConfig(lr=1.0, min_lr_ratio=0.0, warmup_steps=10, schedule="wsd", cooldown_frac=0.2)
    lrs = [lr_at(s, 100, w) for s in range(100)]
    assert lrs[50] == 1.0 and lrs[79] == 1.0 and lrs[-1] == pytest.approx(0.0)


def test_warmup_frac_sets_warmup_from_the_run_length() -> None:
    """The paper's schedule: 1% warmup, then cosine to 10% of the peak."""
    t = TrainConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=50, warmup_frac=0.01)
    assert t.warmup(1000) == 10 and t.warmup(150) == 2
    lrs = [lr_at(s, 1000, t) for s in range(1000)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0) and lrs[11] < 1.0
    assert lrs[-1] == pytest.approx(0.1, abs=1e-4)
    assert TrainConfig(warmup_steps=50).warmup(1000) == 50
    with pytest.raises(UserError, match=r"train.warmup_frac=1.0: must be in \[0, 1\)"):
        TrainConfig(warmup_frac=1.0).validate()


def test_batch_tokens_fixes_tokens_per_step(tiny_data_dir: Path, tmp_path: Path) -> None:
    """batch_tokens / context sequences per step, split over ranks; micro-batch the largest
    divisor of a rank's share within batch_size; the same run as the explicit batch."""
    from xmodlm.budget import resolve_budget

    cfg = small_cfg(tiny_data_dir, "train.max_steps=2", "train.batch_tokens=384")
    for world, micro, accum in [(1, 4, 3), (2, 3, 2), (3, 4, 1), (4, 3, 1)]:
        b = resolve_budget(cfg, world)
        assert (b.batch_size, b.grad_accum, b.tokens_per_step) == (micro, accum, 384), world
    longer = small_cfg(tiny_data_dir, "train.batch_tokens=384", "model.context=64", "train.tokens=3840")
    assert resolve_budget(longer, 1).total_steps == 10  # 6 sequences of 64 a step
    with pytest.raises(UserError, match="train.batch_tokens=384 is not a multiple of context x"
                       " ranks = 32 x 5: choose a multiple of 160"):
        resolve_budget(cfg, 5)
    with pytest.raises(UserError, match="grad_accum is derived from batch_tokens"):
        small_cfg(tiny_data_dir, "train.batch_tokens=384", "train.grad_accum=2").validate()
    derived = small_cfg(tiny_data_dir, "train.max_steps=2", "train.batch_tokens=256")
    explicit = small_cfg(tiny_data_dir, "train.max_steps=2", "train.grad_accum=2")
    sa = train(derived, tmp_path / "derived", progress=False)
    train(explicit, tmp_path / "explicit", progress=False)
    assert _losses(tmp_path / "derived") == _losses(tmp_path / "explicit")
    assert sa["batch_tokens"] == 256


def test_run_dir_contents(tiny_data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    summary = train(small_cfg(tiny_data_dir, "train.max_steps=3"), run, progress=False)
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "env.json", "tokenizer.json"):
        assert (run / name).is_file(), name
    for key in ("final_val_loss", "val_bpb", "tokens", "flops", "params_total",
                "params_active", "wall_s", "status"):
        assert summary[key] is not None, key
    env = json.loads((run / "env.json").read_text())
    assert env["torch"] and env["cpu_count"]
    evals = [r for r in read_metrics(run) if r.get("kind") == "eval"]
    assert evals and "routing_agreement" in evals[-1] and "coverage" in evals[-1]
    # the model as initialised is evaluated before any update: loss about ln V
    assert [e["step"] for e in evals] == [0, 3]
    assert abs(evals[0]["val_loss_topk"] - math.log(300)) < 0.5
    assert len(evals[0]["residual_rms"]) == 4
    from xmodlm.report.dynamics import run_dynamics

    dyn = run_dynamics(run)
    assert dyn["residual_rms_init"] == evals[0]["residual_rms"]
    assert dyn["init_tokens"] == "the trainer's evaluation at step 0, on validation data"
    shutil.rmtree(run)


def test_checkpoint_with_scalar_gammas_still_loads(tiny_data_dir: Path, tmp_path: Path) -> None:
    """Gate gammas were 0-d scalars before FSDP2 support made them shape (1,)."""
    from safetensors.torch import load_file, save_file

    run = tmp_path / "run"
    train(small_cfg(tiny_data_dir, "train.max_steps=2"), run, progress=False)
    path = checkpoint_dirs(run)[-1] / "model.safetensors"
    weights = load_file(str(path))
    gammas = [k for k in weights if k.endswith(".gamma")]
    assert gammas
    save_file({k: v.reshape(()) if k in gammas else v for k, v in weights.items()}, str(path))
    _, model, _ = load_run(run)
    for k in gammas:
        assert torch.equal(model.state_dict()[k], weights[k])


def test_weight_decay_groups() -> None:
    """Matrices decay; routers (sparse-depth and MoE), gate gammas, norms, biases and
    the embedding do not; the causal predictor's matrices do."""
    from conftest import tiny_model_cfg
    from xmodlm.model import Transformer
    from xmodlm.train.optim import param_groups

    model = Transformer(
        tiny_model_cfg(n_layers=4, layout="DsEs", causal_router="predictor", n_experts=2, moe_top_k=1)
    )
    decay_group, no_decay_group = param_groups(model, 0.1)
    assert decay_group["weight_decay"] == 0.1 and no_decay_group["weight_decay"] == 0.0
    ids = {id(p) for p in decay_group["params"]}
    names = {n: id(p) in ids for n, p in model.named_parameters()}
    assert not names["blocks.1.router.weight"] and not names["blocks.2.block.mlp.router.weight"]
    assert not names["blocks.1.gamma"] and not names["embed.weight"] and not names["norm.weight"]
    assert not names["blocks.1.router.head.0.bias"]
    assert names["blocks.1.router.head.0.weight"] and names["blocks.1.router.head.2.weight"]
    assert names["head.weight"] and names["blocks.0.block.attn.proj.weight"]
    assert names["blocks.1.block.mlp.down.weight"]
    n_params = len(list(model.parameters()))
    assert len(decay_group["params"]) + len(no_decay_group["params"]) == n_params


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("max_norm", [1e-3, 1e3])
def test_clip_and_step_equals_clip_then_step(
    fused: bool, max_norm: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The clip folded into fused AdamW's grad_scale is clip_grad_norm_ then step, to
    round-off; with fused AdamW no separate clipping pass runs."""
    from xmodlm.train.optim import clip_and_step

    def setup() -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
        gen = torch.Generator().manual_seed(0)
        params = [torch.randn(7, 5, generator=gen).requires_grad_(), torch.randn(3, generator=gen).requires_grad_()]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        kwargs = {"fused": True} if fused else {"foreach": True}
        return params, torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, **kwargs)

    ref_params, ref_opt = setup()
    norm = float(torch.nn.utils.clip_grad_norm_(ref_params, max_norm))
    ref_opt.step()
    params, opt = setup()
    passes = []
    clip_pass = torch.nn.utils.clip_grads_with_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_",
                        lambda *a, **k: passes.append(1) or clip_pass(*a, **k))
    assert clip_and_step(opt, params, max_norm) == pytest.approx(norm)
    for a, b in zip(params, ref_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert len(passes) == (0 if fused or max_norm > norm else 1)
    assert "grad_scale" not in opt.__dict__
    params[0].grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in params]
    assert not math.isfinite(clip_and_step(opt, params, max_norm))  # no step taken
    assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True))


def test_after_optimizer_step_hook_runs_once_per_taken_step() -> None:
    """The model's after_optimizer_step() runs after each step taken, not a skipped one,
    and is found through the compile wrapper."""
    from types import SimpleNamespace

    from xmodlm.train.distributed import unwrap
    from xmodlm.train.trainer import train_step

    class Counting(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))
            self.calls = 0

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> SimpleNamespace:
            loss = (self.w * x).sum() * y
            return SimpleNamespace(loss=loss, total_loss=loss, aux={})

        def after_optimizer_step(self) -> None:
            self.calls += 1

    model = Counting()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    good = lambda _: (torch.ones(3), torch.tensor(1.0))  # noqa: E731
    bad = lambda _: (torch.full((3,), 1e38), torch.tensor(1e38))  # noqa: E731
    for batch in (good, good, bad):
        train_step(model, opt, batch, 1, dtype="fp32", grad_clip=1.0, device=torch.device("cpu"))
    assert model.calls == 2
    assert unwrap(torch.compile(model)) is model
