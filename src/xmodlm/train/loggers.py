"""Where training records go: metrics.jsonl, progress, optional trackers.

Progress is :class:`xmodlm.progress.Progress` (the helper every command uses): a
tqdm bar when stderr is a terminal, else one plain line every
:data:`~xmodlm.progress.PLAIN_EVERY_S` seconds (and at the last step), so logs of
batch jobs stay readable. TensorBoard and Weights & Biases are imported only when switched on, so
neither is a dependency; a missing package is one clear error before any work
(:func:`check_trackers`). Only rank 0 logs (``enabled``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from xmodlm.config import Config
from xmodlm.errors import UserError
from xmodlm.fileio import atomic_write_text
from xmodlm.progress import Progress

WANDB_ID_FILE = "wandb_run_id"


def check_trackers(cfg: Config) -> None:
    """The packages of the trackers switched on are installed (else a UserError)."""
    wanted = [("tensorboard", "tensorboard", cfg.train.tensorboard),
              ("wandb", "wandb", cfg.train.wandb)]
    for key, module, on in wanted:
        if on and importlib.util.find_spec(module) is None:
            raise UserError(
                f"train.{key}=true needs the {module} package, which is not installed:"
                f" pip install {module} (or 'xmod-lm[tracking]'), or set train.{key}=false"
            )


class MetricLogger:
    def __init__(self, run: Path, cfg: Config, enabled: bool = True, progress: bool = True):
        self.path = run / "metrics.jsonl"
        self.enabled = enabled
        self.show_progress = progress and enabled
        self.bar: Any = None
        self.trackers: list[Any] = []
        if enabled and cfg.train.tensorboard:
            self.trackers.append(_TensorBoard(run))
        if enabled and cfg.train.wandb:
            self.trackers.append(_WandB(run, cfg))
        self._file: Any = None

    def note(self, message: str) -> None:
        """A one-line message for the person watching (stderr, above the bar)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.note(message)
        else:
            print(message, file=sys.stderr, flush=True)

    def truncate_after(self, step: int) -> None:
        """On resume, drop records past the checkpoint so no step is logged twice; at
        step 0 (no checkpoint) drop them all, the evaluation at initialisation too."""
        if not self.enabled or not self.path.is_file():
            return
        kept = []
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # torn by a kill mid-write (the last line), or blank
                continue
            if isinstance(record, dict) and step > 0 and record.get("step", 0) <= step:
                kept.append(line)
        atomic_write_text(self.path, "".join(line + "\n" for line in kept))

    def start(self, total_steps: int, initial: int) -> None:
        if not self.enabled:
            return
        self._file = open(self.path, "a")  # noqa: SIM115 (closed in close())
        self.total_steps = total_steps
        if self.show_progress:
            self.bar = Progress(total_steps, "train", unit="step", initial=initial, enabled=True)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for tracker in self.trackers:
            tracker.log(record)
        if self.show_progress and record.get("kind") == "eval":
            self.note(
                f"step {record['step']}: val loss {record['val_loss_topk']:.4f} (top-k)"
                f" {record['val_loss_causal']:.4f} (causal)"
                + (f", {record['val_bpb']:.4f} bpb" if "val_bpb" in record else "")
            )

    def advance(self, record: dict[str, Any]) -> None:
        """One optimiser step done: the bar, or a plain line now and then when piped."""
        if self.bar is None:
            return
        self.bar.update(
            1, loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
            mfu=f"{record['mfu']:.2f}",
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self._file is not None:
            self._file.close()
        for tracker in self.trackers:
            tracker.close()


class _TensorBoard:
    def __init__(self, run: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run / "tb"))

    def log(self, record: dict[str, Any]) -> None:
        prefix = "eval/" if record.get("kind") == "eval" else "train/"
        for key, value in record.items():
            if key == "step" or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                self.writer.add_scalar(prefix + key, value, record["step"])
            elif isinstance(value, list):  # per layer (or per bin): one scalar each
                for i, item in enumerate(value):
                    if isinstance(item, (int, float)) and not isinstance(item, bool):
                        self.writer.add_scalar(f"{prefix}{key}/{i}", item, record["step"])

    def close(self) -> None:
        self.writer.close()


class _WandB:
    """One W&B run per run directory: its id is kept in ``RUN_DIR/wandb_run_id``, so a
    resumed training continues the same W&B run instead of starting another."""

    def __init__(self, run: Path, cfg: Config) -> None:
        import wandb

        t = cfg.train
        id_file = run / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else ""
        if not run_id:
            run_id = wandb.util.generate_id()
            atomic_write_text(id_file, run_id + "\n")
        tags = [tag.strip() for tag in t.wandb_tags.split(",") if tag.strip()]
        self.run = wandb.init(
            id=run_id, resume="allow", name=cfg.name, dir=str(run), config=cfg.to_dict(),
            project=t.wandb_project or None, entity=t.wandb_entity or None, tags=tags or None,
        )

    def log(self, record: dict[str, Any]) -> None:
        scalars: dict[str, Any] = {}
        for key, value in record.items():
            if isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                scalars[key] = value
            elif isinstance(value, list):
                for i, item in enumerate(value):
                    if isinstance(item, (int, float)) and not isinstance(item, bool):
                        scalars[f"{key}/{i}"] = item
        self.run.log(scalars, step=record["step"])

    def close(self) -> None:
        self.run.finish()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of a run's metrics.jsonl (train and eval); a torn line (the writer
    was killed mid-write) is skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict):
                records.append(record)
    return records
