"""``xmod generate``, ``export``, ``eval``, ``calibrate``, ``lm-eval``, ``show-routing``
and ``plot``: what is done with a trained run.
"""

from __future__ import annotations

import argparse
import json

from xmodlm.cli.common import (
    check_device,
    check_out_dir,
    check_out_file,
    check_text,
    count_int,
    finite,
    index_int,
    json_default,
    print_json,
    seed_int,
)
from xmodlm.errors import UserError


def generate_args(sub: argparse._SubParsersAction) -> None:
    """``xmod generate``'s arguments, beside the command that reads them."""
    p = sub.add_parser("generate", help="sample text from a trained run (causal routing)")
    p.add_argument("run_dir")
    p.add_argument("--prompt", action="append", required=True,
                   help="prompt text (repeat for several prompts in one batch)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=finite, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k likeliest tokens only")
    p.add_argument("--top-p", type=finite, default=None,
                   help="sample from the smallest set of tokens holding this probability")
    p.add_argument("--seed", type=seed_int, default=None, help="sampling seed (default: random)")
    p.add_argument("--device", default="auto",
                   help="cpu, cuda, cuda:N or auto (CUDA where available, else cpu)")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from xmodlm.export import generate_from_run

    for prompt in args.prompt:
        check_text(prompt, "--prompt")
    texts = generate_from_run(
        args.run_dir, args.prompt, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        device=check_device(args.device),
    )
    for prompt, text in zip(args.prompt, texts, strict=True):
        if args.json:
            print(json.dumps({"prompt": prompt, "completion": text}))
        else:
            print(prompt + text)
            if len(args.prompt) > 1:
                print("-" * 40)
    return 0


def export_args(sub: argparse._SubParsersAction) -> None:
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

    out = check_out_dir(args.out, "export")
    config = export_run(args.run_dir, out, step=args.step, dtype=args.dtype, force=args.force)
    if args.json:
        print_json({"out": str(out), **config})
    else:
        src = config["source"]
        print(f"{out}: {src['checkpoint']} of {args.run_dir} ({config['layout']},"
              f" vocab {config['vocab_size']}); load with xmodlm.load_pretrained({str(out)!r})"
              " or transformers (trust_remote_code=True)")
    return 0


def eval_args(sub: argparse._SubParsersAction) -> None:
    """``xmod eval``'s arguments, beside the command that reads them."""
    p = sub.add_parser("eval", help="held-out losses, routing statistics, downstream tasks")
    p.add_argument("run_dir")
    p.add_argument("--data", default=None, help="data directory (default: the run's)")
    p.add_argument("--split", default="test", help="held-out split to score: val or test")
    p.add_argument("--tasks", default="cloze,minimal_pairs", help="comma-separated; '' for none")
    p.add_argument("--max-items", type=count_int, default=200, help="items per downstream task")
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
                          device=check_device(args.device))
    if args.json:
        print_json(result)
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


def calibrate_args(sub: argparse._SubParsersAction) -> None:
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
                           device=check_device(args.device))
    if args.json:
        print_json(record)
    else:
        print(f"{record['checkpoint']}: {len(record['thresholds'])} sparse blocks calibrated"
              f" on {record['tokens']:,} training tokens to route c = {record['capacity']:g}"
              f" (rule before: {record['rule_before']})")
    return 0


def lm_eval_args(sub: argparse._SubParsersAction) -> None:
    """``xmod lm-eval``'s arguments, beside the command that reads them."""
    p = sub.add_parser(
        "lm-eval", help="lm-evaluation-harness tasks on a run (needs the 'eval' extra)"
    )
    p.add_argument("run_dir")
    p.add_argument("--tasks", required=True,
                   help="comma-separated harness task names; offline: xmod_cloze,"
                        "xmod_minimal_pairs,xmod_cloze_gen,xmod_heldout")
    p.add_argument("--num-fewshot", type=index_int, default=None,
                   help="examples in each prompt (default: the task's own)")
    p.add_argument("--limit", type=finite, default=None,
                   help="at most N documents per task (or a fraction if below 1)")
    p.add_argument("--batch-size", type=count_int, default=16, help="sequences scored at once")
    p.add_argument("--include-path", default=None, help="a directory of extra task YAMLs")
    p.add_argument("--step", type=index_int, default=None, help="checkpoint step (default newest)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="dtype the model is scored in")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the harness (few-shot draws)")
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
        check_out_file(args.out, (".json",))
    device = check_device(args.device)
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
            json.dump(record, f, indent=2, default=json_default)
            f.write("\n")
    if args.json:
        print_json(record)
    else:
        for task, metrics in out["results"].items():
            shown = "  ".join(
                f"{k.split(',')[0]} {v:.4f}" for k, v in metrics.items()
                if isinstance(v, float) and "_stderr" not in k
            )
            print(f"{task}: {shown}")
    return 0


def show_routing_args(sub: argparse._SubParsersAction) -> None:
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

    out = check_out_file(args.out, (".png", ".html"))
    if args.training_plots:
        check_out_dir(args.training_plots, None, "--training-plots")
    check_text(args.text, "--text")
    device = check_device(args.device)
    png, html = (out.with_suffix(".png"), out) if out.suffix == ".html" else (out, None)
    show_routing(args.run_dir, args.text, png, html or out.with_suffix(".html"), device=device,
                 routing=args.routing)
    print(f"wrote {png} and {html or out.with_suffix('.html')}")
    if args.training_plots:
        for path in plot_training(args.run_dir, args.training_plots):
            print(f"wrote {path}")
    return 0


def plot_args(sub: argparse._SubParsersAction) -> None:
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

    out = check_out_file(args.out, (".png", ".pdf", ".svg"))
    if args.label and len(args.label) != len(args.runs):
        raise UserError(f"{len(args.label)} --label for {len(args.runs)} runs: give one per run")
    path = plot_runs(args.runs, out, labels=args.label or None, title=args.title, x=args.x,
                     smooth=args.smooth)
    print(f"wrote {path}")
    return 0
