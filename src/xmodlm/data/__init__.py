"""Data: the corpus, its byte-level BPE tokenizer, and memory-mapped batches.

``prepare`` builds a data directory once (``xmod data prepare``); training and
evaluation read it with ``load_manifest``, ``load_split``, ``get_batch`` and
``val_batches``, and decode with ``Tokenizer.load(data_dir)``.
"""

from xmodlm.data.batches import (
    TokenData,
    bits_per_byte,
    bytes_per_token,
    get_batch,
    load_manifest,
    load_split,
    val_batches,
)
from xmodlm.data.corpus import Document, clean_brown, strip_gutenberg
from xmodlm.data.prepare import MANIFEST_FILE, SPLITS, prepare, split_documents
from xmodlm.data.tokenizer import EOT, Tokenizer, train_tokenizer

__all__ = [
    "EOT",
    "MANIFEST_FILE",
    "SPLITS",
    "Document",
    "TokenData",
    "Tokenizer",
    "bits_per_byte",
    "bytes_per_token",
    "clean_brown",
    "get_batch",
    "load_manifest",
    "load_split",
    "prepare",
    "split_documents",
    "strip_gutenberg",
    "train_tokenizer",
    "val_batches",
]
