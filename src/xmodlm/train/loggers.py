"""Where training records go: metrics.jsonl, a progress bar, optional trackers.

TensorBoard and Weights & Biases are imported only when switched on, so neither
is a dependency. Only rank 0 logs (``enabled``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from xmodlm.config import Config
from xmodlm.train.checkpoint import atomic_write_text


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
            self.bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr)

    def truncate_after(self, step: int) -> None:
        """On resume, drop records past the checkpoint so no step is logged twice."""
        if not self.enabled or not self.path.is_file():
            return
        kept = []
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # torn by a kill mid-write (the last line), or blank
                continue
            if isinstance(record, dict) and record.get("step", 0) <= step:
                kept.append(line)
        atomic_write_text(self.path, "".join(line + "\n" for line in kept))

    def start(self, total_steps: int, initial: int) -> None:
        if not self.enabled:
            return
        self._file = open(self.path, "a")  # noqa: SIM115 (closed in close())
        if self.show_progress:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_steps, initial=initial, unit="step", dynamic_ncols=True,
                file=sys.stderr, mininterval=1.0,
            )

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for tracker in self.trackers:
            tracker.log(record)
        if self.bar is not None and record.get("kind") == "eval":
            self.bar.write(
                f"step {record['step']}: val loss {record['val_loss_topk']:.4f} (top-k)"
                f" {record['val_loss_causal']:.4f} (causal)"
                + (f", {record['val_bpb']:.4f} bpb" if "val_bpb" in record else ""),
                file=sys.stderr,
            )

    def advance(self, record: dict[str, Any]) -> None:
        if self.bar is None:
            return
        self.bar.update(1)
        self.bar.set_postfix(
            loss=f"{record['loss']:.4f}",
            tok_s=f"{record['tokens_per_s']:.0f}",
            mfu=f"{record['mfu']:.2f}",
            refresh=False,
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
            if isinstance(value, (int, float)) and key != "step":
                self.writer.add_scalar(prefix + key, value, record["step"])

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, run: Path, cfg: Config) -> None:
        import wandb

        self.run = wandb.init(name=cfg.name, dir=str(run), config=cfg.to_dict(), resume="allow")

    def log(self, record: dict[str, Any]) -> None:
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float))}
        self.run.log(scalars, step=record["step"])

    def close(self) -> None:
        self.run.finish()
