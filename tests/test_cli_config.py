"""Configs and the CLI's contract: bad input is one line and exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from xmodlm.cli import main
from xmodlm.config import load_config


def test_info_json_has_contract_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "xmod-tiny", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    for key in ("params_total", "params_non_embedding", "params_active", "flops_per_token",
                "layout", "stride", "capacity", "config"):
        assert key in info
    assert set(info["flops_per_token"]) >= {"forward", "train", "lm_head"}
    assert {"n_kv_heads", "head_dim", "qk_norm"} <= set(info["config"]["model"])
    assert info["layout"] == "DsssDsssDsss"
    assert info["params_total"] > info["params_active"]
    assert info["config"]["model"]["stride"] == 4


def test_set_overrides_apply() -> None:
    cfg = load_config("xmod-tiny", ["model.stride=2", "train.lr=1e-3", "model.gating=sigmoid"])
    assert cfg.model.stride == 2 and cfg.train.lr == 1e-3 and cfg.model.gating == "sigmoid"


def test_yaml_file_with_base(tmp_path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("base: dense-tiny\nmodel:\n  n_layers: 2\n")
    cfg = load_config(str(p))
    assert cfg.model.n_layers == 2 and cfg.model.d_model == 256


BAD = [
    (["--set", "model.capacity=0"], "model.capacity"),
    (["--set", "model.capacity=1.5"], "model.capacity"),
    (["--set", "model.stride=0"], "model.stride"),
    (["--set", "model.stride=5"], "multiple"),
    (["--set", "model.n_heads=3"], "n_heads"),
    (["--set", "model.bogus=1"], "model.bogus"),
    (["--set", "nonsense"], "key.path=value"),
    (["--set", "model.gating=relu"], "model.gating"),
    (["--set", "model.n_layers=abc"], "integer"),
    (["--set", "model.layout=DXss"], "model.layout"),
]


@pytest.mark.parametrize("extra,needle", BAD)
def test_bad_input_one_line_exit_2(extra, needle, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "xmod-tiny", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err


def test_missing_yaml_and_bad_yaml(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(tmp_path / "missing.yaml")]) == 2
    assert "not found" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    assert main(["info", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err


def test_console_entry_point_no_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "xmodlm", "info", "xmod-tiny", "--set", "model.capacity=-1"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


def test_a_config_naming_only_the_cv_weight_keeps_its_meaning(tmp_path) -> None:
    """A model section that names ``balance_coef`` but not ``balance`` (every run
    config written before ``balance`` existed) trains the CV loss at that weight, or
    nothing at 0, never the token-choice bias it did not know of."""
    from xmodlm.config import load_config

    for coef, balance in ((0.01, "cv"), (0.0, "none")):
        path = tmp_path / f"old{coef}.yaml"
        path.write_text(f"model:\n  stride: 4\n  capacity: 0.25\n  balance_coef: {coef}\n")
        m = load_config(path).model
        assert (m.balance, m.cv_coef, m.token_bias) == (balance, coef, 0.0)
    path.write_text("model:\n  stride: 4\n  capacity: 0.25\n  balance_coef: 0.01\n"
                    "  balance: token_bias\n")
    assert load_config(path).model.balance == "token_bias"
    assert load_config("cpu-d64").model.token_bias > 0  # a sparse model's default
