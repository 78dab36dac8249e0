"""The wheel installs and works on its own: built from a copy of the source, installed in
a fresh virtual environment (torch pinned to the CPU build these machines carry), it
answers ``xmod --version`` and ``xmod presets``, ships its sweep specs and default law
fit, prepares a tiny corpus and trains on it. Slow (a venv and its packages): ``make
test-all`` runs it, ``make test`` does not."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from xmodlm.presets import preset_names

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"  # as the Makefile pins it: a loose requirement pulls a CUDA build


def _run(*cmd: str | Path, cwd: Path | None = None, timeout: int = 900) -> str:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{cmd}: {done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done.stdout


@pytest.mark.slow
def test_wheel_installs_in_a_fresh_venv_and_trains(tmp_path: Path) -> None:
    source = tmp_path / "source"  # never build in the checkout: build/ and egg-info stay out
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    _run(sys.executable, "-m", "build", "--wheel", "--outdir", tmp_path / "dist", source)
    (wheel,) = (tmp_path / "dist").glob("xmod_lm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"xmodlm/law/default_fit.json", "xmodlm/configs/sweeps/micro-quick.yaml",
            *(f"xmodlm/configs/{p}.yaml" for p in preset_names())} <= names

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv)
    pip = [venv / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run(*pip, TORCH)
    _run(*pip, wheel)
    xmod = venv / "bin" / "xmod"
    work = tmp_path / "work"  # away from the checkout: the installed package, not src/
    work.mkdir()
    assert _run(xmod, "--version", cwd=work).strip().endswith("0.1.0")
    assert _run(xmod, "presets", cwd=work).split() == preset_names()
    law = _run(venv / "bin" / "python", "-c",
               "from importlib import resources; import xmodlm;"
               " print(xmodlm.__file__);"
               " print(resources.files('xmodlm').joinpath('law/default_fit.json').is_file())",
               cwd=work).split()
    assert law == [str(next(venv.glob("lib/python*/site-packages/xmodlm/__init__.py"))), "True"]

    text = work / "text.txt"
    text.write_text("\n\n".join(f"Paragraph {i}. The old sailor looked across the harbour"
                                " at night and spoke quietly of the sea." * 3
                                for i in range(40)))
    _run(xmod, "data", "prepare", "--text", text, "--vocab-size", "300", "--out", "corpus",
         "--quiet", cwd=work)
    sets = ["data.dir=corpus", "model.d_model=32", "model.n_heads=2", "model.n_layers=4",
            "model.stride=2", "model.capacity=0.5", "model.context=32", "train.batch_size=2",
            "train.max_steps=2", "train.warmup_steps=1", "data.val_batches=1",
            "train.dtype=fp32", "train.compile=off"]
    out = _run(xmod, "train", "xmod-tiny", "--out", "run", "--quiet",
               *(a for kv in sets for a in ("--set", kv)), cwd=work)
    assert "ok after 2 steps" in out, out
    assert "vocab_size: 300" in (work / "run" / "config.yaml").read_text()  # the corpus's
