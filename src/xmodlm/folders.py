"""What a folder on disk holds: a prepared corpus, a training run, a sweep or an
export, told apart by the files their writers leave.

Each writer may write only into a folder of its own kind (to resume or refresh
it) or into one that holds none of them: ``xmod data prepare`` into a run would
replace the tokenizer its checkpoints were trained with, ``xmod train`` into a
sweep would mix a stray run into its table. Readers use the same test to say what
a folder is when it is not what they expect.
"""

from __future__ import annotations

from pathlib import Path

from xmodlm.errors import UserError

SWEEP_FILE = "sweep.json"  # SWEEP/sweep.json: the name of the spec whose runs it holds
SWEEP_RUNS = "runs"  # SWEEP/runs/RUN_ID: one run directory per run of the spec
RUN_FILES = ("ckpt", "metrics.jsonl", "summary.json", "env.json")  # beside a run's config.yaml
KINDS = {"corpus": "a prepared corpus", "run": "a training run", "sweep": "a sweep",
         "export": "an export"}


def folder_kind(path: str | Path) -> str | None:
    """``corpus``, ``run``, ``sweep`` or ``export``; None for a folder that holds none
    of them (or is not a folder)."""
    from xmodlm.data.prepare import MANIFEST_FILE
    from xmodlm.runs import is_exported

    p = Path(path)
    if not p.is_dir():
        return None
    if (p / MANIFEST_FILE).is_file():
        return "corpus"
    if (p / "config.yaml").is_file() and any((p / name).exists() for name in RUN_FILES):
        return "run"
    if (p / SWEEP_FILE).is_file() or (p / SWEEP_RUNS).is_dir():
        return "sweep"
    if is_exported(p):
        return "export"
    return None


def check_writable(path: str | Path, own: str | None, flag: str = "--out") -> None:
    """Refuse to write into ``path`` when it holds another writer's kind of folder
    (``own``: the kind this writer makes, which it may resume; None: none)."""
    kind = folder_kind(path)
    if kind is not None and kind != own:
        mine = f"; it writes {KINDS[own]}" if own else ""
        raise UserError(
            f"{flag} {str(path)!r} holds {KINDS[kind]}, which this command must not write"
            f" into{mine}: give another folder"
        )
