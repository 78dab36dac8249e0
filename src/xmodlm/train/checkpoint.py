"""Checkpoints and run directories.

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

Only names of exactly that form (``step_`` and eight digits) are checkpoints;
anything else in ``ckpt/`` (a user's ``step_00000005.bak`` copy, an editor's
file) is left alone, named once on stderr, and never loaded, pruned or parsed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save, save_file

from xmodlm.config import Config, load_config
from xmodlm.errors import UserError
from xmodlm.fileio import atomic_open, atomic_write_json, fsync_dir
from xmodlm.info import check_memory
from xmodlm.model import Transformer

CKPT_DIR = "ckpt"
_CKPT_NAME = re.compile(r"step_(\d{8})")
_noted_strays: set[Path] = set()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: Path, directory: bool = False) -> None:
    """Give ``path`` the mode a plain ``open``/``mkdir`` would (``mkdtemp`` makes 0700 and
    safetensors 0600 files, whatever the umask)."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_umask())


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
        save_file(_untie(weights), str(tmp / "model.safetensors"))
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


def rewrite_model_weights(ckpt: Path, model: torch.nn.Module) -> None:
    """Replace a complete checkpoint's ``model.safetensors`` with ``model``'s weights,
    atomically (a crash leaves the old file or the new one); its training state is
    not touched. For buffers no training step reads, such as calibrated thresholds."""
    weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    path = Path(ckpt) / "model.safetensors"
    try:
        with atomic_open(path) as f:
            f.write(save(_untie(weights)))
        follow_umask(path)
    except OSError as err:
        raise OSError(err.errno, err.strerror or str(err), err.filename or str(path)) from err


def _untie(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses shared storage (tied embeddings): store a copy."""
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


def load_run(
    run_dir: str | Path, device: str = "cpu", step: int | None = None
) -> tuple[Config, Transformer, Path]:
    """The model of a finished or running run: (config, model in eval mode, checkpoint).

    Uses the newest complete checkpoint that loads (or ``step``); a checkpoint that
    fails to load is reported by name and the previous one is tried.
    """
    run = Path(run_dir)
    if not (run / "config.yaml").is_file():
        from xmodlm.export import is_exported

        if is_exported(run):
            raise UserError(
                f"{str(run)!r} is an export (config.json + model.safetensors), not a run"
                " directory: pass the run it was exported from (the --out of xmod train),"
                f" or load the export with xmodlm.load_pretrained({str(run)!r})"
            )
        raise UserError(f"run directory {str(run)!r} not found or has no config.yaml")
    cfg = load_config(run / "config.yaml")
    ckpts = checkpoint_dirs(run)
    if step is not None:
        ckpts = [p for p in ckpts if checkpoint_step(p) == step]
    if not ckpts:
        raise UserError(f"run directory {str(run)!r} has no complete checkpoint yet")
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
    path = Path(run_dir) / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"run directory {str(run_dir)!r} has no tokenizer.json")
    return path
