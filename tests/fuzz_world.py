"""A folder of every kind a user owns, for the bad-input tests: a prepared corpus, a
trained run, a sweep and an export, each under one root, plus the helpers that call
the CLI in-process and tell whether anything under the root changed."""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path

import yaml

from xmodlm.cli import main

TINY = {
    "data": {"val_batches": 1},
    "model": {"vocab_size": 300, "d_model": 32, "n_heads": 2, "n_layers": 4, "stride": 2,
              "capacity": 0.5, "context": 32},
    "train": {"batch_size": 4, "dtype": "fp32", "warmup_steps": 1, "log_every": 1,
              "eval_every": 1000, "max_steps": 2},
}
GOOD_SPEC = {"name": "t", "base": "micro", "compute": [2.0e9], "context": [32],
             "dense": [{"width": 32, "n_layers": 2, "n_heads": 2}],
             "families": [{"family": "dense"}, {"family": "xmod", "stride": 2, "capacity": 0.5}],
             "seeds": [0], "set": ["model.vocab_size=300", "train.batch_size=4",
                                   "train.max_steps=2", "data.val_batches=1"]}


def build_world(root: Path, corpus: Path) -> dict[str, Path]:
    """Copy ``corpus`` under ``root``, train a two-step run on it, and lay out a sweep
    (its spec's name in sweep.json, one finished run) and an export folder."""
    from xmodlm.config import load_config
    from xmodlm.runs import EXPORT_FORMAT
    from xmodlm.train.trainer import train

    w = {"root": root, "corpus": root / "corpus"}
    w["corpus"].mkdir(parents=True)
    for p in corpus.iterdir():
        if p.is_file():
            (w["corpus"] / p.name).write_bytes(p.read_bytes())
    cfg = {"base": "xmod-tiny", "name": "tiny", **TINY}
    cfg["data"] = {**TINY["data"], "dir": str(w["corpus"])}
    w["cfg"] = root / "tiny.yaml"
    w["cfg"].write_text(yaml.safe_dump(cfg))
    w["run"] = root / "run"
    train(load_config(w["cfg"]), w["run"], progress=False)
    w["sweep"] = root / "sweep"
    (w["sweep"] / "runs" / "0123456789ab").mkdir(parents=True)
    (w["sweep"] / "runs" / "0123456789ab" / "summary.json").write_text(json.dumps(
        {"status": "ok", "family": "dense", "width": 32, "n_layers": 2, "stride": 1,
         "capacity": 1.0, "context": 32, "params_total": 1000, "params_active": 900,
         "flops_per_token": 6000, "tokens": 1e6, "seed": 0, "final_val_loss": 3.5,
         "val_bpb": 1.2, "steps": 10}))
    (w["sweep"] / "sweep.json").write_text(json.dumps({"name": "other"}))
    w["export"] = root / "export"
    w["export"].mkdir()
    (w["export"] / "config.json").write_text(json.dumps({"format": EXPORT_FORMAT}))
    w["spec"] = root / "spec.yaml"
    w["spec"].write_text(yaml.safe_dump(
        {**GOOD_SPEC, "set": [*GOOD_SPEC["set"], f"data.dir={w['corpus']}"]}))
    return w


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root``: a file's bytes, None for a folder."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


def changed(before: dict[str, bytes | None], after: dict[str, bytes | None]) -> list[str]:
    """Paths added, removed or rewritten between two snapshots."""
    return sorted(k for k in before.keys() | after.keys() if before.get(k, 0) != after.get(k, 0))


def cli(argv: list[str]) -> tuple[int, str, str, float]:
    """``xmod ARGV`` in this process: (exit status, stdout, stderr, seconds)."""
    out, err = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue(), time.perf_counter() - start


def refused_in_one_line(code: int, err: str) -> bool:
    """Exit status 2 and exactly one line on stderr, no traceback."""
    return code == 2 and err.count("\n") == 1 and err.endswith("\n") and "Traceback" not in err
