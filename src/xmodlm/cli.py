"""The ``xmod`` command: thin wrappers over library functions.

Each subcommand parses its arguments, calls one library function and prints the
result. :func:`main` is the error boundary:

* expected failures are one line on stderr and exit status 2: an argument the
  parser rejects, a :class:`~xmodlm.errors.UserError` (bad value, bad file, bad
  spec), and an ``OSError`` of the machine (a full disk, a read-only file system,
  a missing permission), named with its path and cause;
* anything else is a bug of ours: one line saying so and where the full trace was
  written (``error.log`` in the run directory of ``xmod train``, else a temporary
  file), exit status 1.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import re
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xmodlm.errors import UserError

Handler = Callable[[argparse.Namespace], int]


class _Formatter(argparse.HelpFormatter):
    """``--help`` shows each option's default (unless unset, off, or already said)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default in (None, False, argparse.SUPPRESS, [])
            or not (action.option_strings or action.nargs in ("?", "*"))
        ):
            return text
        return f"{text} (default: %(default)s)".lstrip()


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line and exit status 2 (no usage dump)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        if kwargs.get("help") is None and kwargs.get("default") not in (None, False):
            kwargs["help"] = "(default: %(default)s)"
        return super().add_argument(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


class _LazyChoices:
    """argparse ``choices`` read on first use (the law registry imports pandas)."""

    def __init__(self, load: Callable[[], list[str]]) -> None:
        self._load = load
        self._items: list[str] | None = None

    def _all(self) -> list[str]:
        if self._items is None:
            self._items = self._load()
        return self._items

    def __contains__(self, item: object) -> bool:
        return item in self._all()

    def __iter__(self) -> Any:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


def _delta_forms() -> list[str]:
    from xmodlm.law.delta import FORMS

    return ["auto", *FORMS]


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False, default=_json_default))


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "__fspath__"):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def _finite(text: str) -> float:
    """argparse type: a finite number (``float`` alone accepts nan and inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number")
    return value


def _int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """argparse type: an integer in [low, high], checked where it is parsed (a negative
    count or a seed beyond what the generators take would otherwise fail deep inside)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            bound = f"in {low}..{high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"{text}: must be an integer {bound}")
        return value

    return parse


_seed = _int_in(0, 2**32 - 1)  # what numpy and torch generators both take
_count = _int_in(1)
_index = _int_in(0)


def _positive(text: str) -> float:
    """argparse type: a finite number > 0 (rates, sizes, budgets)."""
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text}: must be > 0")
    return value


def _check_device(name: str) -> str:
    """``--device`` of eval, generate, show-routing and lm-eval: cpu, cuda, cuda:N or auto,
    and CUDA only where it is available."""
    if name not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", name):
        raise UserError(f"--device {name!r}: must be cpu, cuda, cuda:N or auto")
    from xmodlm.hardware import resolve_device

    return str(resolve_device(name))


def _check_text(text: str, flag: str) -> str:
    """Text from the command line must be UTF-8 (invalid bytes arrive as surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(f"{flag} is not valid UTF-8 text") from None
    return text


def _blocking_file(path: Path) -> Path | None:
    """The first existing non-directory among ``path``'s parents (a path under a file)."""
    for parent in reversed(path.parents):
        if parent.exists() and not parent.is_dir():
            return parent
    return None


def _check_out_dir(path: str | Path, flag: str = "--out") -> Path:
    """An output directory: absent (it is created) or a directory, never under a file."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UserError(f"{flag} {str(out)!r} is a file, not a directory")
    blocker = _blocking_file(out)
    if blocker is not None:
        raise UserError(f"{flag} {str(out)!r}: {str(blocker)!r} is a file, not a directory")
    return out


def _check_out_file(path: str | Path, flag: str = "--out") -> Path:
    """An output file: not a directory, and its folder not under a file."""
    out = Path(path)
    if out.is_dir():
        raise UserError(f"{flag} {str(out)!r} is a directory; give a file name")
    blocker = _blocking_file(out)
    if blocker is not None:
        raise UserError(f"{flag} {str(out)!r}: {str(blocker)!r} is a file, not a directory")
    return out


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="preset name (e.g. xmod-tiny) or path to a YAML file")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set model.stride=8 (repeatable)",
    )


# --- commands ------------------------------------------------------------------------


def _info_args(sub: argparse._SubParsersAction) -> None:
    """``xmod info``'s arguments, beside the command that reads them."""
    p = sub.add_parser("info", help="parameters, FLOPs per token and layout of a config")
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_info)


def cmd_info(args: argparse.Namespace) -> int:
    from xmodlm.info import model_info

    info = model_info(args.config, args.overrides)
    if args.json:
        _print_json(info)
    else:
        from xmodlm.info import format_info

        print(format_info(info))
    return 0


def _presets_args(sub: argparse._SubParsersAction) -> None:
    """``xmod presets``'s arguments, beside the command that reads them."""
    p = sub.add_parser("presets", help="list the shipped config presets")
    p.set_defaults(func=cmd_presets)


def cmd_presets(args: argparse.Namespace) -> int:
    from xmodlm.config import preset_names

    print("\n".join(preset_names()))
    return 0


def _data_args(sub: argparse._SubParsersAction) -> None:
    """``xmod data``'s arguments, beside the command that reads them."""
    p = sub.add_parser("data", help="prepare training data")
    data_sub = p.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    p = data_sub.add_parser(
        "prepare",
        help="build the default corpus (or your files): splits, BPE tokenizer, token files",
    )
    p.add_argument("--out", default="data/corpus", help="output directory (default data/corpus)")
    p.add_argument("--vocab-size", type=int, default=4096,
                   help="tokens of the BPE tokenizer trained on the corpus")
    p.add_argument("--text", nargs="+", metavar="PATH", help="plain-text files or directories")
    p.add_argument("--jsonl", nargs="+", metavar="PATH",
                   help="JSONL files, one document per line in a string field (--jsonl-field)")
    p.add_argument("--jsonl-field", default="text", metavar="NAME",
                   help="the field of each --jsonl line that holds its document (default text)")
    p.add_argument("--parquet", nargs="+", metavar="PATH", help="Parquet files with a 'text' column")
    p.add_argument("--hf-dataset", metavar="NAME",
                   help="a Hugging Face dataset NAME[:CONFIG] (needs a network)")
    p.add_argument("--hf-split", default="train", help="split of --hf-dataset to read")
    p.add_argument("--hf-column", default="text", help="text column of --hf-dataset")
    p.add_argument("--hf-streaming", action="store_true",
                   help="stream --hf-dataset rows instead of downloading it whole first")
    p.add_argument("--hf-limit", type=int, default=None, metavar="N",
                   help="at most N documents from --hf-dataset")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="your own Hugging Face tokenizer.json instead of a trained BPE"
                   " (--vocab-size is ignored): used as given, except that <|endoftext|>, which"
                   " separates documents, is added with the next free id if it lacks one")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the document split")
    p.add_argument("--force", action="store_true",
                   help="rebuild --out even though it holds a corpus prepared with other settings"
                   " (runs trained on that corpus can then no longer be evaluated)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress on stderr (else a bar on a terminal, plain lines when piped)")
    p.set_defaults(func=cmd_data_prepare)


def cmd_data_prepare(args: argparse.Namespace) -> int:
    import logging

    from xmodlm.data.prepare import prepare

    _check_out_dir(args.out)
    if args.vocab_size < 1:
        raise UserError(f"--vocab-size {args.vocab_size}: must be >= 1")
    hf_flags = [flag for flag, on in (("--hf-split", args.hf_split != "train"),
                                      ("--hf-column", args.hf_column != "text"),
                                      ("--hf-streaming", args.hf_streaming),
                                      ("--hf-limit", args.hf_limit is not None)) if on]
    if hf_flags and not args.hf_dataset:
        raise UserError(f"{hf_flags[0]} applies to --hf-dataset NAME, which was not given")
    if args.hf_limit is not None and args.hf_limit < 1:
        raise UserError(f"--hf-limit {args.hf_limit}: must be at least 1 document")
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(message)s", stream=sys.stderr)
    manifest = prepare(
        args.out,
        vocab_size=args.vocab_size,
        texts=args.text,
        jsonl=args.jsonl,
        parquet=args.parquet,
        hf_dataset=args.hf_dataset,
        seed=args.seed,
        tokenizer=args.tokenizer,
        hf_split=args.hf_split,
        hf_column=args.hf_column,
        hf_streaming=args.hf_streaming,
        hf_limit=args.hf_limit,
        force=args.force,
        jsonl_field=args.jsonl_field,
    )
    splits = manifest["splits"]
    print(
        f"{args.out}: vocab {manifest['vocab_size']}, tokens "
        + ", ".join(f"{k} {v['tokens']:,}" for k, v in splits.items())
    )
    return 0


def _train_args(sub: argparse._SubParsersAction) -> None:
    """``xmod train``'s arguments, beside the command that reads them."""
    p = sub.add_parser("train", help="train a model (model.vocab_size: the corpus's unless"
                                     " set); rerun on the same --out to resume")
    _add_config_args(p)
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--device", default=None,
                   help="cpu, cuda, cuda:N or auto (default: the config's train.device)")
    p.add_argument("--quiet", action="store_true",
                   help="no configuration echo and no progress (bar on a terminal, else lines)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--force", action="store_true",
                   help="resume even though train settings (e.g. max_steps) changed")
    p.add_argument("--restart", action="store_true",
                   help="discard the run's checkpoints and metrics and train from step 0"
                        " (needed when none of its checkpoints loads)")
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    from xmodlm.config import load_config
    from xmodlm.train.trainer import train

    overrides = list(args.overrides)
    if args.device is not None:
        _check_device(args.device)  # cpu, cuda, cuda:N or auto; CUDA only where present
        overrides.append(f"train.device={args.device}")
    cfg = load_config(args.config, overrides, vocab_from_data=True)
    _check_out_dir(args.out)
    summary = train(cfg, args.out, progress=not args.quiet, restart=args.restart,
                    force=args.force)
    if os.environ.get("RANK", "0").strip() not in ("", "0"):  # torchrun: rank 0 reports
        return {"ok": 0, "interrupted": 130}.get(summary["status"], 1)
    if args.json:
        _print_json(summary)
    else:
        print(
            f"{args.out}: {summary['status']} after {summary['steps']} steps,"
            f" val loss {_rounded(summary['final_val_loss'])} (top-k),"
            f" {_rounded(summary['final_val_loss_causal'])} (causal),"
            f" {_rounded(summary['val_bpb'])} bpb"
        )
    return {"ok": 0, "interrupted": 130}.get(summary["status"], 1)


def _rounded(value: Any) -> str:
    """A loss for people: four decimals (a missing one, say of a run stopped before
    its first evaluation, as it is)."""
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _demo_args(sub: argparse._SubParsersAction) -> None:
    """``xmod demo``'s arguments, beside the command that reads them."""
    p = sub.add_parser(
        "demo", help="prepare the corpus, train compute-matched dense-tiny and xmod-tiny"
    )
    p.add_argument("--data", default="data/corpus", help="data directory")
    p.add_argument("--out", default="runs/demo", help="where the two runs go")
    p.add_argument("--compute", type=_finite, default=1.6e13, help="training FLOPs per model")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from xmodlm.demo import format_rows, run_demo

    _check_out_dir(args.out)
    if args.compute <= 0:
        raise UserError(f"--compute {args.compute}: must be > 0 FLOPs")
    rows = run_demo(args.data, args.out, args.compute)
    print()
    print(f"Compute-matched at C = {args.compute:.3g} training FLOPs per model:")
    print(format_rows(rows))
    return 0


def _sweep_args(sub: argparse._SubParsersAction) -> None:
    """``xmod sweep``'s arguments, beside the command that reads them."""
    p = sub.add_parser("sweep", help="run a sweep spec (resumable) and write results.csv")
    p.add_argument("spec", help="sweep spec YAML")
    p.add_argument("--out", default="runs/sweep", help="sweep directory")
    from xmodlm.sweep.runner import EXECUTORS

    p.add_argument("--executor", default="local", choices=list(EXECUTORS),
                   help="where runs train: this machine, a Ray cluster or Slurm")
    p.add_argument("--workers", type=int, default=1, help="concurrent runs (local executor)")
    p.add_argument("--max-retries", type=int, default=2, help="retries of a failed run")
    p.add_argument("--data", default=None, help="data directory (overrides the spec)")
    p.add_argument("--executor-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="an executor option (repeatable): ray address=...; slurm folder=...,"
                   " params.partition=..., params.gpus_per_node=1, local=true")
    p.add_argument("--ray-address", default=None, help="Ray cluster address (default: local)")
    p.add_argument("--slurm-local", action="store_true",
                   help="run slurm jobs with submitit's local executor (testing)")
    p.add_argument("--dry-run", action="store_true", help="print the expanded runs and exit")
    p.add_argument("--rate-from", default=None, metavar="SWEEP_DIR",
                   help="with --dry-run: estimate times from the FLOP/s that this sweep folder's"
                   " finished runs reached (default: --out's own finished runs, if any)")
    p.add_argument("--run-set", action="append", default=[], metavar="train.KEY=VALUE",
                   help="a setting of how the runs execute, for this invocation only and"
                   " without changing run ids (repeatable): train.compile=on,"
                   " train.device=cuda, train.ckpt_every=..., trackers")
    p.add_argument("--quiet", action="store_true", help="no live progress line")
    p.set_defaults(func=cmd_sweep)


def cmd_sweep(args: argparse.Namespace) -> int:
    from xmodlm.sweep import expand, load_spec, run_sweep, write_results
    from xmodlm.sweep.plan import dry_run, train_tokens
    from xmodlm.sweep.runner import (
        check_options,
        check_run_set,
        make_executor,
        parse_executor_options,
    )
    from xmodlm.sweep.spec import check_requirements, eval_args

    check_options(args.executor, args.workers, args.max_retries)
    options = parse_executor_options(args.executor_opt)
    if args.ray_address is not None:
        options["address"] = args.ray_address
    if args.slurm_local:
        options["local"] = True
    make_executor(args.executor, args.workers, **options)  # bad options: before any work
    if Path(args.spec).is_file():
        try:
            Path(args.spec).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise UserError(f"sweep spec {args.spec!r} is not UTF-8 text (a binary file?)") from None
    if not args.dry_run:
        _check_out_dir(args.out)
    spec = load_spec(args.spec)
    runs = expand(spec, data_dir=args.data)
    if runs:
        check_run_set(args.run_set, runs[0].cfg)
    figures, broken = check_requirements(
        runs, spec["require"], train_tokens(runs), strict=not args.dry_run
    )
    if args.dry_run:
        print(dry_run(runs, figures, args.workers, args.out, rate_from=args.rate_from))
        for line in broken:  # shown, not refused: a dry run is for fixing the spec
            print(line.replace("sweep spec: ", "would refuse: "))
        return 0
    result = run_sweep(
        runs, args.out, executor=args.executor, workers=args.workers,
        max_retries=args.max_retries, progress=not args.quiet, eval_args=eval_args(spec),
        run_set=args.run_set, name=spec.get("name"), **options,
    )
    path, n_rows, left_out = write_results(args.out)
    print(f"{result['ran']} ran, {result['skipped']} already done, {result['failed']} failed,"
          f" {result['diverged']} diverged;"
          f" {n_rows} rows in {path}" + (f" ({len(left_out)} left out)" if left_out else ""))
    if result["signal"] is not None:  # 130 (SIGINT) or 143 (SIGTERM), as a shell reports it
        import signal

        sys.stderr.write(
            f"xmod sweep: stopped by {signal.Signals(result['signal']).name}:"
            f" {result['interrupted']} run(s) checkpointed, {result['not_started']} not started;"
            " rerun the same command to resume\n"
        )
        return 128 + int(result["signal"])
    return 1 if result["failed"] else 0


def _results_args(sub: argparse._SubParsersAction) -> None:
    """``xmod results``'s arguments, beside the command that reads them."""
    p = sub.add_parser("results", help="rebuild a sweep's results table from its run dirs")
    p.add_argument("sweep_dir")
    p.add_argument("--out", default=None, help="output CSV (default SWEEP_DIR/results.csv)")
    p.set_defaults(func=cmd_results)


def cmd_results(args: argparse.Namespace) -> int:
    from xmodlm.sweep import write_results

    if args.out:
        _check_out_file(args.out)
    path, n_rows, left_out = write_results(args.sweep_dir, args.out)
    for run_id, why in sorted(left_out.items()):
        print(f"left out {run_id}: {why}", file=sys.stderr)
    print(f"{n_rows} rows written to {path}")
    return 0


def _generate_args(sub: argparse._SubParsersAction) -> None:
    """``xmod generate``'s arguments, beside the command that reads them."""
    p = sub.add_parser("generate", help="sample text from a trained run (causal routing)")
    p.add_argument("run_dir")
    p.add_argument("--prompt", action="append", required=True,
                   help="prompt text (repeat for several prompts in one batch)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=_finite, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k likeliest tokens only")
    p.add_argument("--top-p", type=_finite, default=None,
                   help="sample from the smallest set of tokens holding this probability")
    p.add_argument("--seed", type=_seed, default=None, help="sampling seed (default: random)")
    p.add_argument("--device", default="auto",
                   help="cpu, cuda, cuda:N or auto (CUDA where available, else cpu)")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from xmodlm.export import generate_from_run

    for prompt in args.prompt:
        _check_text(prompt, "--prompt")
    texts = generate_from_run(
        args.run_dir, args.prompt, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        device=_check_device(args.device),
    )
    for prompt, text in zip(args.prompt, texts, strict=True):
        if args.json:
            print(json.dumps({"prompt": prompt, "completion": text}))
        else:
            print(prompt + text)
            if len(args.prompt) > 1:
                print("-" * 40)
    return 0


def _export_args(sub: argparse._SubParsersAction) -> None:
    """``xmod export``'s arguments, beside the command that reads them."""
    p = sub.add_parser(
        "export", help="write a run as safetensors + config.json + tokenizer (transformers-loadable)"
    )
    p.add_argument("run_dir")
    p.add_argument("--out", required=True, help="directory to write the exported model into")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default newest)")
    p.add_argument("--dtype", default="float32",
                   help="dtype of the exported weights: float32 (default), bfloat16 or float16;"
                        " routers and thresholds stay float32")
    p.add_argument("--force", action="store_true",
                   help="write into --out even when it holds something other than an export"
                        " of this run")
    p.add_argument("--json", action="store_true", help="print the written config.json")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from xmodlm.export import export_run

    out = _check_out_dir(args.out)
    config = export_run(args.run_dir, out, step=args.step, dtype=args.dtype, force=args.force)
    if args.json:
        _print_json({"out": str(out), **config})
    else:
        src = config["source"]
        print(f"{out}: {src['checkpoint']} of {args.run_dir} ({config['layout']},"
              f" vocab {config['vocab_size']}); load with xmodlm.load_pretrained({str(out)!r})"
              " or transformers (trust_remote_code=True)")
    return 0


def _law_args(sub: argparse._SubParsersAction) -> None:
    """``xmod law``'s arguments, beside the command that reads them."""
    p = sub.add_parser("law", help="fit and apply the X-MoD scaling law")
    law_sub = p.add_subparsers(dest="law_command", required=True, parser_class=_Parser)
    p = law_sub.add_parser("fit", help="fit the dense law and the X-MoD delta law")
    p.add_argument("results", help="results table (CSV or Parquet)")
    p.add_argument("--form", default="auto", choices=_LazyChoices(_delta_forms),
                   help="delta form (auto: chosen by held-out error)")
    p.add_argument("--holdout", default=None,
                   help="leave-cell-out | top-compute | longest-context")
    p.add_argument("--n-boot", type=int, default=1000,
                   help="bootstrap replicates (at least 100; default 1000)")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the bootstrap")
    p.add_argument("--loss", default="causal", choices=["causal", "topk"],
                   help="validation loss to fit (default causal: what decoding gets)")
    p.add_argument("--min-steps", type=int, default=1000,
                   help="leave out runs with fewer optimiser steps (default 1000; 0 keeps all)")
    p.add_argument("--family", default="xmod",
                   help="sparse family or variant the delta law is fitted on (default xmod)")
    p.add_argument("--baseline", default="law", choices=["law", "paired"],
                   help="what each sparse run's delta is measured against: the dense law at its"
                   " own size (law, default) or its FLOP-matched dense run (paired)")
    p.add_argument("--lr", type=_positive, default=None,
                   help="fit the runs at this peak learning rate (default: the most common)")
    p.add_argument("--out", default=None, help="write the fit JSON here (for predict/recommend)")
    p.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots here")
    p.add_argument("--json", action="store_true", help="print the fit as JSON (a summary)")
    p.add_argument("--samples", action="store_true",
                   help="with --json: include the bootstrap samples")
    p.add_argument("--quiet", action="store_true",
                   help="no progress on stderr (else a bar on a terminal, plain lines when piped)")
    p.set_defaults(func=cmd_law_fit)
    p = law_sub.add_parser("predict", help="predict losses for the rows of a table")
    p.add_argument("fit", help="fit JSON from `xmod law fit --out`")
    p.add_argument("--input", required=True, help="table of configurations (CSV or Parquet)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_law_predict)


def cmd_law_fit(args: argparse.Namespace) -> int:
    from xmodlm.law.fit import fit_law
    from xmodlm.law.table import read_table

    if args.out:
        _check_out_file(args.out)
    if args.plots:
        _check_out_dir(args.plots, "--plots")
    fit = fit_law(read_table(args.results), form=args.form, holdout=args.holdout,
                  n_boot=args.n_boot, seed=args.seed, loss=args.loss,
                  min_steps=args.min_steps, family=args.family, baseline=args.baseline,
                  lr=args.lr)
    if args.out:
        from xmodlm.fileio import atomic_write_json

        atomic_write_json(Path(args.out), fit.to_json())
    if args.plots:
        from xmodlm.report.law_plots import plot_law

        for path in plot_law(fit, read_table(args.results), args.plots):
            print(f"wrote {path}", file=sys.stderr)
    payload = fit.to_json(samples=args.samples)
    if args.json:
        _print_json(payload)
        return 0
    runs = payload["runs"]
    print(f"loss: {fit.loss} validation loss; {runs['n']} runs ({runs['dense']} dense,"
          f" {runs['sparse']} {runs['variant'] or 'sparse'}); left out:"
          f" {runs['dropped_short']} shorter than {runs['min_steps']} steps,"
          f" {runs['dropped_unfinished']} unfinished, {runs['excluded_moe']} MoE,"
          f" other variants {runs['excluded_variants'] or 'none'},"
          f" {runs['excluded_lr']} at another learning rate than {runs['lr']}")
    print(f"delta baseline: {fit.baseline}")
    for note in payload["notes"]:
        print(f"note: {note}")
    d = payload["delta"]
    if d:
        print(f"selected delta form: {d['selected']} ({d['selection'].get('why', '')})")
    for flag in payload["identification"]["flags"]:
        print(f"NOT IDENTIFIED: {flag['law']} {flag['param']}: {flag['problem']}")
    print(json.dumps(payload["metrics"], indent=2))
    return 0


def cmd_law_predict(args: argparse.Namespace) -> int:
    from xmodlm.law.lawfit import load_fit
    from xmodlm.law.predict import predict, predicts_losses
    from xmodlm.law.table import read_table

    fit = load_fit(args.fit)
    out = predict(fit, read_table(args.input))
    what = "loss" if predicts_losses(fit) else "delta"
    why = ("validation loss with its 95% interval (lo, hi)" if what == "loss" else
           "delta = ln L(routed) - ln L(FLOP-matched dense) with its 95% interval: the fit"
           " has no dense law (paired baseline, dense runs of one size), so it predicts"
           " differences from dense, not losses; a fit with --baseline law predicts losses")
    if args.json:
        _print_json({"predicts": what, "loss": fit.loss, "predictions": out.to_dict(orient="records")})
    else:
        print(f"predicted: {fit.loss}-routing {why}")
        print(out.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    return 0


def _recommend_args(sub: argparse._SubParsersAction) -> None:
    """``xmod recommend``'s arguments, beside the command that reads them."""
    p = sub.add_parser("recommend", help="which routing configuration to train, by the law")
    p.add_argument("--compute", type=_finite, required=True, help="training FLOPs C")
    p.add_argument("--context", type=_count, required=True, help="context length T")
    p.add_argument("--active-params", type=_finite, required=True, help="N_ae of the backbone")
    p.add_argument("--max-total-params", type=_finite, default=None,
                   help="largest total parameter count a candidate may have")
    p.add_argument("--vocab-size", type=int, default=4096,
                   help="vocabulary of the models compared (it sets the LM head's FLOPs)")
    p.add_argument("--law", default=None, help="fit JSON (default: the shipped fit)")
    p.add_argument("--loss", default=None, choices=["causal", "topk"],
                   help="the loss to optimise; the law must have been fitted on it"
                   " (default: the law's own, causal unless its table had only top-k)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_recommend)


def cmd_recommend(args: argparse.Namespace) -> int:
    from xmodlm.law.lawfit import load_fit
    from xmodlm.law.recommend import recommend

    result = recommend(
        args.compute, args.context, args.active_params,
        law=load_fit(args.law) if args.law else None,
        max_total_params=args.max_total_params,
        loss=args.loss,
        vocab_size=args.vocab_size,
    )
    if args.json:
        _print_json(result)
    else:
        print(result["answer"])
        print(result.get("reason", ""))
        print(f"(the law predicts the {result['loss']}-routing validation loss)")
        for w in result.get("warnings", []):
            print(f"warning: {w}", file=sys.stderr)
    return 0


def _results_table(path: str) -> Path:
    """A results table given as itself or as the sweep directory that holds it."""
    return Path(path) / "results.csv" if Path(path).is_dir() else Path(path)


def _report_args(sub: argparse._SubParsersAction) -> None:
    """``xmod report``'s arguments, beside the command that reads them."""
    p = sub.add_parser("report", help="written report of a sweep: sparse vs FLOP-matched dense, law")
    p.add_argument("results", help="results table (CSV/Parquet) or a sweep directory")
    p.add_argument("--out", required=True, help="directory for report.md, report.json, comparisons.csv")
    p.add_argument("--law", default=None, help="fit JSON to summarise and plot with the runs")
    p.add_argument("--dense-control", action="append", default=[], metavar="RESULTS",
                   help="another sweep's results (table or directory) on the same budgets, whose"
                        " dense runs join the dense ladder and the equal-size comparison (never"
                        " the FLOP-matched pairing); repeatable")
    p.add_argument("--quiet", action="store_true",
                   help="no progress on stderr (else a bar on a terminal, plain lines when piped)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from xmodlm.report.sweep_report import sweep_report

    _check_out_dir(args.out)
    results = _results_table(args.results)
    controls = [_results_table(c) for c in args.dense_control]
    report = sweep_report(results, args.out, law=args.law, dense_controls=controls)
    if args.json:
        _print_json(report)
    else:
        print((Path(args.out) / "report.md").read_text(), end="")
    return 0


def _eval_args(sub: argparse._SubParsersAction) -> None:
    """``xmod eval``'s arguments, beside the command that reads them."""
    p = sub.add_parser("eval", help="held-out losses, routing statistics, downstream tasks")
    p.add_argument("run_dir")
    p.add_argument("--data", default=None, help="data directory (default: the run's)")
    p.add_argument("--split", default="test", help="held-out split to score: val or test")
    p.add_argument("--tasks", default="cloze,minimal_pairs", help="comma-separated; '' for none")
    p.add_argument("--max-items", type=_count, default=200, help="items per downstream task")
    p.add_argument("--batches", type=int, default=8, metavar="N",
                   help="evaluation batches of the run's batch size (at most what the split"
                        " holds); more for tighter routed fractions (default: 8)")
    p.add_argument("--device", default="auto",
                   help="cpu, cuda, cuda:N or auto (CUDA where available, else cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quiet", action="store_true",
                   help="no progress on stderr (else a bar on a terminal, plain lines when piped)")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    from xmodlm.eval import evaluate_run

    tasks = tuple(t for t in args.tasks.split(",") if t) if args.tasks else ()
    if args.batches < 1:
        raise UserError(f"--batches {args.batches}: must be at least 1")
    result = evaluate_run(args.run_dir, data_dir=args.data, split=args.split, tasks=tasks,
                          max_items=args.max_items, max_batches=args.batches,
                          device=_check_device(args.device))
    if args.json:
        _print_json(result)
    else:
        print(f"{result['split']} loss top-k {result['val_loss_topk']:.4f}"
              f"  causal {result['val_loss_causal']:.4f}"
              f"  bpb {result['val_bpb']:.4f}  agreement {result['routing_agreement']}")
        print(f"KV cache {result['kv_bytes_per_token']:.0f} bytes per token of context"
              f" ({result['kv_fraction']:.3f} of every block caching every token)")
        if "threshold_rule" in result:
            fl = result["flops_per_token"]
            fractions = " ".join(f"{f:.3f}" for f in result["capacity_causal"])
            print(f"causal routing, {result['threshold_rule']} threshold"
                  f" ({result['threshold_source']}): routed fractions {fractions}"
                  f" (c = {result['capacity_target']:g}); forward FLOPs"
                  f" {fl['causal_over_budget']:.3f}x the budget; KV"
                  f" {result['kv_over_ideal']:.3f}x ideal")
            print(f"half rule (sigmoid(r) > 1/2): causal loss {result['val_loss_causal_half']:.4f},"
                  f" FLOPs {fl['causal_half_over_budget']:.3f}x the budget")
        for name, task in result["tasks"].items():
            lo, hi = task["ci95"]
            print(f"{name}: {task['accuracy']:.3f} [95% {lo:.3f}-{hi:.3f}] on {task['items']}"
                  f" items (chance {task['chance']})")
    return 0


def _calibrate_args(sub: argparse._SubParsersAction) -> None:
    """``xmod calibrate``'s arguments, beside the command that reads them."""
    p = sub.add_parser(
        "calibrate",
        help="set a run's causal routing thresholds to route c (rewrites its newest checkpoint)",
    )
    p.add_argument("run_dir")
    p.add_argument("--data", default=None, help="data directory (default: the run's)")
    p.add_argument("--tokens", type=int, default=None, metavar="N",
                   help="training tokens to calibrate on (default: as training does)")
    p.add_argument("--device", default="auto",
                   help="cpu, cuda, cuda:N or auto (CUDA where available, else cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from xmodlm.eval.calibrate import calibrate_run

    record = calibrate_run(args.run_dir, data_dir=args.data, n_tokens=args.tokens,
                           device=_check_device(args.device))
    if args.json:
        _print_json(record)
    else:
        print(f"{record['checkpoint']}: {len(record['thresholds'])} sparse blocks calibrated"
              f" on {record['tokens']:,} training tokens to route c = {record['capacity']:g}"
              f" (rule before: {record['rule_before']})")
    return 0


def _lm_eval_args(sub: argparse._SubParsersAction) -> None:
    """``xmod lm-eval``'s arguments, beside the command that reads them."""
    p = sub.add_parser(
        "lm-eval", help="lm-evaluation-harness tasks on a run (needs the 'eval' extra)"
    )
    p.add_argument("run_dir")
    p.add_argument("--tasks", required=True,
                   help="comma-separated harness task names; offline: xmod_cloze,"
                        "xmod_minimal_pairs,xmod_cloze_gen,xmod_heldout")
    p.add_argument("--num-fewshot", type=_index, default=None,
                   help="examples in each prompt (default: the task's own)")
    p.add_argument("--limit", type=_finite, default=None,
                   help="at most N documents per task (or a fraction if below 1)")
    p.add_argument("--batch-size", type=_count, default=16, help="sequences scored at once")
    p.add_argument("--include-path", default=None, help="a directory of extra task YAMLs")
    p.add_argument("--step", type=_index, default=None, help="checkpoint step (default newest)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="dtype the model is scored in")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the harness (few-shot draws)")
    p.add_argument("--device", default="auto",
                   help="cpu, cuda, cuda:N or auto (CUDA where available, else cpu)")
    p.add_argument("--out", default=None, help="also write the JSON record here")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quiet", action="store_true",
                   help="no progress on stderr (else a bar on a terminal, plain lines when piped)")
    p.set_defaults(func=cmd_lm_eval)


def cmd_lm_eval(args: argparse.Namespace) -> int:
    try:
        from xmodlm.eval.harness import run_harness
    except ImportError as err:
        raise UserError(f"{err}") from None
    from xmodlm.fileio import atomic_open

    if args.limit is not None and args.limit <= 0:
        raise UserError(f"--limit must be positive (a count, or a fraction below 1), got {args.limit}")
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    if args.out:
        _check_out_file(args.out)
    device = _check_device(args.device)
    out = run_harness(
        args.run_dir,
        [t.strip() for t in args.tasks.split(",")],
        num_fewshot=args.num_fewshot,
        limit=limit,
        batch_size=args.batch_size,
        device=device,
        include_path=args.include_path,
        step=args.step,
        dtype=args.dtype,
        seed=args.seed,
    )
    record = {
        "run_dir": args.run_dir,
        "results": out["results"],
        "n_shot": out.get("n-shot", {}),
        "n_samples": out.get("n-samples", {}),
        "versions": out.get("versions", {}),
    }
    if args.out:
        with atomic_open(args.out, "w") as f:
            json.dump(record, f, indent=2, default=_json_default)
            f.write("\n")
    if args.json:
        _print_json(record)
    else:
        for task, metrics in out["results"].items():
            shown = "  ".join(
                f"{k.split(',')[0]} {v:.4f}" for k, v in metrics.items()
                if isinstance(v, float) and "_stderr" not in k
            )
            print(f"{task}: {shown}")
    return 0


def _show_routing_args(sub: argparse._SubParsersAction) -> None:
    """``xmod show-routing``'s arguments, beside the command that reads them."""
    p = sub.add_parser("show-routing", help="picture of which tokens the sparse blocks took")
    p.add_argument("run_dir")
    p.add_argument("--text", required=True, help="the text whose routing is drawn")
    p.add_argument("--out", required=True, help="PNG (an HTML page is written beside it)")
    p.add_argument("--training-plots", default=None, metavar="DIR",
                   help="also plot coverage, depth histogram and overlap from metrics.jsonl")
    p.add_argument("--routing", choices=("causal", "topk"), default="causal",
                   help="which routing shades the passage: causal (inference's decision,"
                        " default; empty until it has learned) or topk (training's k = c T"
                        " tokens); the picture always maps both")
    p.add_argument("--device", default="auto",
                   help="cpu, cuda, cuda:N or auto (CUDA where available, else cpu)")
    p.set_defaults(func=cmd_show_routing)


def cmd_show_routing(args: argparse.Namespace) -> int:
    from xmodlm.report.routing_plots import plot_training, show_routing

    out = _check_out_file(args.out)
    if args.training_plots:
        _check_out_dir(args.training_plots, "--training-plots")
    _check_text(args.text, "--text")
    device = _check_device(args.device)
    png, html = (out.with_suffix(".png"), out) if out.suffix == ".html" else (out, None)
    show_routing(args.run_dir, args.text, png, html or out.with_suffix(".html"), device=device,
                 routing=args.routing)
    print(f"wrote {png} and {html or out.with_suffix('.html')}")
    if args.training_plots:
        for path in plot_training(args.run_dir, args.training_plots):
            print(f"wrote {path}")
    return 0


def _plot_args(sub: argparse._SubParsersAction) -> None:
    """``xmod plot``'s arguments, beside the command that reads them."""
    p = sub.add_parser("plot", help="loss curves (train, validation under both routings) of runs")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories")
    p.add_argument("--out", required=True, help="image file (.png, .pdf or .svg)")
    p.add_argument("--label", action="append", default=[],
                   help="legend name of a run, in the order of the runs (repeat; default: folder names)")
    p.add_argument("--title", default=None, help="figure title")
    p.add_argument("--x", default="tokens", choices=("tokens", "flops", "step"),
                   help="x axis: training tokens (default), training FLOPs (per-token FLOPs"
                        " of the run's config times tokens) or optimiser step")
    p.add_argument("--smooth", type=int, default=0, metavar="N",
                   help="also draw the training loss as a trailing mean over N logged steps"
                        " (default 0: raw only)")
    p.set_defaults(func=cmd_plot)


def cmd_plot(args: argparse.Namespace) -> int:
    from xmodlm.report.curves import plot_runs

    out = _check_out_file(args.out)
    if out.suffix.lower() not in (".png", ".pdf", ".svg"):
        raise UserError(f"--out {str(out)!r}: give a .png, .pdf or .svg file name")
    if args.label and len(args.label) != len(args.runs):
        raise UserError(f"{len(args.label)} --label for {len(args.runs)} runs: give one per run")
    path = plot_runs(args.runs, out, labels=args.label or None, title=args.title, x=args.x,
                     smooth=args.smooth)
    print(f"wrote {path}")
    return 0


def _bench_args(sub: argparse._SubParsersAction) -> None:
    """``xmod bench``'s arguments, beside the command that reads them."""
    p = sub.add_parser("bench", help="speed figures, measured side by side in one process")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="device the figures are measured on")
    p.add_argument("--quick", action="store_true",
                   help="smoke mode, under a minute: few rounds, no compile, bench size shrunk")
    p.add_argument("--sizes", default=None, metavar="LIST",
                   help="comma-separated sizes: bench, w128-t128, w128-t512, w256-t256, or all"
                   " (default all; --quick: bench)")
    p.add_argument("--threads", default=None, metavar="LIST",
                   help="comma-separated thread counts to time each size at, e.g. 1,2"
                   " (default: the current torch thread count)")
    p.add_argument("--reps", type=int, default=None, help="timed rounds (default per size)")
    p.add_argument("--no-compile", action="store_true", help="time eager models only")
    p.add_argument("--compile-modes", default=None, metavar="LIST",
                   help="compiled modes timed beside eager: compiled (per block),"
                   " compiled_model (whole model, as train.compile=on); default both")
    p.add_argument("--decode-runs", default=None, metavar="RUN,RUN,...",
                   help="instead: decode speed and KV bytes of trained runs side by side"
                   " (real test prompts, causal routing; first run is the reference)")
    p.add_argument("--no-law", action="store_true", help="skip the law-fit timing")
    p.add_argument("--no-decode", action="store_true", help="skip the decode timing")
    p.add_argument("--no-widths", action="store_true",
                   help="skip the width scan (X-MoD over dense at widths 128-1024, one thread)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from xmodlm.bench import run_bench

    if args.reps is not None and args.reps < 1:
        raise UserError(f"--reps {args.reps}: must be >= 1 (timed rounds)")
    if args.decode_runs:
        from xmodlm.bench.decode import decode_runs

        runs = [r for r in args.decode_runs.split(",") if r]
        for run in runs:
            if not Path(run).is_dir():
                raise UserError(f"--decode-runs: {run!r} is not a run directory")
        _print_json(decode_runs(runs, rounds=args.reps or 5, device=_check_device(args.device)))
        return 0
    result = run_bench(
        device=args.device, quick=args.quick, reps=args.reps, include_law=not args.no_law,
        include_decode=not args.no_decode, include_widths=not args.no_widths,
        include_compile=False if args.no_compile else None,
        compile_modes=args.compile_modes, progress=not args.json, sizes=args.sizes,
        threads=args.threads,
    )
    _print_json(result)  # the figures are one JSON object either way
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="xmod",
        description="Sparse-depth language models (X-MoD): train, evaluate, fit scaling laws.",
    )
    from xmodlm import __version__

    parser.add_argument("--version", action="version", version=f"xmod-lm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    _info_args(sub)
    _presets_args(sub)
    _data_args(sub)
    _train_args(sub)
    _sweep_args(sub)
    _results_args(sub)
    _generate_args(sub)
    _export_args(sub)
    _eval_args(sub)
    _calibrate_args(sub)
    _lm_eval_args(sub)
    _show_routing_args(sub)
    _plot_args(sub)
    _law_args(sub)
    _recommend_args(sub)
    _report_args(sub)
    _bench_args(sub)
    _demo_args(sub)
    _quiet_everywhere(sub)
    return parser


def _quiet_everywhere(sub: argparse._SubParsersAction) -> None:
    """Every command takes ``--quiet``: a script can pass it to any of them. Those
    that show no progress of their own accept it (main silences progress anywhere)."""
    for parser in sub.choices.values():
        nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if nested:
            _quiet_everywhere(nested[0])
        elif "--quiet" not in parser._option_string_actions:
            parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _os_error(err: OSError, args: argparse.Namespace) -> str:
    """An OSError as 'path: cause': the file it hit when it says, else the command's
    output or run directory (a failed write() or fsync() names no file)."""
    cause = err.strerror or (errno.errorcode.get(err.errno, "") if err.errno else "") or str(err)
    where = " -> ".join(str(f) for f in (err.filename, err.filename2) if f)
    if where:
        return f"{where}: {cause}"
    for key in ("out", "run_dir", "sweep_dir"):
        if getattr(args, key, None):
            return f"{cause} (working in {getattr(args, key)})"
    return cause


def _trace_file(args: argparse.Namespace) -> str | None:
    """Write the current exception's full trace where the user will look for it:
    ``error.log`` in the run directory of ``xmod train``, else a temporary file."""
    text = traceback.format_exc()
    out = getattr(args, "out", None) if getattr(args, "command", None) == "train" else None
    if out and Path(out).is_dir():
        try:
            with open(Path(out) / "error.log", "a", encoding="utf-8") as f:
                f.write(text)
            return str(Path(out) / "error.log")
        except OSError:
            pass
    try:
        fd, path = tempfile.mkstemp(prefix="xmod-error-", suffix=".log")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        return path
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # bare `xmod`: the command list
        parser.print_help()
        return 0
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help (0) or an argument the parser rejected (2)
        return exit_.code if isinstance(exit_.code, int) else 2
    handler: Handler = args.func
    nested = getattr(args, f"{args.command}_command", None)  # xmod law fit, xmod data prepare
    name = f"xmod {args.command}" + (f" {nested}" if nested else "")
    from xmodlm.progress import set_enabled

    progress_was = set_enabled(not getattr(args, "quiet", False))
    try:
        return handler(args)
    except UserError as err:
        sys.stderr.write(f"{name}: error: {_one_line(err)}\n")
        return 2
    except OSError as err:  # the machine: full disk, read-only file system, permissions
        sys.stderr.write(f"{name}: error: {_one_line(_os_error(err, args))}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("xmod: interrupted\n")
        return 130
    except Exception as err:  # a bug of ours: one line, the trace kept in a file
        where = _trace_file(args)
        kept = f"full trace in {where}" if where else "the trace could not be written"
        sys.stderr.write(
            f"{name}: internal error (a bug, please report it):"
            f" {type(err).__name__}: {_one_line(err)[:300]}; {kept}\n"
        )
        return 1
    finally:
        set_enabled(progress_was)


if __name__ == "__main__":
    raise SystemExit(main())
