"""The README runs as written: its ```bash and ```python blocks, in order, in a scratch directory.

Conventions (README.md says them too):

* ``<!-- ci: skip: REASON -->`` on the line before a fenced block: not run here
  (the network, several processes, hours); the reason is required;
* ``<!-- ci: needs MODULE -->``: run only where MODULE imports.

Every other ``bash`` line must be an ``xmod`` command; it runs in-process through
:func:`xmodlm.cli.main` (no interpreter start per line) and must exit 0. The only
changes are the tiny overrides of :data:`EXTRA` appended to some subcommands, and
``data/corpus`` is a small prepared corpus. ``python`` blocks run with ``exec`` in
the same directory. A command that fails as written fails the test.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from xmodlm.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = re.compile(r"^<!--\s*ci:\s*(skip|needs)\b:?\s*(.*?)\s*-->$")
TINY = [
    "model.d_model=32", "model.n_heads=2", "model.n_layers=4", "model.stride=2",
    "model.capacity=0.5", "model.context=32", "train.batch_size=2", "train.max_steps=2",
    "train.warmup_steps=1", "train.eval_every=1000", "data.val_batches=1",
]
EXTRA: dict[str, list[str]] = {
    "train": [a for kv in TINY for a in ("--set", kv)] + ["--quiet"],
    "eval": ["--max-items", "10"],
    "lm-eval": ["--limit", "4"],
    "generate": ["--max-new-tokens", "4"],
}


@dataclass
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the opening fence
    skip: str | None = None  # the reason
    needs: str | None = None


def readme_blocks(text: str) -> list[Block]:
    """The fenced ``bash`` and ``python`` blocks of ``text`` with their markers."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\w+)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        block = Block(fence.group(1), "\n".join(lines[i + 1 : end]) + "\n", i + 1)
        prev = lines[i - 1].strip() if i else ""
        m = MARKER.match(prev)
        if m and m.group(1) == "skip":
            block.skip = m.group(2)
        elif m:
            block.needs = m.group(2)
        if block.lang in ("bash", "python"):
            blocks.append(block)
        i = end + 1
    return blocks


def _commands(block: Block) -> list[list[str]]:
    out = []
    for raw in block.code.splitlines():
        argv = shlex.split(raw, comments=True)
        if argv:
            out.append(argv)
    return out


def test_markers_are_well_formed() -> None:
    text = README.read_text(encoding="utf-8")
    blocks = readme_blocks(text)
    assert sum(b.skip is None for b in blocks) >= 5, "most README blocks should run"
    for b in blocks:
        assert b.skip is None or b.skip, f"README line {b.line}: a skip needs a reason"
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("<!-- ci"):
            assert MARKER.match(line.strip()), f"README line {number}: malformed marker {line!r}"
    # every bash line that runs is an xmod command the test can run in-process
    for b in blocks:
        if b.lang == "bash" and b.skip is None:
            for argv in _commands(b):
                assert argv[0] == "xmod", f"README line {b.line}: {argv[0]!r} cannot run here"


def test_parser_reads_markers() -> None:
    text = (
        "<!-- ci: skip: slow -->\n```bash\nxmod bench\n```\n\n"
        "<!-- ci: needs lm_eval -->\n```python\nimport lm_eval\n```\n"
        "```bash\nxmod presets  # list\n```\n```text\nnot code\n```\n"
    )
    a, b, c = readme_blocks(text)
    assert (a.skip, a.needs, a.line) == ("slow", None, 2)
    assert (b.skip, b.needs, b.lang) == (None, "lm_eval", "python")
    assert (c.skip, c.needs) == (None, None) and _commands(c) == [["xmod", "presets"]]


def test_readme_runs_as_written(
    tiny_data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    shutil.copytree(tiny_data_dir, tmp_path / "data" / "corpus")
    (tmp_path / "results").symlink_to(README.parent / "results")  # as in a clone: read-only use
    monkeypatch.chdir(tmp_path)
    ran = 0
    for block in readme_blocks(README.read_text(encoding="utf-8")):
        if block.skip is not None:
            continue
        if block.needs and importlib.util.find_spec(block.needs) is None:
            continue
        if block.lang == "python":
            try:
                exec(compile(block.code, f"README.md:{block.line}", "exec"), {"__name__": "readme"})
            except Exception as err:
                pytest.fail(f"README python block at line {block.line} failed: {err!r}")
            ran += 1
            continue
        for argv in _commands(block):
            sub = next((a for a in argv[1:] if not a.startswith("-")), "")
            args = argv[1:] + EXTRA.get(sub, [])
            try:
                code = main(args)
            except SystemExit as exit_:  # --version / --help exit through argparse
                code = exit_.code if isinstance(exit_.code, int) else 1
            err = capsys.readouterr().err
            assert code == 0, f"README line {block.line}: `{shlex.join(argv)}` exited {code}: {err}"
            ran += 1
    assert ran >= 12
