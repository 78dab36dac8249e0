"""Runs as their readers see them: the checkpoints of a run directory, a run's model
and tokenizer, and the one rewrite of a finished checkpoint (calibrated thresholds).

A reader may be handed an exported model instead of a run: :func:`is_exported`
tells the two apart, here rather than in :mod:`xmodlm.export`, so that
:func:`load_run` can point the user to ``load_pretrained`` while export, which
reads runs, stays the only side of the two that imports the other.

Evaluation, calibration, generation, export, the bench and the report read runs
through this module; training writes them (:mod:`xmodlm.train.checkpoint`) and
resumes through it too. It knows nothing of the trainer, so nothing that reads a
run has to import training. The layout of a run directory is described in
:mod:`xmodlm.train.checkpoint`.

Only names of exactly the form ``step_`` and eight digits are checkpoints;
anything else in ``ckpt/`` (a user's ``step_00000005.bak`` copy, an editor's
file) is left alone, named once on stderr, and never loaded, pruned or parsed.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save

from xmodlm.config import Config, load_config
from xmodlm.errors import UserError
from xmodlm.fileio import atomic_open, follow_umask
from xmodlm.info import check_memory
from xmodlm.model import Transformer

CKPT_DIR = "ckpt"
EXPORT_FORMAT = "xmodlm-export"  # config.json's "format" in a directory xmod export wrote
EXPORT_CONFIG = "config.json"
_CKPT_NAME = re.compile(r"step_(\d{8})")
_noted_strays: set[Path] = set()


def checkpoint_step(ckpt: Path) -> int:
    """The step of a checkpoint directory named ``step_NNNNNNNN``."""
    match = _CKPT_NAME.fullmatch(Path(ckpt).name)
    assert match is not None, ckpt  # only checkpoint_dirs' names reach here
    return int(match.group(1))


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first. Other ``step_*`` entries (a
    backup copy ``step_00000005.bak``) are not checkpoints: noted once, ignored."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    found = []
    for p in root.glob("step_*"):
        if _CKPT_NAME.fullmatch(p.name):
            if (p / "meta.json").is_file():
                found.append(p)
        elif p not in _noted_strays:
            _noted_strays.add(p)
            print(f"note: ignoring {p}: not a checkpoint name (step_ and 8 digits)",
                  file=sys.stderr)
    return sorted(found, key=checkpoint_step)


def is_exported(path: str | Path) -> bool:
    """True for a directory written by :func:`xmodlm.export.export_run` (a
    ``config.json`` of our format)."""
    cfg = Path(path) / EXPORT_CONFIG
    if not cfg.is_file():
        return False
    try:
        return json.loads(cfg.read_text(encoding="utf-8")).get("format") == EXPORT_FORMAT
    except (ValueError, UnicodeDecodeError, AttributeError, OSError):
        return False


def rewrite_model_weights(ckpt: Path, model: torch.nn.Module) -> None:
    """Replace a complete checkpoint's ``model.safetensors`` with ``model``'s weights,
    atomically (a crash leaves the old file or the new one); its training state is
    not touched. For buffers no training step reads, such as calibrated thresholds."""
    weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    path = Path(ckpt) / "model.safetensors"
    try:
        with atomic_open(path) as f:
            f.write(save(untie_weights(weights)))
        follow_umask(path)
    except OSError as err:
        raise OSError(err.errno, err.strerror or str(err), err.filename or str(path)) from err


def untie_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights with every tensor that shares storage with an earlier one copied:
    safetensors refuses shared storage (tied embeddings), and a checkpoint, a
    calibrated rewrite and an export all store tied weights this way."""
    seen: dict[int, str] = {}
    out = {}
    for k, v in weights.items():
        ptr = v.data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.setdefault(ptr, k)
    return out


def load_model_weights(
    ckpt: Path,
    model: torch.nn.Module,
    load: Callable[[dict[str, torch.Tensor]], Any] | None = None,
) -> None:
    """Load ``model.safetensors`` into ``model``; any mismatch is a UserError naming the file.

    ``load`` replaces ``model.load_state_dict(weights, strict=True)`` (a sharded
    model scatters the full weights instead).
    """
    path = Path(ckpt) / "model.safetensors"
    try:
        weights = load_file(str(path))
    except Exception as err:  # truncated or not a safetensors file
        raise UserError(f"checkpoint {path} cannot be read: {err}") from None
    own = model.state_dict()
    for k, v in weights.items():  # gate gammas were 0-d scalars in earlier checkpoints
        if v.dim() == 0 and k in own and own[k].shape == (1,):
            weights[k] = v.reshape(1)
    try:
        if load is None:
            model.load_state_dict(weights, strict=True)
        else:
            load(weights)
    except (RuntimeError, KeyError, ValueError):
        raise UserError(
            f"checkpoint {path} does not match the run's configuration"
            " (different architecture): use the config it was trained with"
        ) from None


def load_run(
    run_dir: str | Path, device: str = "cpu", step: int | None = None
) -> tuple[Config, Transformer, Path]:
    """The model of a finished or running run: (config, model in eval mode, checkpoint).

    Uses the newest complete checkpoint that loads (or ``step``); a checkpoint that
    fails to load is reported by name and the previous one is tried.
    """
    run = Path(run_dir)
    if not (run / "config.yaml").is_file():
        if is_exported(run):
            raise UserError(
                f"{str(run)!r} is an export (config.json + model.safetensors), not a run"
                " directory: pass the run it was exported from (the --out of xmod train),"
                f" or load the export with xmodlm.load_pretrained({str(run)!r})"
            )
        raise UserError(f"run directory {str(run)!r} not found or has no config.yaml")
    cfg = load_config(run / "config.yaml")
    ckpts = checkpoint_dirs(run)
    if not ckpts:
        raise UserError(f"run directory {str(run)!r} has no complete checkpoint yet")
    if step is not None:
        steps = [checkpoint_step(p) for p in ckpts]
        if step not in steps:
            raise UserError(
                f"run directory {str(run)!r} has no checkpoint at step {step}; its steps:"
                f" {', '.join(map(str, steps))}"
            )
        ckpts = [p for p in ckpts if checkpoint_step(p) == step]
    check_memory(cfg.model, torch.device(device), "load")
    errors = []
    for ckpt in reversed(ckpts):
        model = Transformer(cfg.model)
        try:
            load_model_weights(ckpt, model)
        except UserError as err:
            errors.append(str(err))
            continue
        return cfg, model.to(device).eval(), ckpt
    raise UserError(errors[0] if len(errors) == 1 else f"no checkpoint loads: {errors[0]}")


def tokenizer_path(run_dir: str | Path) -> Path:
    """The tokenizer a run was trained with (copied into the run directory at its start)."""
    path = Path(run_dir) / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"run directory {str(run_dir)!r} has no tokenizer.json")
    return path
