"""Switches that switch: compile on/off, trackers (missing, W&B resume, TensorBoard lists),
the CLI's help/version/defaults, train --device/--force, the config echo, DDP rank
output, tty-aware progress, and eval keys named after the split."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from xmodlm.cli import main
from xmodlm.config import load_config
from xmodlm.errors import UserError
from xmodlm.train import loggers

TINY = [
    "model.vocab_size=300", "model.d_model=32", "model.n_heads=2", "model.n_layers=4",
    "model.stride=2", "model.capacity=0.5", "model.context=32", "train.batch_size=2",
    "train.dtype=fp32", "train.warmup_steps=1", "data.val_batches=1", "train.max_steps=2",
]


def _train_argv(data: Path, out: Path, *extra: str) -> list[str]:
    sets = [a for kv in [f"data.dir={data}", *TINY, *extra] for a in ("--set", kv)]
    return ["train", "xmod-tiny", "--out", str(out), *sets]


# --- config -----------------------------------------------------------------------------


def test_compile_accepts_on_off_as_yaml_reads_them(tmp_path: Path) -> None:
    for given, want in (("on", "on"), ("off", "off"), ("auto", "auto"), ("true", "on"),
                        ("false", "off")):
        assert load_config("xmod-tiny", [f"train.compile={given}"]).train.compile == want
    path = tmp_path / "c.yaml"
    path.write_text("base: xmod-tiny\ntrain:\n  compile: on\n")
    assert load_config(path).train.compile == "on"
    with pytest.raises(UserError, match="train.compile"):
        load_config("xmod-tiny", ["train.compile=sometimes"])
    with pytest.raises(UserError, match="must be a string"):  # only compile reads booleans
        load_config("xmod-tiny", ["train.schedule=on"])


# --- the CLI's surface ------------------------------------------------------------------


def test_version_bare_command_and_help_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    from xmodlm import __version__

    assert main(["--version"]) == 0
    assert __version__ in capsys.readouterr().out
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "usage: xmod" in out and "train" in out and "export" in out
    assert main(["generate", "--help"]) == 0
    out = capsys.readouterr().out
    assert "(default: 64)" in out and "(default: 0.8)" in out
    assert main(["law", "fit", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--form {auto,paper,base," in out
    assert main(["law", "fit", "x.csv", "--form", "nope"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_missing_tracker_is_one_line_exit_2(
    tiny_data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    real = loggers.importlib.util.find_spec
    monkeypatch.setattr(loggers.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tensorboard", "wandb") else real(name))
    for key in ("tensorboard", "wandb"):
        code = main(_train_argv(tiny_data_dir, tmp_path / key, f"train.{key}=true"))
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and f"pip install {key}" in err, err
        assert not (tmp_path / key).exists()  # before any work


# --- trackers ---------------------------------------------------------------------------


class _FakeWandbRun:
    def __init__(self, calls: list[dict[str, Any]]) -> None:
        self.logged: list[dict[str, Any]] = []
        self.calls = calls

    def log(self, scalars: dict[str, Any], step: int) -> None:
        self.logged.append({"step": step, **scalars})

    def finish(self) -> None:
        pass


def _fake_wandb(monkeypatch: pytest.MonkeyPatch) -> tuple[list[dict[str, Any]], list[Any]]:
    calls: list[dict[str, Any]] = []
    runs: list[Any] = []
    ids = iter(["first-id", "second-id"])

    def init(**kwargs: Any) -> _FakeWandbRun:
        calls.append(kwargs)
        runs.append(_FakeWandbRun(calls))
        return runs[-1]

    module = types.SimpleNamespace(init=init, util=types.SimpleNamespace(generate_id=lambda: next(ids)))
    monkeypatch.setitem(sys.modules, "wandb", module)
    real = loggers.importlib.util.find_spec
    monkeypatch.setattr(loggers.importlib.util, "find_spec",
                        lambda name, *a: object() if name in ("wandb", "tensorboard") else real(name))
    return calls, runs


def test_wandb_settings_and_resume_continue_the_same_run(
    tiny_data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls, runs = _fake_wandb(monkeypatch)
    run = tmp_path / "run"
    extra = ["train.wandb=true", "train.wandb_project=proj", "train.wandb_entity=team",
             "train.wandb_tags=a, b", "train.eval_every=1", "train.log_every=1"]
    assert main(_train_argv(tiny_data_dir, run, *extra) + ["--quiet"]) == 0
    assert (run / "wandb_run_id").read_text().strip() == "first-id"
    first = calls[0]
    assert (first["id"], first["project"], first["entity"], first["tags"]) == (
        "first-id", "proj", "team", ["a", "b"])
    assert first["resume"] == "allow"
    evals = [r for r in runs[0].logged if "val_loss_topk" in r]
    assert evals and "coverage/0" in evals[-1]  # per-layer lists, one scalar each
    assert main(_train_argv(tiny_data_dir, run, *extra, "train.max_steps=3")
                + ["--quiet", "--force"]) == 0
    assert calls[1]["id"] == "first-id"  # resumed: the same W&B run


def test_tensorboard_logs_list_metrics_per_layer(
    tiny_data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_wandb(monkeypatch)  # makes find_spec("tensorboard") succeed
    scalars: list[str] = []

    class Writer:
        def __init__(self, logdir: str) -> None:
            pass

        def add_scalar(self, tag: str, value: float, step: int) -> None:
            assert isinstance(value, (int, float))
            scalars.append(tag)

        def close(self) -> None:
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard",
                        types.SimpleNamespace(SummaryWriter=Writer))
    run = tmp_path / "run"
    assert main(_train_argv(tiny_data_dir, run, "train.tensorboard=true", "train.eval_every=1")
                + ["--quiet"]) == 0
    assert "train/loss" in scalars and "eval/val_loss_topk" in scalars
    assert "eval/capacity_causal/0" in scalars and "eval/coverage/0" in scalars


# --- train: device, echo, resume, ranks, progress ---------------------------------------


def test_train_device_echo_progress_and_changed_resume(
    tiny_data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    run = tmp_path / "run"
    assert main(_train_argv(tiny_data_dir, run) + ["--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert "starting -> 2 steps (max_steps)" in lines[0] and "layout DsDs" in lines[0]
    assert "cpu" in lines[0]
    assert "\r" not in err  # not a terminal: plain lines, no carriage-return updates
    assert any(line.startswith("train: 2/2 step") and "loss" in line for line in lines)
    assert "ok after 2 steps" in out
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    # a changed budget is refused (one line), --force continues with it
    assert main(_train_argv(tiny_data_dir, run, "train.max_steps=3")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train.max_steps: 2 -> 3" in err and "--force" in err
    assert main(_train_argv(tiny_data_dir, run, "train.max_steps=3") + ["--force", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert "after 3 steps" in out  # --quiet: no echo, no progress (notes stay)
    assert "resuming at" not in err and "step 3/3" not in err
    # settings that do not change what is trained may change freely
    assert main(_train_argv(tiny_data_dir, run, "train.max_steps=3", "train.log_every=5")
                + ["--quiet"]) == 0
    assert main(_train_argv(tiny_data_dir, tmp_path / "r2") + ["--device", "tpu"]) == 2


def test_rank_other_than_0_prints_no_summary(
    tiny_data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Under torchrun only rank 0 reports; the training itself is stubbed (one
    process cannot be rank 1 of two), the CLI's reporting is what is under test."""
    import xmodlm.train.trainer as trainer

    run = tmp_path / "run"
    done = {"status": "ok", "steps": 2, "final_val_loss": 5.0, "final_val_loss_causal": 5.0,
            "val_bpb": 2.0}
    monkeypatch.setattr(trainer, "train", lambda *a, **k: done)
    assert main(_train_argv(tiny_data_dir, run) + ["--quiet"]) == 0
    assert "val loss" in capsys.readouterr().out
    monkeypatch.setenv("RANK", "1")  # as torchrun sets them for the second process
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(_train_argv(tiny_data_dir, run) + ["--quiet"]) == 0
    assert "val loss" not in capsys.readouterr().out


def test_eval_keys_name_the_split(tiny_data_dir: Path, tmp_path: Path) -> None:
    from xmodlm.eval import evaluate_run

    run = tmp_path / "run"
    assert main(_train_argv(tiny_data_dir, run) + ["--quiet"]) == 0
    test = evaluate_run(run, split="test", tasks=(), max_batches=1)
    assert test["split"] == "test"
    for key in ("loss_topk", "loss_causal", "bpb", "bpb_causal"):
        assert test[f"test_{key}"] == test[f"val_{key}"]  # val_* kept for older readers
    val = evaluate_run(run, split="val", tasks=(), max_batches=1)
    assert "test_loss_topk" not in val
