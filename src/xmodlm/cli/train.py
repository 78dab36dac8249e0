"""``xmod info``, ``presets``, ``data prepare``, ``train`` and ``demo``: a model from a
config, its data, its training.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from xmodlm.cli.common import (
    Parser,
    add_config_args,
    check_device,
    check_out_dir,
    finite,
    print_json,
    seed_int,
)
from xmodlm.errors import UserError


def info_args(sub: argparse._SubParsersAction) -> None:
    """``xmod info``'s arguments, beside the command that reads them."""
    p = sub.add_parser("info", help="parameters, FLOPs per token and layout of a config")
    add_config_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_info)


def cmd_info(args: argparse.Namespace) -> int:
    from xmodlm.info import model_info

    info = model_info(args.config, args.overrides)
    if args.json:
        print_json(info)
    else:
        from xmodlm.info import format_info

        print(format_info(info))
    return 0


def presets_args(sub: argparse._SubParsersAction) -> None:
    """``xmod presets``'s arguments, beside the command that reads them."""
    p = sub.add_parser("presets", help="list the shipped config presets")
    p.set_defaults(func=cmd_presets)


def cmd_presets(args: argparse.Namespace) -> int:
    from xmodlm.presets import preset_names

    print("\n".join(preset_names()))
    return 0


def data_args(sub: argparse._SubParsersAction) -> None:
    """``xmod data``'s arguments, beside the command that reads them."""
    p = sub.add_parser("data", help="prepare training data")
    data_sub = p.add_subparsers(dest="data_command", required=True, parser_class=Parser)
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
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the document split")
    p.add_argument("--force", action="store_true",
                   help="rebuild --out even though it holds a corpus prepared with other settings"
                   " (runs trained on that corpus can then no longer be evaluated)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress on stderr (else a bar on a terminal, plain lines when piped)")
    p.set_defaults(func=cmd_data_prepare)


def cmd_data_prepare(args: argparse.Namespace) -> int:
    import logging

    from xmodlm.data.prepare import prepare

    check_out_dir(args.out, "corpus")
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


def train_args(sub: argparse._SubParsersAction) -> None:
    """``xmod train``'s arguments, beside the command that reads them."""
    p = sub.add_parser("train", help="train a model (model.vocab_size: the corpus's unless"
                                     " set); rerun on the same --out to resume")
    add_config_args(p)
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
        check_device(args.device)  # cpu, cuda, cuda:N or auto; CUDA only where present
        overrides.append(f"train.device={args.device}")
    cfg = load_config(args.config, overrides, vocab_from_data=True)
    check_out_dir(args.out, "run")
    summary = train(cfg, args.out, progress=not args.quiet, restart=args.restart,
                    force=args.force)
    if os.environ.get("RANK", "0").strip() not in ("", "0"):  # torchrun: rank 0 reports
        return {"ok": 0, "interrupted": 130}.get(summary["status"], 1)
    if args.json:
        print_json(summary)
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


def demo_args(sub: argparse._SubParsersAction) -> None:
    """``xmod demo``'s arguments, beside the command that reads them."""
    p = sub.add_parser(
        "demo", help="prepare the corpus, train compute-matched dense-tiny and xmod-tiny"
    )
    p.add_argument("--data", default="data/corpus", help="data directory")
    p.add_argument("--out", default="runs/demo", help="where the two runs go")
    p.add_argument("--compute", type=finite, default=1.6e13, help="training FLOPs per model")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from xmodlm.demo import format_rows, run_demo

    check_out_dir(args.out, None)  # a folder of runs, itself none
    if args.compute <= 0:
        raise UserError(f"--compute {args.compute}: must be > 0 FLOPs")
    rows = run_demo(args.data, args.out, args.compute)
    print()
    print(f"Compute-matched at C = {args.compute:.3g} training FLOPs per model:")
    print(format_rows(rows))
    return 0
