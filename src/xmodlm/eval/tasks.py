"""Downstream tasks built offline and deterministically from held-out documents.

* ``cloze``: a held-out sentence's true final word against 3 distractor words of
  similar corpus frequency (neighbours in the frequency ranking of the split's
  words); each full candidate sentence is scored by its total log-likelihood under
  the model with causal routing; chance 1/4.
* ``minimal_pairs``: a held-out sentence against a corrupted copy (two adjacent
  words swapped, an agreement flip is/are was/were has/have, or a wrong article
  a/an); the model is right when the original scores higher; chance 1/2.

Items are a pure function of (documents, seed, max_items) and are saved as JSONL
(``items_dir/cloze.jsonl``, ``items_dir/minimal_pairs.jsonl``) next to a small
``.meta.json``; saved items are reloaded when the meta matches.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from xmodlm.data.tokenizer import Tokenizer
from xmodlm.errors import UserError
from xmodlm.eval.scoring import rolling_logprob
from xmodlm.fileio import atomic_open
from xmodlm.model import Transformer

TASKS = ("cloze", "minimal_pairs")
CHANCE = {"cloze": 0.25, "minimal_pairs": 0.5}
ITEMS_VERSION = 1
MIN_WORDS, MAX_WORDS = 4, 40
N_DISTRACTORS = 3
FREQ_WINDOW = 10  # distractors come from +-FREQ_WINDOW frequency ranks of the answer

_SENT_RE = re.compile(r"(?<=[.!?])\s+")
_WORD_RE = re.compile(r"[A-Za-z]+")
_FINAL_RE = re.compile(r"^(.*\s)([A-Za-z]+)([.!?]+[\"')\]]*)$", re.S)
AGREEMENT = {"is": "are", "are": "is", "was": "were", "were": "was", "has": "have", "have": "has"}
_VOWELS = set("aeiouAEIOU")


def check_tasks(tasks: Sequence[str]) -> list[str]:
    """The task names, validated (a UserError names the unknown one)."""
    names = [tasks] if isinstance(tasks, str) else list(tasks)
    for name in names:
        if name not in TASKS:
            raise UserError(f"unknown task {name!r}: choose from {', '.join(TASKS)}")
    return names


def load_documents(data_dir: str | Path, split: str = "test") -> list[str]:
    """The raw held-out documents of ``split`` (``{split}_docs.jsonl``)."""
    path = Path(data_dir) / f"{split}_docs.jsonl"
    if not path.is_file():
        raise UserError(f"{path} not found: run `xmod data prepare` again to write held-out documents")
    docs = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            docs.append(str(json.loads(line)["text"]))
    return docs


def sentences(docs: Sequence[str]) -> list[str]:
    """Sentences of MIN_WORDS..MAX_WORDS words, whitespace-normalised, in document order."""
    out = []
    for doc in docs:
        for sent in _SENT_RE.split(" ".join(doc.split())):
            n = len(_WORD_RE.findall(sent))
            if MIN_WORDS <= n <= MAX_WORDS:
                out.append(sent)
    return out


# ---------------------------------------------------------------- corruptions


def swap_adjacent(sentence: str, rng: random.Random) -> str | None:
    """Swap two adjacent different words (punctuation stays in place); None if impossible."""
    words = sentence.split(" ")
    spots = [
        i for i in range(len(words) - 1)
        if words[i].isalpha() and words[i + 1].isalpha() and words[i].lower() != words[i + 1].lower()
    ]
    if not spots:
        return None
    i = rng.choice(spots)
    a, b = words[i], words[i + 1]
    if i == 0 and a[:1].isupper():  # keep the sentence-initial capital on the first word
        a, b = a[:1].lower() + a[1:], b[:1].upper() + b[1:]
    words[i], words[i + 1] = b, a
    return " ".join(words)


def _match_case(src: str, word: str) -> str:
    return word.capitalize() if src[:1].isupper() else word


def flip_agreement(sentence: str, rng: random.Random | None = None) -> str | None:
    """Flip one number-agreement verb (is/are, was/were, has/have); None if there is none."""
    hits = [m for m in re.finditer(r"\b[A-Za-z]+\b", sentence) if m.group().lower() in AGREEMENT]
    if not hits:
        return None
    m = hits[0] if rng is None else rng.choice(hits)
    new = _match_case(m.group(), AGREEMENT[m.group().lower()])
    return sentence[: m.start()] + new + sentence[m.end():]


def wrong_determiner(sentence: str, rng: random.Random | None = None) -> str | None:
    """Use the wrong indefinite article (a <-> an) before a word; None if there is none."""
    hits = [
        m for m in re.finditer(r"\b(a|an|A|An)\s+([A-Za-z])", sentence)
        # "a apple" is already wrong: leave it
        if not (m.group(1).lower() == "a" and m.group(2) in _VOWELS)
    ]
    if not hits:
        return None
    m = hits[0] if rng is None else rng.choice(hits)
    art = m.group(1)
    new = "a" if art.lower() == "an" else "an"
    return sentence[: m.start(1)] + _match_case(art, new) + sentence[m.end(1):]


CORRUPTIONS: dict[str, Callable[[str, random.Random], str | None]] = {
    "swap": swap_adjacent,
    "agreement": flip_agreement,
    "determiner": wrong_determiner,
}


# ---------------------------------------------------------------- item builders


def build_cloze(docs: Sequence[str], seed: int = 0, max_items: int = 200) -> list[dict[str, Any]]:
    """Last-word cloze items: {id, prefix, candidates (full sentences), answer, word}."""
    counts = Counter(w.lower() for d in docs for w in _WORD_RE.findall(d))
    ranked = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    rank = {w: i for i, w in enumerate(ranked)}
    rng = random.Random(seed)
    pool = sentences(docs)
    rng.shuffle(pool)
    items: list[dict[str, Any]] = []
    for sent in pool:
        m = _FINAL_RE.match(sent)
        if m is None:
            continue
        prefix, word, tail = m.groups()
        r = rank[word.lower()]
        near = [w for w in ranked[max(0, r - FREQ_WINDOW): r + FREQ_WINDOW + 1] if w != word.lower()]
        if len(near) < N_DISTRACTORS:
            continue
        options = [word, *(_match_case(word, w) for w in rng.sample(near, N_DISTRACTORS))]
        order = list(range(len(options)))
        rng.shuffle(order)
        items.append({
            "id": len(items),
            "prefix": prefix,
            "word": word,
            "candidates": [prefix + options[i] + tail for i in order],
            "answer": order.index(0),
        })
        if len(items) >= max_items:
            break
    return items


def build_minimal_pairs(
    docs: Sequence[str], seed: int = 0, max_items: int = 200
) -> list[dict[str, Any]]:
    """Minimal pairs: {id, good, bad, kind}; the kind is drawn among the corruptions that apply."""
    rng = random.Random(seed + 1)
    pool = sentences(docs)
    rng.shuffle(pool)
    items: list[dict[str, Any]] = []
    for sent in pool:
        options = {}
        for kind, fn in CORRUPTIONS.items():
            bad = fn(sent, rng)
            if bad is not None and bad != sent:
                options[kind] = bad
        if not options:
            continue
        # prefer the grammatical corruptions when they apply: swaps are the fallback
        kinds = [k for k in options if k != "swap"] or ["swap"]
        kind = rng.choice(sorted(kinds))
        items.append({"id": len(items), "good": sent, "bad": options[kind], "kind": kind})
        if len(items) >= max_items:
            break
    return items


BUILDERS = {"cloze": build_cloze, "minimal_pairs": build_minimal_pairs}


def load_or_build_items(
    task: str,
    data_dir: str | Path,
    items_dir: str | Path,
    split: str = "test",
    seed: int = 0,
    max_items: int = 200,
) -> list[dict[str, Any]]:
    """The items of ``task``, reloaded from ``items_dir`` when built with the same settings."""
    check_tasks([task])
    items_dir = Path(items_dir)
    path, meta_path = items_dir / f"{task}.jsonl", items_dir / f"{task}.meta.json"
    meta = {"version": ITEMS_VERSION, "split": split, "seed": seed, "max_items": max_items,
            "data_dir": str(Path(data_dir).resolve())}
    if path.is_file() and meta_path.is_file():
        try:
            if json.loads(meta_path.read_text()) == meta:
                return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x]
        except ValueError:
            pass  # unreadable cache: rebuild it
    items = BUILDERS[task](load_documents(data_dir, split), seed=seed, max_items=max_items)
    if not items:
        raise UserError(
            f"split {split!r} of {data_dir} has no sentences usable for task {task!r}:"
            " prepare more held-out data"
        )
    items_dir.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write("".join(json.dumps(it) + "\n" for it in items))
    with atomic_open(meta_path, "w") as f:  # written last: it marks the items complete
        f.write(json.dumps(meta, indent=2) + "\n")
    return items


# ---------------------------------------------------------------- scoring


def sequence_logprobs(
    model: Transformer,
    tok: Tokenizer,
    texts: Sequence[str],
    device: str | torch.device = "cpu",
    batch_size: int = 16,
    desc: str | None = None,
) -> list[float]:
    """Total log-likelihood (nats) of each text after ``<|endoftext|>``, causal routing.

    Any length: texts longer than the context are scored in windows
    (:func:`xmodlm.eval.scoring.score_continuations`).
    """
    return rolling_logprob(
        model, tok.encode_batch(list(texts)), tok.eot_id, device, batch_size, desc=desc
    )


def wilson_interval(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of an accuracy: honest at small n and near 0 or 1."""
    if n == 0:
        return (0.0, 1.0)
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def score_task(
    task: str,
    items: Sequence[dict[str, Any]],
    model: Transformer,
    tok: Tokenizer,
    device: str | torch.device = "cpu",
) -> dict[str, Any]:
    """{accuracy, items, chance} of ``model`` on ``items``."""
    check_tasks([task])
    if task == "cloze":
        texts = [c for it in items for c in it["candidates"]]
        scores = sequence_logprobs(model, tok, texts, device, desc=f"eval task {task}")
        correct, pos, chance = 0, 0, 0.0
        for it in items:
            n = len(it["candidates"])
            s = scores[pos: pos + n]
            pos += n
            correct += int(max(range(n), key=lambda j: s[j]) == it["answer"])
            chance += 1.0 / n
        return {"accuracy": correct / len(items), "ci95": wilson_interval(correct, len(items)),
                "items": len(items), "chance": chance / len(items)}
    texts = [t for it in items for t in (it["good"], it["bad"])]
    scores = sequence_logprobs(model, tok, texts, device, desc=f"eval task {task}")
    correct = sum(int(scores[2 * i] > scores[2 * i + 1]) for i in range(len(items)))
    by_kind: dict[str, list[int]] = {}
    for i, it in enumerate(items):
        by_kind.setdefault(it["kind"], []).append(int(scores[2 * i] > scores[2 * i + 1]))
    return {
        "accuracy": correct / len(items),
        "ci95": wilson_interval(correct, len(items)),
        "items": len(items),
        "chance": CHANCE[task],
        "by_kind": {k: {"accuracy": sum(v) / len(v), "items": len(v)} for k, v in sorted(by_kind.items())},
    }
