"""Byte-level BPE tokenizer: trained on the train split, saved as ``tokenizer.json``.

Byte-level means every UTF-8 byte is in the base alphabet, so any text encodes
without an unknown token and decodes back to itself. One special token,
``<|endoftext|>``, separates documents in the token files and can start a
generation.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from xmodlm.errors import UserError

EOT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
MIN_VOCAB_SIZE = 257
"""256 byte tokens plus ``<|endoftext|>``: the smallest vocabulary that encodes anything."""


class Tokenizer:
    """A thin wrapper over a Hugging Face tokenizer: the few calls the rest of xmod-lm needs."""

    def __init__(self, hf: HFTokenizer) -> None:
        eot_id = hf.token_to_id(EOT)
        assert eot_id is not None, f"tokenizer has no {EOT} token"
        self.hf = hf
        self.eot_id: int = eot_id
        self.vocab_size: int = hf.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many texts at once; the Rust side spreads them over the CPU cores."""
        return [encoding.ids for encoding in self.hf.encode_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; ``<|endoftext|>`` is kept so document boundaries stay visible."""
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def to_str(self) -> str:
        """The ``tokenizer.json`` contents (pretty-printed, so diffs of two vocabularies read)."""
        return self.hf.to_str(pretty=True)

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json``, or the one inside a prepared data directory."""
        path = Path(path)
        if path.is_dir():
            path = path / TOKENIZER_FILE
        if not path.is_file():
            raise UserError(f"tokenizer {path} not found: run `xmod data prepare` to build it")
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as exc:  # the Rust side raises a bare Exception on a bad file
            raise UserError(
                f"tokenizer {path} is unreadable ({exc}): run `xmod data prepare` again"
            ) from exc


def load_user_tokenizer(path: str | Path) -> Tokenizer:
    """A user's own ``tokenizer.json`` (any Hugging Face ``tokenizers`` model) instead of
    training one. Without ``<|endoftext|>`` it is added as a special token, with the next
    free id, since the token files separate documents with it."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--tokenizer {path} not found: pass a Hugging Face tokenizer.json file")
    try:
        hf = HFTokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises a bare Exception on a bad file
        raise UserError(
            f"--tokenizer {path} is not a Hugging Face tokenizer.json ({exc})"
        ) from exc
    if hf.token_to_id(EOT) is None:
        hf.add_special_tokens([EOT])
    return Tokenizer(hf)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with ``vocab_size`` entries (``<|endoftext|>`` is id 0).

    A small corpus may stop short of ``vocab_size`` (no pair left to merge); the
    wrapper's ``vocab_size`` is then the real, smaller size.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise UserError(f"vocab size {vocab_size} is too small: use at least {MIN_VOCAB_SIZE}")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(hf)
