"""Training and validation batches from memory-mapped token files.

Batches are a pure function of ``(seed, step)``: a resumed run sees exactly the
batches it would have seen, with no sampler state to checkpoint. Under DDP the
global batch for a step is drawn once and rank ``r`` takes rows
``[r*B, (r+1)*B)``, so the union over ranks equals the one-process batch of
``world_size * B`` rows and a run's data does not depend on how many processes
share it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from xmodlm.data.prepare import FORMAT_VERSION, MANIFEST_FILE, SPLITS, TOKEN_DTYPE, TOKEN_DTYPES
from xmodlm.errors import UserError
from xmodlm.fileio import sha256_file


class TokenData:
    """One split's token ids, memory-mapped read-only (the OS pages them in as needed)."""

    def __init__(
        self, path: str | Path, split: str | None = None, dtype: str | None = None
    ) -> None:
        """``dtype``: the manifest's (uint16, or uint32 for a vocabulary over 65,536)."""
        self.path = Path(path)
        self.split = split or self.path.stem
        try:
            self.tokens = np.memmap(self.path, dtype=dtype or TOKEN_DTYPE, mode="r")
        except (OSError, ValueError) as exc:
            raise UserError(
                f"token file {self.path} is unreadable or empty ({exc}): run `xmod data prepare` again"
            ) from exc

    def __len__(self) -> int:
        return len(self.tokens)

    def check_context(self, context: int) -> None:
        """A window needs ``context + 1`` tokens (inputs plus the shifted targets)."""
        if len(self) < context + 1:
            raise UserError(
                f"split {self.split!r} has {len(self)} tokens, fewer than context + 1 = {context + 1}: "
                "use a shorter context or prepare more data"
            )


def get_batch(
    data: TokenData,
    batch_size: int,
    context: int,
    seed: int,
    step: int,
    rank: int = 0,
    world_size: int = 1,
    micro: int = 0,
    grad_accum: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``batch_size`` random windows of micro-batch ``micro`` of optimiser step ``step``.

    Returns ``(x_BT, y_BT)``, int64 CPU tensors with ``y`` shifted one token ahead.
    The step's global batch (``batch_size x grad_accum x world_size`` windows) is
    drawn from a generator seeded with ``(seed, step)`` only and then split, so it
    does not depend on the rank, on earlier steps, or on how it is divided into
    ranks and accumulation micro-batches.
    """
    assert batch_size > 0 and context > 0 and 0 <= rank < world_size, (
        batch_size,
        context,
        rank,
        world_size,
    )
    assert 0 <= micro < grad_accum, (micro, grad_accum)
    data.check_context(context)
    rng = np.random.default_rng((seed, step))
    starts = rng.integers(0, len(data) - context, size=batch_size * grad_accum * world_size)
    first = (micro * world_size + rank) * batch_size
    return _windows(data, starts[first : first + batch_size], context)


def val_batches(
    data: TokenData, n_batches: int, batch_size: int, context: int, seed: int = 1234
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed list of ``n_batches`` validation batches, the same on every call.

    Stratified: the range of window starts is cut into ``n_batches * batch_size``
    equal strata and one start is drawn in each, so the windows cover the whole
    split evenly (lower variance than independent draws) yet are not aligned to
    any period of the text.
    """
    assert n_batches > 0 and batch_size > 0 and context > 0, (n_batches, batch_size, context)
    data.check_context(context)
    count = n_batches * batch_size
    span = len(data) - context
    if count > span:  # more windows than starts: the same text scored over and over
        raise UserError(
            f"{n_batches} validation batches of {batch_size} windows: the split has only {span}"
            f" window starts of context {context}, room for at most {max(span // batch_size, 0)}"
            " batches; lower data.val_batches (or train.batch_size)"
        )
    offsets = np.random.default_rng(seed).random(count)
    starts = np.minimum(((np.arange(count) + offsets) * span / count).astype(np.int64), span - 1)
    return [
        _windows(data, starts[i * batch_size : (i + 1) * batch_size], context)
        for i in range(n_batches)
    ]


def _windows(
    data: TokenData, starts: np.ndarray, context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    block = data.tokens[starts[:, None] + np.arange(context + 1)].astype(np.int64)
    return torch.from_numpy(block[:, :-1].copy()), torch.from_numpy(block[:, 1:].copy())


def load_manifest(data_dir: str | Path) -> dict[str, Any]:
    """The manifest of a prepared data directory; a clear error if there is none."""
    data_dir = Path(data_dir)
    hint = f"run `xmod data prepare --out {data_dir}`"
    if not data_dir.is_dir():
        raise UserError(f"data directory {data_dir} not found: {hint}")
    path = data_dir / MANIFEST_FILE
    if not path.is_file():
        raise UserError(
            f"data directory {data_dir} has no {MANIFEST_FILE} (not prepared, or interrupted): {hint}"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:
        raise UserError(f"{path} is unreadable ({exc}): {hint}") from exc
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{path} is not a format-{FORMAT_VERSION} manifest: {hint}")
    if not isinstance(manifest.get("vocab_size"), int) or not isinstance(manifest.get("splits"), dict):
        raise UserError(f"{path} lacks vocab_size or splits: {hint}")
    if manifest.get("dtype", "uint16") not in TOKEN_DTYPES:
        raise UserError(
            f"{path} has token dtype {manifest.get('dtype')!r}, not one of"
            f" {', '.join(TOKEN_DTYPES)}: {hint}"
        )
    return manifest


def load_split(data_dir: str | Path, split: str) -> TokenData:
    """Memory-map one split after checking its length against the manifest.

    The length check is cheap and catches truncated files; token ids are checked
    against the manifest's vocabulary (one pass, a few milliseconds for 10M tokens),
    so a corrupt file is named here rather than failing deep in the model. The full
    checksum is ``prepare``'s job.
    """
    manifest = load_manifest(data_dir)
    entry = _split_entry(manifest, split)
    data = TokenData(Path(data_dir) / entry["file"], split, manifest.get("dtype", "uint16"))
    if len(data) != entry["tokens"]:
        raise UserError(
            f"{data.path} holds {len(data)} tokens but {MANIFEST_FILE} says {entry['tokens']}: "
            f"run `xmod data prepare --out {data_dir}` to rebuild it"
        )
    vocab = manifest.get("vocab_size")
    if len(data) and isinstance(vocab, int):  # once per open: ids index the embedding
        top = int(data.tokens.max())
        if top >= vocab:
            raise UserError(
                f"{data.path} holds token id {top}, outside the vocabulary of {vocab} in"
                f" {MANIFEST_FILE}: the file is corrupt, run `xmod data prepare --out {data_dir}`"
            )
    return data


def check_tokenizer(tokenizer_file: str | Path, manifest: dict[str, Any], data_dir: str | Path) -> None:
    """The data directory was tokenized with ``tokenizer_file`` (a run's copy of its
    tokenizer): the same ids mean the same tokens. Else one clear error, saying how to
    prepare the data with that tokenizer."""
    expected = (manifest.get("tokenizer") or {}).get("sha256")
    if not expected or not Path(tokenizer_file).is_file():
        return
    if sha256_file(tokenizer_file) != expected:
        raise UserError(
            f"data directory {data_dir} was tokenized with another tokenizer than"
            f" {tokenizer_file} (a different vocabulary: the token ids would mean other"
            " tokens): use the data the run was trained on, or prepare this text with the"
            f" run's tokenizer: xmod data prepare --tokenizer {tokenizer_file} ..."
        )


def bytes_per_token(manifest: dict[str, Any], split: str) -> float:
    """UTF-8 bytes of document text per token (separators included) in ``split``."""
    entry = _split_entry(manifest, split)
    return entry["bytes"] / entry["tokens"]


def bits_per_byte(loss_nats: float, manifest: dict[str, Any], split: str) -> float:
    """Mean per-token cross-entropy (nats) as bits per UTF-8 byte: comparable across vocabularies."""
    return loss_nats / math.log(2) / bytes_per_token(manifest, split)


def _split_entry(manifest: dict[str, Any], split: str) -> dict[str, Any]:
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r}: choose one of {', '.join(SPLITS)}")
    entry = (manifest.get("splits") or {}).get(split)
    if not isinstance(entry, dict) or not {"file", "tokens", "bytes"} <= set(entry):
        raise UserError(
            f"{MANIFEST_FILE} has no complete entry for split {split!r}: run `xmod data prepare`"
        )
    return entry
