"""Writing checkpoints and run directories (reading them: :mod:`xmodlm.runs`).

A run directory holds::

    config.yaml          the fully resolved configuration
    tokenizer.json       copied from the data directory, so the run is self-contained
    env.json             git commit, package versions, hardware, threads
    metrics.jsonl        one JSON object per logged step
    summary.json         written on success (or divergence)
    ckpt/step_00000200/  model.safetensors + state.pt (optimiser, schedule, RNG, data
                         position, counters) + meta.json, written atomically

A checkpoint directory is complete once ``meta.json`` exists: it is written last,
after everything else was fsynced, and the directory itself is renamed into place
from a temporary name, so a crash leaves either a whole checkpoint or none.

Only names of exactly that form (``step_`` and eight digits) are checkpoints
(:func:`xmodlm.runs.checkpoint_dirs`); anything else in ``ckpt/`` is never loaded,
pruned or parsed.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from xmodlm.errors import UserError
from xmodlm.fileio import atomic_write_json, follow_umask, fsync_dir
from xmodlm.runs import CKPT_DIR, checkpoint_dirs, untie_weights


def abandoned_tmp_dirs(run_dir: Path) -> list[Path]:
    """``ckpt/.tmp_step_*`` folders of checkpoints whose writer was killed mid-write."""
    root = Path(run_dir) / CKPT_DIR
    return sorted(p for p in root.glob(".tmp_step_*") if p.is_dir()) if root.is_dir() else []


def clean_abandoned(run_dir: Path) -> list[Path]:
    """Remove abandoned temporary checkpoint folders (call only while holding the run's lock)."""
    found = abandoned_tmp_dirs(run_dir)
    for tmp in found:
        shutil.rmtree(tmp, ignore_errors=True)
    return found


def check_finished_run_resumable(run_dir: Path) -> None:
    """Refuse to retrain a finished run whose checkpoints are gone.

    Its ``summary.json`` says it finished; with no checkpoint to resume from,
    training would start again at step 0 and overwrite the finished run's metrics
    and summary, so this stops instead (``--restart`` trains it again on purpose).
    """
    run = Path(run_dir)
    try:
        status = json.loads((run / "summary.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return
    if status in ("ok", "diverged") and not checkpoint_dirs(run):
        raise UserError(
            f"run directory {str(run)!r} is finished (summary.json: {status}) but has no"
            f" checkpoint in {CKPT_DIR}/ to resume from: nothing to do; pass --restart to"
            " train it again from step 0"
        )


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: torch.nn.Module | dict[str, torch.Tensor],
    state: dict[str, Any],
    meta: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write a complete checkpoint atomically and prune all but the last ``keep_last``.

    ``model`` is a module or its full (unsharded) state dict, as a sharded model's
    must be gathered by every rank before the main rank writes it.
    """
    root = Path(run_dir) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp_step_{step:08d}_"))
    try:
        follow_umask(tmp, directory=True)
        full = model if isinstance(model, dict) else model.state_dict()
        weights = {k: v.detach().contiguous().cpu() for k, v in full.items()}
        save_file(untie_weights(weights), str(tmp / "model.safetensors"))
        torch.save(state, tmp / "state.pt")
        for name in ("model.safetensors", "state.pt"):
            follow_umask(tmp / name)
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        atomic_write_json(tmp / "meta.json", {**meta, "step": step})
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
    except OSError as err:  # a full disk, a read-only or revoked file system: name the place
        shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(err.errno, err.strerror or str(err), err.filename or str(final)) from err
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in checkpoint_dirs(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_state(ckpt: Path) -> dict[str, Any]:
    """The resume state (optimiser, counters, RNG) of a checkpoint.

    Read with ``weights_only=True``: tensors, numbers, strings and containers only,
    never arbitrary objects (a crafted ``state.pt`` cannot run code). Model weights
    never come from here: they are safetensors (:func:`load_model_weights`).
    """
    path = Path(ckpt) / "state.pt"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise UserError(f"checkpoint state {path} cannot be read: {_one_line(err)}") from None
    if not isinstance(state, dict):
        raise UserError(f"checkpoint state {path} is not a state dictionary")
    return state


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())[:300]


