"""EleutherAI lm-evaluation-harness adapter: any xmod-lm run as an ``lm_eval`` model.

Importing this module registers the model class under the name ``xmod`` (needs
the optional extra: ``pip install 'xmod-lm[eval]'``). From Python::

    import lm_eval, xmodlm.eval.harness
    lm_eval.simple_evaluate(model="xmod", model_args="run_dir=runs/demo/xmod-tiny",
                            tasks=["hellaswag"])

or from the shell, ``xmod lm-eval RUN_DIR --tasks hellaswag,lambada_openai``.
Standard tasks download their data from the Hugging Face hub; the offline tasks
``xmod_cloze``, ``xmod_minimal_pairs``, ``xmod_cloze_gen`` and ``xmod_heldout``
(:func:`write_local_tasks`) read this project's own held-out JSONL items, so a
machine without a network can run the harness end to end.

Conventions, chosen to match how the models were trained and how
:mod:`xmodlm.eval.tasks` scores them:

* documents were separated by ``<|endoftext|>`` in training, so every text is
  conditioned on it (it plays the role of a BOS token; ``tok_encode`` prepends it
  unless ``add_special_tokens=False``);
* routing is causal (deployment routing; see :mod:`xmodlm.eval.scoring`);
* ``loglikelihood`` and ``loglikelihood_rolling`` are exact for any length: long
  inputs are scored in context-sized windows, each token predicted once;
* ``generate_until`` keeps at least half the context for the prompt (the last
  ``context - min(max_gen_toks, context // 2)`` tokens), decodes greedily unless
  ``do_sample`` is set, and stops at the first stop string.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "the lm-evaluation-harness adapter needs lm-eval: pip install 'xmod-lm[eval]'"
    ) from err

from xmodlm.data.tokenizer import Tokenizer
from xmodlm.errors import UserError
from xmodlm.eval import tasks as task_mod
from xmodlm.eval.scoring import score_continuations
from xmodlm.fileio import atomic_open, cache_dir
from xmodlm.model.generate import generate
from xmodlm.progress import Progress
from xmodlm.runs import load_run, tokenizer_path

LOCAL_TASKS = ("xmod_cloze", "xmod_minimal_pairs", "xmod_cloze_gen", "xmod_heldout")
GEN_STOPS = [".", ",", ";", ":", "!", "?", "\n"]


@register_model("xmod", "xmod-lm")
class XModLM(TemplateLM):
    """A trained xmod-lm run (newest loadable checkpoint, or ``step``) for the harness.

    ``run_dir`` (alias ``pretrained``): the run directory; ``batch_size``: windows
    per forward pass (``auto`` means 16); ``dtype``: fp32 (default) or bf16/fp16
    autocast; ``seed``: seed of sampled generation.
    """

    backend = "causal"

    def __init__(
        self,
        run_dir: str | None = None,
        pretrained: str | None = None,
        device: str | None = "cpu",
        batch_size: int | str | None = 16,
        max_batch_size: int | None = None,
        step: int | str | None = None,
        dtype: str = "fp32",
        seed: int | str = 0,
    ) -> None:
        super().__init__()
        path = run_dir or pretrained
        if not path:
            raise UserError("the xmod model needs run_dir=RUN_DIR (or pretrained=RUN_DIR)")
        if not Path(path).is_dir():
            raise UserError(f"run directory {str(path)!r} not found")
        self._device = device or "cpu"
        self.cfg, self.model, self.checkpoint = load_run(
            path, device=self._device, step=None if step is None else int(step)
        )
        self.tok = Tokenizer.load(tokenizer_path(path))
        if self.tok.vocab_size > self.cfg.model.vocab_size:
            raise UserError(
                f"tokenizer of {path} has {self.tok.vocab_size} tokens but the model only"
                f" {self.cfg.model.vocab_size}: they do not belong together"
            )
        if batch_size in (None, "auto") or str(batch_size).startswith("auto"):
            batch_size = 16
        self.batch_size = int(batch_size)
        if max_batch_size is not None:
            self.batch_size = min(self.batch_size, int(max_batch_size))
        if self.batch_size < 1:
            raise UserError(f"batch_size must be at least 1, got {batch_size}")
        self.dtype = dtype
        self.seed = int(seed)
        self.run_dir = str(path)

    # ------------------------------------------------------------------ tokens

    @property
    def eot_token_id(self) -> int:
        return self.tok.eot_id

    @property
    def max_length(self) -> int:
        return self.cfg.model.context

    @property
    def tokenizer_name(self) -> str:
        return f"xmod-bpe-{self.tok.vocab_size}"

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        ids = self.tok.encode(string)
        return ids if add_special_tokens is False else [self.tok.eot_id, *ids]

    def tok_decode(self, tokens: Sequence[int], **kwargs: Any) -> str:
        return self.tok.decode(list(tokens))

    # ------------------------------------------------------------------ scoring

    def _score(
        self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], desc: str | None = None
    ) -> list[tuple[float, bool]]:
        return score_continuations(
            self.model, pairs, self._device, self.batch_size, self.dtype, desc=desc
        )

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str], list[int], list[int]]],
        disable_tqdm: bool = False,
        **kwargs: Any,
    ) -> list[tuple[float, bool]]:
        results = self._score(
            [(ctx, cont) for _, ctx, cont in requests],
            desc=None if disable_tqdm else "lm-eval loglikelihood",
        )
        for (key, _, _), res in zip(requests, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", key, res)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        texts = [req.args[0] for req in requests]
        results = self._score(
            [([self.tok.eot_id], self.tok.encode(text)) for text in texts],
            desc=None if disable_tqdm else "lm-eval rolling loglikelihood",
        )
        out = [lp for lp, _ in results]
        for text, lp in zip(texts, out, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), lp)
        return out

    # ------------------------------------------------------------------ generation

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        bar = Progress(len(requests), "lm-eval generate", unit="request",
                       enabled=False if disable_tqdm else None)
        for idx in groups.values():
            kwargs = dict(requests[idx[0]].args[1])
            for start in range(0, len(idx), self.batch_size):
                batch = idx[start: start + self.batch_size]
                texts = self._generate([requests[i].args[0] for i in batch], kwargs)
                for i, text in zip(batch, texts, strict=True):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(batch))
        bar.close()
        return [t if t is not None else "" for t in out]

    def _generate(self, contexts: Sequence[str], kwargs: dict[str, Any]) -> list[str]:
        until = kwargs.pop("until", None) or [self.tok.decode([self.tok.eot_id])]
        stops = [until] if isinstance(until, str) else list(until)
        max_new = int(kwargs.pop("max_gen_toks", kwargs.pop("max_new_tokens", 256)))
        do_sample = bool(kwargs.pop("do_sample", False))
        temperature = float(kwargs.pop("temperature", 1.0 if do_sample else 0.0))
        if not do_sample:
            temperature = 0.0
        top_k = kwargs.pop("top_k", None)
        top_p = kwargs.pop("top_p", None)
        context = self.cfg.model.context
        keep = context - min(max_new, context // 2)
        prompts = [self.tok_encode(c)[-keep:] for c in contexts]

        def hit_stop(row: int, new: list[int]) -> bool:
            text = self.tok.decode(new)
            return any(s in text for s in stops)

        new_tokens = generate(
            self.model,
            prompts,
            max_new,
            temperature=temperature,
            top_k=None if top_k is None else int(top_k),
            top_p=None if top_p is None else float(top_p),
            seed=self.seed,
            eot_id=self.tok.eot_id,
            vocab_limit=self.tok.vocab_size,
            stop=hit_stop,
        )
        texts = []
        for toks in new_tokens:
            if toks and toks[-1] == self.tok.eot_id:
                toks = toks[:-1]
            text = self.tok.decode(toks)
            cut = min((text.find(s) for s in stops if s in text), default=len(text))
            texts.append(text[:cut])
        return texts


# ---------------------------------------------------------------------- local tasks


def _write(path: Path, text: str) -> None:
    with atomic_open(path, "w") as f:
        f.write(text)


def _task_yaml(name: str, data_file: Path, body: str) -> str:
    return (
        f"task: {name}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        f"    test: {json.dumps(str(data_file))}\n"
        "test_split: test\n"
        f"{body}"
        "metadata:\n"
        "  version: 1.0\n"
    )


_MC_BODY = (
    "output_type: multiple_choice\n"
    "doc_to_text: context\n"
    "doc_to_choice: choices\n"
    "doc_to_target: gold\n"
    'target_delimiter: ""\n'
    "metric_list:\n"
    "  - metric: acc\n"
    "    aggregation: mean\n"
    "    higher_is_better: true\n"
)

_ROLLING_BODY = (
    "output_type: loglikelihood_rolling\n"
    'doc_to_text: ""\n'
    "doc_to_target: text\n"
    "metric_list:\n"
) + "".join(
    f"  - metric: {metric}\n    aggregation: {agg}\n    higher_is_better: false\n"
    for metric, agg in (
        ("word_perplexity", "weighted_perplexity"),
        ("byte_perplexity", "weighted_perplexity"),
        ("bits_per_byte", "bits_per_byte"),
    )
)


def write_local_tasks(
    data_dir: str | Path,
    out_dir: str | Path,
    split: str = "test",
    seed: int = 0,
    max_items: int = 200,
) -> Path:
    """Write harness task YAMLs + JSONL data built from ``split`` of ``data_dir``; returns ``out_dir``.

    * ``xmod_cloze`` (multiple choice, acc; chance 1/4): context = the sentence up to
      its last word, choices = that word or one of 3 words of similar frequency;
    * ``xmod_minimal_pairs`` (multiple choice, acc; chance 1/2): empty context,
      choices = [held-out sentence, corrupted copy];
    * ``xmod_cloze_gen`` (generate_until, exact match of the generated last word);
    * ``xmod_heldout`` (loglikelihood_rolling: word/byte perplexity, bits per byte)
      over the split's whole documents.

    The items are those of :mod:`xmodlm.eval.tasks` (same seed, same JSONL under
    ``out_dir/items``), so the harness's accuracies are comparable with
    ``xmod eval``'s.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    items_dir = out / "items"
    cloze = task_mod.load_or_build_items("cloze", data_dir, items_dir, split, seed, max_items)
    pairs = task_mod.load_or_build_items("minimal_pairs", data_dir, items_dir, split, seed, max_items)
    docs = task_mod.load_documents(data_dir, split)

    rows = {
        "cloze": [
            {"context": it["prefix"], "choices": [c[len(it["prefix"]):] for c in it["candidates"]],
             "gold": it["answer"], "word": it["word"]}
            for it in cloze
        ],
        "minimal_pairs": [
            {"context": "", "choices": [it["good"], it["bad"]], "gold": 0, "kind": it["kind"]}
            for it in pairs
        ],
        "heldout": [{"text": d} for d in docs],
    }
    rows["cloze_gen"] = [{"prompt": r["context"].rstrip(), "word": r["word"]} for r in rows["cloze"]]
    files = {}
    for key, data in rows.items():
        files[key] = out / f"{key}.jsonl"
        _write(files[key], "".join(json.dumps(r) + "\n" for r in data))

    _write(out / "xmod_cloze.yaml", _task_yaml("xmod_cloze", files["cloze"], _MC_BODY))
    _write(out / "xmod_minimal_pairs.yaml",
           _task_yaml("xmod_minimal_pairs", files["minimal_pairs"], _MC_BODY))
    _write(out / "xmod_heldout.yaml", _task_yaml("xmod_heldout", files["heldout"], _ROLLING_BODY))
    _write(out / "xmod_cloze_gen.yaml", _task_yaml("xmod_cloze_gen", files["cloze_gen"], (
        "output_type: generate_until\n"
        "doc_to_text: prompt\n"
        "doc_to_target: word\n"
        'target_delimiter: " "\n'
        "generation_kwargs:\n"
        f"  until: {json.dumps(GEN_STOPS)}\n"
        "  max_gen_toks: 8\n"
        "  do_sample: false\n"
        "filter_list:\n"
        "  - name: strip\n"
        "    filter:\n"
        "      - function: remove_whitespace\n"
        "      - function: take_first\n"
        "metric_list:\n"
        "  - metric: exact_match\n"
        "    aggregation: mean\n"
        "    higher_is_better: true\n"
        "    ignore_case: true\n"
    )))
    return out


def run_harness(
    run_dir: str | Path,
    tasks: Sequence[str],
    num_fewshot: int | None = None,
    limit: float | None = None,
    batch_size: int = 16,
    device: str = "cpu",
    include_path: str | Path | None = None,
    step: int | None = None,
    dtype: str = "fp32",
    seed: int = 0,
    log_samples: bool = False,
) -> dict[str, Any]:
    """``xmod lm-eval``: run lm-evaluation-harness tasks on a run; returns the harness's result dict.

    Local tasks (:data:`LOCAL_TASKS`) are written under ``RUN_DIR/eval_items/harness``
    from the data the run was trained on and added to the harness's task paths.
    """
    import lm_eval
    from lm_eval.tasks import TaskManager

    names = [t for t in tasks if t]
    if not names:
        raise UserError("no tasks given: pass --tasks NAME[,NAME...]")
    if include_path is not None and not Path(include_path).is_dir():  # lm-eval ignores it
        raise UserError(f"--include-path {str(include_path)!r}: not a directory of task YAMLs")
    model = XModLM(run_dir=str(run_dir), device=device, batch_size=batch_size, step=step,
                   dtype=dtype, seed=seed)
    paths = [str(include_path)] if include_path else []
    if any(n in LOCAL_TASKS for n in names):
        local = write_local_tasks(model.cfg.data.dir,
                                  cache_dir(Path(run_dir) / "eval_items" / "harness", "task files"))
        paths.append(str(local))
    # indexing the harness's thousands of built-in YAMLs takes a while: skip it
    # when every task asked for is a local one
    manager = TaskManager(
        include_path=paths or None,
        include_defaults=not all(n in LOCAL_TASKS for n in names),
    )
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise UserError(
            f"unknown lm-eval task {unknown[0]!r}: see `lm_eval ls tasks`, or the local tasks"
            f" {', '.join(LOCAL_TASKS)}"
        )
    results = lm_eval.simple_evaluate(
        model=model,
        tasks=names,
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        log_samples=log_samples,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )
    assert results is not None  # rank 0 always gets results
    return results
