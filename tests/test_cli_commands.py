"""The CLI wrappers of generation and the law: contract keys and exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xmodlm.cli import main
from xmodlm.law.synthetic import synthetic_runs
from xmodlm.train.trainer import train


def test_law_fit_predict_recommend(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table = tmp_path / "runs.csv"
    synthetic_runs(60, seed=1, contexts=(1024,)).to_csv(table, index=False)
    fit = tmp_path / "fit.json"
    assert main(["law", "fit", str(table), "--n-boot", "100", "--out", str(fit), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    params = payload["dense"][0]["params"]
    assert set(params) >= {"E", "A", "B", "alpha", "beta"}
    assert all(len(p["ci"]) == 2 for p in params.values())
    assert main(["law", "predict", str(fit), "--input", str(table), "--json"]) == 0
    preds = json.loads(capsys.readouterr().out)["predictions"]
    assert len(preds) == 60 and all(p["lo"] <= p["pred_loss"] <= p["hi"] for p in preds)
    assert main(["recommend", "--compute", "1e17", "--context", "1024",
                 "--active-params", "3e7", "--law", str(fit), "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert "answer" in rec and rec["candidates"] and rec["loss"] == "topk"  # no causal column


def test_law_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("params_active,tokens\n1,2\n")
    assert main(["law", "fit", str(bad)]) == 2
    assert "val_loss" in capsys.readouterr().err
    assert main(["recommend", "--compute", "1e17", "--context", "1024",
                 "--active-params", "3e7", "--law", str(tmp_path / "none.json")]) == 2


def test_generate_from_trained_run(tiny_data_dir: Path, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    from test_train import small_cfg

    run = tmp_path / "run"
    train(small_cfg(tiny_data_dir, "train.max_steps=3"), run, progress=False)
    args = ["generate", str(run), "--prompt", "The ship", "--prompt", "A king was",
            "--max-new-tokens", "5", "--seed", "1", "--json"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first  # same seed, same text
    rows = [json.loads(line) for line in first.splitlines()]
    assert [r["prompt"] for r in rows] == ["The ship", "A king was"]
    assert main(["generate", str(tmp_path / "nope"), "--prompt", "x"]) == 2


def _commands(parser, prefix=()):
    """(command words, parser) of every leaf command of ``parser``."""
    import argparse

    nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not nested:
        yield prefix, parser
        return
    for name, sub in nested[0].choices.items():
        yield from _commands(sub, (*prefix, name))


def test_every_option_has_help_every_command_quiet_and_device_auto() -> None:
    import argparse

    from xmodlm.cli import build_parser

    commands = list(_commands(build_parser()))
    assert len(commands) >= 19
    for words, parser in commands:
        where = f"xmod {' '.join(words)}"
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            text = action.help or ""
            assert text.replace("(default: %(default)s)", "").strip(), \
                f"{where} {action.option_strings[0]}: no help text"
        assert "--quiet" in parser._option_string_actions, f"{where}: no --quiet"
        device = parser._option_string_actions.get("--device")
        if device is not None and words[0] != "bench":  # bench times a named device
            assert device.default in ("auto", None), f"{where}: --device defaults to {device.default}"


def test_errors_name_the_subcommand_and_losses_are_rounded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["law", "fit", str(tmp_path / "missing.csv")]) == 2
    assert capsys.readouterr().err.startswith("xmod law fit: error:")
    from xmodlm.cli.train import _rounded

    assert _rounded(7.339908301830292) == "7.3399" and _rounded(None) == "None"
