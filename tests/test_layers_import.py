"""Layers point one way (docs/architecture.md): checked on the code's own imports."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "xmodlm"
# what each folder (or module) must never import
FORBIDDEN = {
    "model": ("xmodlm.train", "xmodlm.sweep", "xmodlm.law", "xmodlm.report", "xmodlm.cli",
              "xmodlm.eval", "xmodlm.bench"),
    "flops.py": ("torch", "xmodlm.model", "xmodlm.train"),
    "config.py": ("torch", "xmodlm.model", "xmodlm.train"),
    "record.py": ("torch", "xmodlm.model", "xmodlm.train", "xmodlm.law", "xmodlm.sweep"),
    "law": ("torch", "xmodlm.train", "xmodlm.sweep", "xmodlm.report", "xmodlm.cli"),
    # training calls evaluation (the loss, calibration); evaluation reads runs through
    # xmodlm.runs, never through train/: the two never import each other both ways
    "eval": ("xmodlm.train", "xmodlm.sweep", "xmodlm.law", "xmodlm.cli"),
    "report": ("xmodlm.train.trainer", "xmodlm.cli"),  # reading runs is fine, training is not
    # a sweep starts `xmod train` as a process; what it reads of a config (its budget,
    # the settings a resume may change) lives in xmodlm.config
    "sweep": ("xmodlm.train", "xmodlm.cli", "xmodlm.report"),
    "runs.py": ("xmodlm.train", "xmodlm.eval", "xmodlm.sweep", "xmodlm.law", "xmodlm.report",
                "xmodlm.cli"),
    "export.py": ("xmodlm.train", "xmodlm.sweep", "xmodlm.cli"),
}
# exceptions to FORBIDDEN (none today: the depth-router kinds, whose costs FLOP
# accounting reads and whose names the config validates, live outside the model)
ALLOWED: dict[str, tuple[str, ...]] = {}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_import_runs_upward() -> None:
    bad = []
    for where, forbidden in FORBIDDEN.items():
        root = SRC / where
        files = [root] if root.is_file() else sorted(root.rglob("*.py"))
        for path in files:
            for name in _imports(path):
                if name in ALLOWED.get(where, ()):
                    continue
                if any(name == f or name.startswith(f + ".") for f in forbidden):
                    bad.append(f"{path.relative_to(SRC)} imports {name}")
    assert not bad, "\n".join(bad)


def _package_imports(package: str) -> set[str]:
    """The xmodlm packages (first name below xmodlm) that ``package``'s files import."""
    out = set()
    for path in sorted((SRC / package).rglob("*.py")):
        out.update(n.split(".")[1] for n in _imports(path)
                   if n.startswith("xmodlm.") and n.count(".") >= 1)
    return out - {package}


def test_train_and_eval_do_not_import_each_other() -> None:
    """train -> eval is the one direction (the trainer evaluates); no loop back."""
    assert not ("eval" in _package_imports("train") and "train" in _package_imports("eval"))
    assert "train" not in _package_imports("eval")
    assert "train" not in _package_imports("sweep")


def test_bench_is_a_leaf() -> None:
    """What serves only ``xmod bench`` (the reference GPT, the law-fit timing) lives
    under bench/, and only the CLI reaches into it: the library never depends on it."""
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if rel.parts[0] in ("bench", "cli"):
            continue
        bad += [f"{rel} imports {n}" for n in _imports(path)
                if n == "xmodlm.bench" or n.startswith("xmodlm.bench.")]
    assert not bad, "\n".join(bad)
    assert not (SRC / "reference_gpt.py").exists() and not (SRC / "law" / "bench.py").exists()


def test_flop_accounting_loads_without_torch() -> None:
    """flops.py is arithmetic on configs: importing it (and config) pulls in no torch."""
    code = (
        "import sys, xmodlm.flops, xmodlm.depth_routers as k; k.kinds();"
        " assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
