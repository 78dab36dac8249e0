"""The README's law block as one chain: sweep -> law fit -> law predict -> recommend -> report.

The default suite runs the chain at toy size: the shipped ``law-quick`` spec with
its budgets cut so each run takes a few steps on the small test corpus (so the
fit is told ``--min-steps 0`` and a small bootstrap). The slow test runs the
README's printed commands themselves, unchanged, on the prepared default corpus.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pandas as pd
import pytest
import yaml

from test_readme import readme_blocks
from xmodlm.cli import main
from xmodlm.sweep.spec import expand, load_spec

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SPEC = ROOT / "src" / "xmodlm" / "configs" / "sweeps" / "law-quick.yaml"


def _law_block() -> list[list[str]]:
    """The README's block that runs the law-quick sweep, as argv lists."""
    blocks = [b for b in readme_blocks(README.read_text(encoding="utf-8"))
              if "xmod sweep law-quick --out" in b.code]
    assert len(blocks) == 1, "README: one block runs the law-quick sweep"
    return [argv for line in blocks[0].code.splitlines()
            if (argv := shlex.split(line, comments=True))]


def test_readme_law_block_is_the_whole_chain() -> None:
    """The printed block runs each stage in order, on the sweep it ran."""
    stages = [" ".join(argv[1:3]) for argv in _law_block()]
    order = ["sweep law-quick", "law fit", "law predict", "recommend --compute", "report runs/sweep"]
    found = [next(i for i, s in enumerate(stages) if s.startswith(o)) for o in order]
    assert found == sorted(found), stages


def test_law_quick_runs_meet_the_law_defaults() -> None:
    """Every run of the shipped quick spec is kept by `xmod law fit`'s default --min-steps,
    and the design can fit a dense law (six dense runs over sizes and budgets) and
    choose a delta form by leaving a cell out (two or more cells)."""
    from xmodlm.law.table import DEFAULT_MIN_STEPS

    runs = expand(load_spec("law-quick"))
    assert min(r.steps for r in runs) >= DEFAULT_MIN_STEPS
    dense = [r for r in runs if r.cfg.model.family == "dense"]
    assert len(dense) >= 6
    assert len({r.row()["params_active"] for r in dense}) >= 3
    assert len({r.compute for r in dense}) >= 2
    cells = {(r.cfg.model.stride, r.cfg.model.capacity) for r in runs if r not in dense}
    assert len(cells) >= 2


def test_law_chain_at_toy_size(tiny_data_dir: Path, tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    spec = yaml.safe_load(SPEC.read_text())
    spec["compute"] = [4.0e8, 8.0e8]  # a few steps a run at vocab 300
    spec["families"][1]["capacity"] = spec["families"][1]["capacity"][-1:]  # 10 runs, not 14
    spec["context"] = [32]
    spec["batch_tokens"] = 64
    spec.pop("require")
    spec["set"] = [*spec["set"], f"data.dir={tiny_data_dir}", "model.vocab_size=300",
                   "data.val_batches=1", "train.warmup_steps=1"]
    (tmp_path / "law-quick.yaml").write_text(yaml.safe_dump(spec))
    monkeypatch.chdir(tmp_path)

    def run(*argv: str) -> str:
        code = main(list(argv))
        out, err = capsys.readouterr()
        assert code == 0, f"xmod {' '.join(argv)} exited {code}: {err}"
        return out

    run("sweep", "law-quick.yaml", "--out", "runs/sweep", "--executor", "local",
        "--workers", "2", "--quiet", "--allow-dirty")
    table = pd.read_csv("runs/sweep/results.csv")
    assert len(table) == 10 and (table["status"] == "ok").all(), table[["status", "error"]]
    run("law", "fit", "runs/sweep/results.csv", "--out", "fit.json", "--plots", "plots/",
        "--json", "--min-steps", "0", "--n-boot", "100", "--quiet")
    assert (tmp_path / "plots" / "law_bootstrap.png").is_file()
    predicted = json.loads(run("law", "predict", "fit.json", "--input", "runs/sweep/results.csv",
                               "--json"))
    assert predicted["predicts"] == "loss"
    assert len(predicted["predictions"]) == 10
    assert all(p["pred_loss"] > 0 for p in predicted["predictions"])
    answer = json.loads(run("recommend", "--compute", "1e18", "--context", "1024",
                            "--active-params", "1e8", "--law", "fit.json", "--json"))
    assert answer["answer"]
    run("report", "runs/sweep", "--law", "fit.json", "--out", "report/", "--quiet")
    assert "dense" in (tmp_path / "report" / "report.md").read_text()


@pytest.mark.slow
def test_readme_law_block_as_printed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The printed commands, unchanged, on the prepared default corpus (minutes: the
    sweep trains 14 runs of 1000+ steps)."""
    corpus = ROOT / "data" / "corpus"
    if not (corpus / "manifest.json").is_file():
        pytest.skip("the default corpus is not prepared (xmod data prepare --out data/corpus)")
    (tmp_path / "data").mkdir()
    os.symlink(corpus, tmp_path / "data" / "corpus")
    (tmp_path / "results").symlink_to(ROOT / "results")
    monkeypatch.chdir(tmp_path)
    for argv in _law_block():
        assert argv[0] == "xmod"
        code = main(argv[1:])
        assert code == 0, f"`{shlex.join(argv)}` exited {code}"
    assert (tmp_path / "report" / "report.md").is_file()
