"""The GPU command runs end to end at toy size on a CPU (slow: a few minutes)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks/gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_gpu_check_toy_end_to_end(tiny_data_dir: Path, tmp_path: Path) -> None:
    gpu_check = _module()
    out = tmp_path / "out"
    assert gpu_check.main(["--out", str(out), "--toy", "--data", str(tiny_data_dir),
                           "--budget-s", "3600", "--stages", "smoke,train,study"]) == 0
    summary = json.loads((out / "gpu_check.json").read_text())
    smoke = summary["stages"]["smoke"]["families"]
    assert set(smoke) == {"dense", "xmod_s4", "xmod_s8", "mod", "moe"}
    assert all(f["tokens_per_s"] > 0 and f["mfu"] > 0 for f in smoke.values())
    assert all(t["loss_fell"] for t in summary["stages"]["train"].values())
    study = summary["stages"]["study"]
    assert study["rows"] == study["ran"] >= 1
    assert study["rows"] + len(study["not_run_for_time"]) == 20


def test_gpu_check_refuses_bad_stages_and_missing_data(tmp_path: Path, capsys) -> None:
    gpu_check = _module()
    assert gpu_check.main(["--out", str(tmp_path), "--stages", "smoke,warp"]) == 2
    assert "unknown stage" in capsys.readouterr().err
    assert gpu_check.main(["--out", str(tmp_path), "--data", str(tmp_path / "none")]) == 2
    assert "no prepared corpus" in capsys.readouterr().err
