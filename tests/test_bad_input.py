"""Bad input, as a hostile but realistic user gives it: one line on stderr, exit 2.

The table below runs every case in-process through ``xmodlm.cli.main``; each must
end with the expected exit status, exactly one line on stderr and no traceback.
Below it, the faults of the machine (full disk, read-only file system, missing
permission), the run-directory lock, resume leftovers and the sweep's records.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from xmodlm import runs
from xmodlm.cli import main
from xmodlm.errors import UserError
from xmodlm.train import checkpoint as ckpt_io

TINY = [
    "data.val_batches=1", "model.vocab_size=300", "model.d_model=32", "model.n_heads=2",
    "model.n_layers=4", "model.stride=2", "model.capacity=0.5", "model.context=32",
    "train.batch_size=4", "train.dtype=fp32", "train.warmup_steps=1", "train.log_every=1",
    "train.eval_every=1000",
]
NO_CUDA = not torch.cuda.is_available()
BAD_UTF8 = b"\xff\xfe caf\xc3".decode("utf-8", "surrogateescape")  # as argv delivers it


def _tiny_yaml(data_dir: Path) -> str:
    raw: dict = {"base": "xmod-tiny", "name": "tiny"}
    for item in [f"data.dir={data_dir}", *TINY]:
        key, value = item.split("=", 1)
        section, name = key.split(".")
        raw.setdefault(section, {})[name] = yaml.safe_load(value)
    return yaml.safe_dump(raw)


def _copy_data(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        if p.is_file():
            (dst / p.name).write_bytes(p.read_bytes())
    return dst


@pytest.fixture(scope="module")
def world(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Files for the cases: a tiny config, a trained run, broken files of every kind."""
    from xmodlm.config import load_config
    from xmodlm.train.trainer import train

    root = tmp_path_factory.mktemp("bad")
    w = {"data": str(tiny_data_dir), "root": str(root)}
    cfg = root / "tiny.yaml"
    cfg.write_text(_tiny_yaml(tiny_data_dir))
    w["cfg"] = str(cfg)
    run = root / "run"
    train(load_config(cfg, ["train.max_steps=2"]), run, progress=False)
    w["run"] = str(run)
    # a run whose only checkpoint is corrupt
    corrupt = root / "corrupt_run"
    train(load_config(cfg, ["train.max_steps=2"]), corrupt, progress=False)
    weights = runs.checkpoint_dirs(corrupt)[-1] / "model.safetensors"
    weights.write_bytes(b"\0" * 64)
    w["corrupt_run"] = str(corrupt)

    files = {
        "file": b"just a file\n",
        "empty.yaml": b"",
        "comments.yaml": b"# nothing here\n",
        "binary.yaml": bytes(range(256)) * 4,
        "nul.yaml": b"\0" * 512,
        "list.yaml": b"- 1\n- 2\n",
        "badkey.yaml": b"modle: {d_model: 8}\n",
        "badbase.yaml": b"base: no-such-preset\n",
        "badsection.yaml": b"model: 5\n",
        "binary.csv": bytes(range(256)) * 4,
        "notjson.json": b"{not json",
    }
    for name, content in files.items():
        (root / name).write_bytes(content)
        w[name.replace(".", "_")] = str(root / name)
    (root / "loop_a.yaml").write_text(f"base: {root / 'loop_b.yaml'}\n")
    (root / "loop_b.yaml").write_text(f"base: {root / 'loop_a.yaml'}\n")
    w["loop_a"] = str(root / "loop_a.yaml")
    (root / "base_int.yaml").write_text("base: 5\n")
    w["base_int"] = str(root / "base_int.yaml")
    (root / "chain.yaml").write_text(f"base: {cfg}\nname: chained\n")  # cfg's base: xmod-tiny
    w["chain"] = str(root / "chain.yaml")
    from xmodlm.runs import EXPORT_FORMAT

    (root / "export").mkdir()  # what `xmod export` leaves: config.json of its format
    (root / "export" / "config.json").write_text(json.dumps({"format": EXPORT_FORMAT}))
    w["export"] = str(root / "export")
    (root / "dir.yaml").mkdir()
    w["dir_yaml"] = str(root / "dir.yaml")
    table = root / "results.csv"
    table.write_text("params_active,tokens,val_loss\n1e6,1e8,3.0\n")
    w["table"] = str(table)
    for name, cell in (("causal_na", "n/a"), ("causal_inf", "inf"), ("causal_neg", "-5"),
                       ("causal_text", "low")):
        (root / f"{name}.csv").write_text(
            "params_active,tokens,val_loss,val_loss_causal\n1e6,1e8,3.0,3.1\n"
            f"2e6,1e8,2.9,{cell}\n")
        w[name] = str(root / f"{name}.csv")
    from importlib import resources

    shipped = json.loads((resources.files("xmodlm") / "law" / "default_fit.json").read_text())
    for name, value in (("fit_nan", float("nan")), ("fit_inf", float("inf"))):
        broken = json.loads(json.dumps(shipped))
        broken["dense"][0]["params"]["alpha"]["value"] = value
        (root / f"{name}.json").write_text(json.dumps(broken))  # JSON admits NaN, Infinity
        w[name] = str(root / f"{name}.json")

    # data directories: ids beyond the vocabulary, a corrupt manifest, a truncated split
    bad_ids = _copy_data(tiny_data_dir, root / "bad_ids")
    tokens = np.fromfile(bad_ids / "train.bin", dtype=np.uint16)
    tokens[len(tokens) // 2] = 60000
    tokens.tofile(bad_ids / "train.bin")
    w["bad_ids"] = str(bad_ids)
    bad_manifest = _copy_data(tiny_data_dir, root / "bad_manifest")
    (bad_manifest / "manifest.json").write_bytes(b"\xff\xfe{")
    w["bad_manifest"] = str(bad_manifest)
    short = _copy_data(tiny_data_dir, root / "short")
    (short / "train.bin").write_bytes((short / "train.bin").read_bytes()[:1000])
    w["short"] = str(short)

    # sweep specs
    good = {"name": "t", "base": "micro", "compute": [2.0e9], "context": [32],
            "dense": [{"width": 32, "n_layers": 2, "n_heads": 2}],
            "families": [{"family": "dense"}], "seeds": [0],
            "set": [f"data.dir={tiny_data_dir}", "model.vocab_size=300", "train.batch_size=4",
                    "train.max_steps=2", "data.val_batches=1"]}
    specs = {
        "spec_compute_abc": {"compute": ["abc"]},
        "spec_compute_neg": {"compute": [-1.0]},
        "spec_compute_inf": {"compute": [float("inf")]},
        "spec_capacity_abc": {"families": [{"family": "xmod", "stride": 2, "capacity": "abc"}]},
        "spec_capacity_2": {"families": [{"family": "xmod", "stride": 2, "capacity": 2}]},
        "spec_stride_frac": {"families": [{"family": "xmod", "stride": 2.5, "capacity": 0.5}]},
        "spec_stride_str": {"families": [{"family": "xmod", "stride": "two", "capacity": 0.5}]},
        "spec_lr_abc": {"families": [{"family": "dense", "lr": "fast"}]},
        "spec_gating_num": {"families": [{"family": "xmod", "stride": 2, "capacity": 0.5,
                                          "gating": 3}]},
        "spec_width_abc": {"dense": [{"width": "abc", "n_layers": 2}]},
        "spec_dense_nolayers": {"dense": [{"width": 32}]},
        "spec_seeds_neg": {"seeds": [-1]},
        "spec_context_0": {"context": [0]},
        "spec_family_int": {"families": [5]},
        "spec_family_unknown": {"families": [{"family": "banana"}]},
        "spec_set_int": {"set": [5]},
        "spec_compute_ctx_missing": {"compute": {64: [2.0e9]}},
        "spec_compute_map_noctx": {"compute": {32: [2.0e9]}, "context": None},
        "spec_require_unknown": {"require": {"min_epochs": 1}},
        "spec_require_abc": {"require": {"min_steps": "many"}},
        "spec_require_list": {"require": [1]},
        "spec_family_seeds_neg": {"families": [{"family": "dense", "seeds": [-2]}]},
        "spec_family_compute_neg": {"families": [{"family": "dense", "compute": [-1.0]}]},
        "spec_breaks_min_steps": {"require": {"min_steps": 100}},
        "spec_breaks_head": {"require": {"max_head_frac": 0.01}},
        "spec_breaks_epochs": {"require": {"max_epochs": 1e-6}},
        "spec_no_data": {"set": [f"data.dir={root / 'nowhere'}", "model.vocab_size=300"]},
        "spec_vocab_below_data": {"set": [f"data.dir={tiny_data_dir}", "model.vocab_size=200",
                                          "train.batch_size=4", "data.val_batches=1"]},
        "spec_vocab_above_data": {"set": [f"data.dir={tiny_data_dir}", "model.vocab_size=400",
                                          "train.batch_size=4", "data.val_batches=1"]},
        "spec_context_beyond_val": {"context": [8192], "compute": [2.0e12]},
        "spec_good": {},
    }
    for name, change in specs.items():
        (root / f"{name}.yaml").write_text(yaml.safe_dump({**good, **change}))
        w[name] = str(root / f"{name}.yaml")
    (root / "spec_binary.yaml").write_bytes(bytes(range(256)))
    w["spec_binary"] = str(root / "spec_binary.yaml")
    (root / "spec_empty.yaml").write_text("")
    w["spec_empty"] = str(root / "spec_empty.yaml")
    sweep = root / "sweep" / "runs"
    sweep.mkdir(parents=True)
    w["sweep"] = str(root / "sweep")
    (root / "other_sweep" / "runs" / "0123456789ab").mkdir(parents=True)  # another spec's run
    (root / "other_sweep" / "sweep.json").write_text('{"name": "other"}')
    w["other_sweep"] = str(root / "other_sweep")
    (root / "old_sweep" / "runs" / "0123456789ab").mkdir(parents=True)  # from before sweep.json
    w["old_sweep"] = str(root / "old_sweep")
    return w


T = ["train", "{cfg}", "--out", "{new}", "--set", "train.max_steps=2"]
I = ["info", "xmod-tiny", "--set"]
G = ["generate", "{run}", "--prompt", "The"]
SR = ["show-routing", "{run}", "--text", "The ship"]
S = ["sweep"]
SETTINGS = [  # (--set value) that info and train must both reject
    "train.tokens=inf", "train.tokens=.inf", "train.tokens=1e400", "train.compute=inf",
    "train.compute=.nan", "train.lr=nan", "train.lr=inf", "train.lr=-1", "train.beta1=1.5",
    "train.beta2=1.0", "train.beta1=-0.1", "model.init_std=nan", "model.init_std=0",
    "model.rope_theta=0", "model.rope_theta=-5", "model.norm_eps=-1", "model.norm_eps=0",
    "train.grad_clip=-1", "train.grad_clip=0", "train.grad_clip=inf", "data.val_batches=0",
    "data.val_batches=-3", "model.capacity=nan", "model.capacity=0", "model.capacity=1.5",
    "model.stride=0", "model.stride=2.5", "model.d_model=abc", "model.n_layers=1e400",
    "train.warmup_steps=-1", "train.ckpt_every=0", "train.max_bad_steps=0", "train.seed=-1",
    "train.weight_decay=inf", "train.min_lr_ratio=nan", "train.cooldown_frac=2",
    "model.balance_coef=-1", "model.causal_coef=nan", "model.gating=banana",
    "train.dtype=fp16", "train.device=banana", "train.schedule=linear", "model.layout=DDxx",
    "model.vocab_size=0", "model.n_heads=3", "model.foo=1", "noequals", "model=1",
    "model.d_model=[1", "data.dir=", "train.batch_size=0", "train.log_every=0",
    "train.fsdp=maybe", "train.optimizer=sgd", "train.muon_ns_steps=0", "train.warmup_frac=1",
    "train.muon_rms_match=0",
]
CASES: list[tuple[str, list[str], int]] = [
    *[(f"info {s}", [*I, s], 2) for s in SETTINGS],
    *[(f"train {s}", [*T, "--set", s], 2) for s in SETTINGS[:22]],
    # config files
    ("info missing preset", ["info", "no-such-preset"], 2),
    ("info missing yaml", ["info", "{root}/missing.yaml"], 2),
    ("info empty yaml", ["info", "{empty_yaml}"], 2),
    ("info comments-only yaml", ["info", "{comments_yaml}"], 2),
    ("info binary yaml", ["info", "{binary_yaml}"], 2),
    ("info NUL yaml", ["info", "{nul_yaml}"], 2),
    ("info list yaml", ["info", "{list_yaml}"], 2),
    ("info directory yaml", ["info", "{dir_yaml}"], 2),
    ("info unknown key", ["info", "{badkey_yaml}"], 2),
    ("info unknown base", ["info", "{badbase_yaml}"], 2),
    ("info base chain loops", ["info", "{loop_a}"], 2),
    ("info base not a name", ["info", "{base_int}"], 2),
    ("info section not mapping", ["info", "{badsection_yaml}"], 2),
    ("info no config", ["info"], 2),
    ("info unknown flag", ["info", "xmod-tiny", "--bogus"], 2),
    ("unknown command", ["nosuchcmd"], 2),
    ("presets extra argument", ["presets", "extra"], 2),
    ("train empty yaml", ["train", "{empty_yaml}", "--out", "{new}"], 2),
    ("train binary yaml", ["train", "{binary_yaml}", "--out", "{new}"], 2),
    # train: outputs, data, budgets, resume
    ("train --out a file", ["train", "{cfg}", "--out", "{file}", "--set", "train.max_steps=2"], 2),
    ("train --out under a file", ["train", "{cfg}", "--out", "{file}/r"], 2),
    ("train no --out", ["train", "{cfg}"], 2),
    ("train missing data", [*T, "--set", "data.dir={root}/nowhere"], 2),
    ("train ids beyond vocab", [*T, "--set", "data.dir={bad_ids}"], 2),
    ("train corrupt manifest", [*T, "--set", "data.dir={bad_manifest}"], 2),
    ("train truncated split", [*T, "--set", "data.dir={short}"], 2),
    ("train context beyond data", [*T, "--set", "model.context=1000000"], 2),
    ("train no budget", [*T, "--set", "train.max_steps=0"], 2),
    ("train budget under a batch", [*T, "--set", "train.max_steps=0", "--set", "train.tokens=10"], 2),
    ("train model vocab below data", [*T, "--set", "model.vocab_size=100"], 2),
    ("train vocabulary beyond memory", [*T, "--set", "model.vocab_size=2e9"], 2),
    ("train width beyond memory", [*T, "--set", "model.d_model=1048576", "--set", "model.n_heads=2"], 2),
    ("train other config on a run", ["train", "{cfg}", "--out", "{run}", "--set", "model.d_model=64"], 2),
    ("train corrupt only checkpoint", ["train", "{cfg}", "--out", "{corrupt_run}", "--set", "train.max_steps=3"], 2),
    # data prepare
    ("data prepare --out a file", ["data", "prepare", "--out", "{file}"], 2),
    ("data prepare --out under a file", ["data", "prepare", "--out", "{file}/corpus"], 2),
    ("data prepare --vocab-size 0", ["data", "prepare", "--out", "{new}", "--vocab-size", "0"], 2),
    ("data prepare --vocab-size abc", ["data", "prepare", "--vocab-size", "abc"], 2),
    ("data prepare missing text", ["data", "prepare", "--out", "{new}", "--text", "{root}/none"], 2),
    ("data prepare --hf-split without --hf-dataset",
     ["data", "prepare", "--out", "{new}", "--hf-split", "test"], 2),
    ("data prepare --hf-limit 0",
     ["data", "prepare", "--out", "{new}", "--hf-dataset", "x", "--hf-limit", "0"], 2),
    ("data prepare --tokenizer missing",
     ["data", "prepare", "--out", "{new}", "--text", "{file}", "--tokenizer", "{root}/none.json"], 2),
    ("data prepare --tokenizer not a tokenizer",
     ["data", "prepare", "--out", "{new}", "--text", "{file}", "--tokenizer", "{file}"], 2),
    ("data no subcommand", ["data"], 2),
    # sweep
    ("sweep missing spec", [*S, "{root}/missing.yaml", "--dry-run"], 2),
    ("sweep empty spec", [*S, "{spec_empty}", "--dry-run"], 2),
    ("sweep binary spec", [*S, "{spec_binary}", "--dry-run"], 2),
    *[(f"sweep {name}", [*S, f"{{{name}}}", "--dry-run"], 2) for name in (
        "spec_compute_abc", "spec_compute_neg", "spec_compute_inf", "spec_capacity_abc",
        "spec_capacity_2", "spec_stride_frac", "spec_stride_str", "spec_lr_abc",
        "spec_gating_num", "spec_width_abc", "spec_dense_nolayers", "spec_seeds_neg",
        "spec_context_0", "spec_family_int", "spec_family_unknown", "spec_set_int",
        "spec_compute_ctx_missing", "spec_compute_map_noctx", "spec_require_unknown",
        "spec_require_abc", "spec_require_list", "spec_family_seeds_neg",
        "spec_family_compute_neg")],
    # a spec that breaks its own design rules: refused before any run (a dry run shows it)
    *[(f"sweep {name}", [*S, f"{{{name}}}", "--out", "{new}", "--quiet"], 2) for name in (
        "spec_breaks_min_steps", "spec_breaks_head", "spec_breaks_epochs")],
    ("sweep missing data, once up front", [*S, "{spec_no_data}", "--out", "{new}", "--quiet"], 2),
    ("sweep vocabulary below the data's, once up front",
     [*S, "{spec_vocab_below_data}", "--out", "{new}", "--quiet"], 2),
    ("sweep vocabulary above the data's, once up front",
     [*S, "{spec_vocab_above_data}", "--out", "{new}", "--quiet"], 2),
    ("sweep context beyond the validation split, once up front",
     [*S, "{spec_context_beyond_val}", "--out", "{new}", "--quiet"], 2),
    ("sweep --workers 0", [*S, "{spec_good}", "--out", "{new}", "--workers", "0"], 2),
    ("sweep --workers -3", [*S, "{spec_good}", "--out", "{new}", "--workers", "-3"], 2),
    ("sweep --max-retries -1", [*S, "{spec_good}", "--out", "{new}", "--max-retries", "-1"], 2),
    ("sweep --executor banana", [*S, "{spec_good}", "--executor", "banana"], 2),
    ("sweep --out a file", [*S, "{spec_good}", "--out", "{file}"], 2),
    ("sweep into another sweep's --out", [*S, "{spec_good}", "--out", "{other_sweep}", "--quiet"], 2),
    ("sweep into an older sweep's --out", [*S, "{spec_good}", "--out", "{old_sweep}", "--quiet"], 2),
    ("sweep --out under a file", [*S, "{spec_good}", "--out", "{file}/s"], 2),
    # results
    ("results missing sweep", ["results", "{root}/nowhere"], 2),
    ("results --out under a file", ["results", "{sweep}", "--out", "{file}/r.csv"], 2),
    ("results --out a directory", ["results", "{sweep}", "--out", "{root}"], 2),
    # generate
    ("generate --device banana", [*G, "--device", "banana"], 2),
    pytest.param("generate --device cuda", [*G, "--device", "cuda"], 2,
                 marks=pytest.mark.skipif(not NO_CUDA, reason="CUDA present")),
    ("generate --device cuda:x", [*G, "--device", "cuda:x"], 2),
    ("generate invalid UTF-8 prompt", ["generate", "{run}", "--prompt", BAD_UTF8], 2),
    ("generate missing run", ["generate", "{root}/nowhere", "--prompt", "x"], 2),
    ("generate a file as run", ["generate", "{file}", "--prompt", "x"], 2),
    ("generate empty prompt", ["generate", "{run}", "--prompt", ""], 2),
    ("generate --max-new-tokens -1", [*G, "--max-new-tokens", "-1"], 2),
    ("generate --temperature nan", [*G, "--temperature", "nan"], 2),
    ("generate --temperature -1", [*G, "--temperature", "-1"], 2),
    ("generate --top-k 0", [*G, "--top-k", "0"], 2),
    ("generate --top-p 1.5", [*G, "--top-p", "1.5"], 2),
    ("generate --top-p inf", [*G, "--top-p", "inf"], 2),
    ("generate no prompt", ["generate", "{run}"], 2),
    ("generate corrupt checkpoint", ["generate", "{corrupt_run}", "--prompt", "x"], 2),
    # eval
    ("eval --batches 0", ["eval", "{run}", "--batches", "0"], 2),
    ("calibrate --tokens 0", ["calibrate", "{run}", "--tokens", "0"], 2),
    ("calibrate missing run", ["calibrate", "{root}/nowhere"], 2),
    ("eval --device banana", ["eval", "{run}", "--device", "banana"], 2),
    pytest.param("eval --device cuda", ["eval", "{run}", "--device", "cuda"], 2,
                 marks=pytest.mark.skipif(not NO_CUDA, reason="CUDA present")),
    ("eval missing run", ["eval", "{root}/nowhere"], 2),
    ("eval --split bogus", ["eval", "{run}", "--split", "bogus", "--tasks", ""], 2),
    ("eval --data missing", ["eval", "{run}", "--data", "{root}/nowhere", "--tasks", ""], 2),
    ("eval --data ids beyond vocab", ["eval", "{run}", "--data", "{bad_ids}", "--split", "train",
                                      "--tasks", ""], 2),
    ("eval corrupt checkpoint", ["eval", "{corrupt_run}", "--tasks", ""], 2),
    ("eval an export folder", ["eval", "{export}", "--tasks", ""], 2),
    ("calibrate an export folder", ["calibrate", "{export}"], 2),
    ("generate an export folder", ["generate", "{export}", "--prompt", "x"], 2),
    ("show-routing an export folder", ["show-routing", "{export}", "--text", "x", "--out", "{new}.png"], 2),
    ("lm-eval an export folder", ["lm-eval", "{export}", "--tasks", "xmod_cloze"], 2),
    # show-routing
    ("show-routing --out under a file", [*SR, "--out", "{file}/r.png"], 2),
    ("show-routing --out a directory", [*SR, "--out", "{root}"], 2),
    ("show-routing --device banana", [*SR, "--out", "{new}.png", "--device", "banana"], 2),
    pytest.param("show-routing --device cuda", [*SR, "--out", "{new}.png", "--device", "cuda"], 2,
                 marks=pytest.mark.skipif(not NO_CUDA, reason="CUDA present")),
    ("show-routing invalid UTF-8", ["show-routing", "{run}", "--text", BAD_UTF8, "--out", "{new}.png"], 2),
    ("show-routing missing run", ["show-routing", "{root}/nowhere", "--text", "x", "--out", "{new}.png"], 2),
    ("show-routing plots under a file", [*SR, "--out", "{new}.png", "--training-plots", "{file}/p"], 2),
    ("show-routing no --text", ["show-routing", "{run}", "--out", "{new}.png"], 2),
    ("plot missing run", ["plot", "{root}/nowhere", "--out", "{new}.png"], 2),
    ("plot run without metrics", ["plot", "{root}", "--out", "{new}.png"], 2),
    ("plot --out not an image", ["plot", "{run}", "--out", "{new}.txt"], 2),
    ("plot --out a directory", ["plot", "{run}", "--out", "{root}"], 2),
    ("plot --label count", ["plot", "{run}", "--label", "a", "--label", "b", "--out", "{new}.png"], 2),
    ("plot no run", ["plot", "--out", "{new}.png"], 2),
    # lm-eval
    ("lm-eval --limit 0", ["lm-eval", "{run}", "--tasks", "xmod_cloze", "--limit", "0"], 2),
    ("lm-eval --limit nan", ["lm-eval", "{run}", "--tasks", "xmod_cloze", "--limit", "nan"], 2),
    ("lm-eval --dtype fp64", ["lm-eval", "{run}", "--tasks", "xmod_cloze", "--dtype", "fp64"], 2),
    ("lm-eval --device banana", ["lm-eval", "{run}", "--tasks", "xmod_cloze", "--device", "banana"], 2),
    ("lm-eval --out under a file", ["lm-eval", "{run}", "--tasks", "xmod_cloze", "--out", "{file}/x.json"], 2),
    # law, recommend, report
    ("law fit missing table", ["law", "fit", "{root}/missing.csv"], 2),
    ("law fit binary table", ["law", "fit", "{binary_csv}"], 2),
    ("law fit --out under a file", ["law", "fit", "{table}", "--out", "{file}/fit.json"], 2),
    ("law fit --out a directory", ["law", "fit", "{table}", "--out", "{root}"], 2),
    ("law fit --plots a file", ["law", "fit", "{table}", "--plots", "{file}"], 2),
    ("law predict missing fit", ["law", "predict", "{root}/none.json", "--input", "{table}"], 2),
    ("law no subcommand", ["law"], 2),
    ("law fit causal loss n/a", ["law", "fit", "{causal_na}"], 2),
    ("law fit causal loss inf", ["law", "fit", "{causal_inf}"], 2),
    ("law fit causal loss -5", ["law", "fit", "{causal_neg}"], 2),
    ("law fit causal loss text", ["law", "fit", "{causal_text}"], 2),
    ("law predict NaN parameter", ["law", "predict", "{fit_nan}", "--input", "{table}"], 2),
    ("law predict inf parameter", ["law", "predict", "{fit_inf}", "--input", "{table}"], 2),
    ("recommend NaN parameter", ["recommend", "--compute", "1e15", "--context", "128",
                                 "--active-params", "1e6", "--law", "{fit_nan}"], 2),
    ("recommend --compute nan", ["recommend", "--compute", "nan", "--context", "128", "--active-params", "1e6"], 2),
    ("recommend --compute inf", ["recommend", "--compute", "inf", "--context", "128", "--active-params", "1e6"], 2),
    ("recommend --compute abc", ["recommend", "--compute", "abc", "--context", "128", "--active-params", "1e6"], 2),
    ("recommend --context abc", ["recommend", "--compute", "1e15", "--context", "abc", "--active-params", "1e6"], 2),
    ("recommend --active-params inf", ["recommend", "--compute", "1e15", "--context", "128", "--active-params", "inf"], 2),
    ("recommend missing law", ["recommend", "--compute", "1e15", "--context", "128", "--active-params", "1e6", "--law", "{root}/none.json"], 2),
    ("report --out a file", ["report", "{table}", "--out", "{file}"], 2),
    ("report --out under a file", ["report", "{table}", "--out", "{file}/rep"], 2),
    ("report missing table", ["report", "{root}/missing.csv", "--out", "{new}"], 2),
    # numbers range-checked where they are parsed: seeds, counts, rates
    ("data prepare --seed -1", ["data", "prepare", "--out", "{new}", "--seed", "-1"], 2),
    ("data prepare --seed 2^40", ["data", "prepare", "--out", "{new}", "--seed", "1099511627776"], 2),
    ("data prepare --seed abc", ["data", "prepare", "--out", "{new}", "--seed", "abc"], 2),
    ("generate --seed -1", [*G, "--seed", "-1"], 2),
    ("generate --seed 1e3", [*G, "--seed", "1e3"], 2),
    ("generate --seed beyond 32 bits", [*G, "--seed", "99999999999999999999"], 2),
    ("eval --max-items 0", ["eval", "{run}", "--max-items", "0"], 2),
    ("eval --max-items -5", ["eval", "{run}", "--max-items", "-5"], 2),
    ("lm-eval --num-fewshot -1", ["lm-eval", "{run}", "--tasks", "xmod_cloze", "--num-fewshot", "-1"], 2),
    ("lm-eval --batch-size 0", ["lm-eval", "{run}", "--tasks", "xmod_cloze", "--batch-size", "0"], 2),
    ("lm-eval --step -2", ["lm-eval", "{run}", "--tasks", "xmod_cloze", "--step", "-2"], 2),
    ("lm-eval --seed -1", ["lm-eval", "{run}", "--tasks", "xmod_cloze", "--seed", "-1"], 2),
    ("law fit --seed -1", ["law", "fit", "{table}", "--seed", "-1"], 2),
    ("law fit --lr nan", ["law", "fit", "{table}", "--lr", "nan"], 2),
    ("law fit --lr 0", ["law", "fit", "{table}", "--lr", "0"], 2),
    ("law fit --lr -1e-3", ["law", "fit", "{table}", "--lr", "-1e-3"], 2),
    ("recommend --context 0", ["recommend", "--compute", "1e15", "--context", "0", "--active-params", "1e6"], 2),
    ("recommend --context -128", ["recommend", "--compute", "1e15", "--context", "-128", "--active-params", "1e6"], 2),
    ("recommend --context 1.5", ["recommend", "--compute", "1e15", "--context", "1.5", "--active-params", "1e6"], 2),
    # config values that name a size, a rate or a count
    ("info model.vocab_size=-5", [*I, "model.vocab_size=-5"], 2),
    ("info model.d_model=0", [*I, "model.d_model=0"], 2),
    ("info model.n_heads=0", [*I, "model.n_heads=0"], 2),
    ("info model.context=-1", [*I, "model.context=-1"], 2),
    ("info model.context=1.5", [*I, "model.context=1.5"], 2),
    ("info model.d_ff=-1", [*I, "model.d_ff=-1"], 2),
    ("info train.batch_size=-4", [*I, "train.batch_size=-4"], 2),
    ("info train.grad_accum=0", [*I, "train.grad_accum=0"], 2),
    ("info train.keep_last=0", [*I, "train.keep_last=0"], 2),
    ("info train.eval_every=0", [*I, "train.eval_every=0"], 2),
    ("info model.gating=true", [*I, "model.gating=true"], 2),
    ("info train.seed=1.5", [*I, "train.seed=1.5"], 2),
    ("info model.capacity=abc", [*I, "model.capacity=abc"], 2),
    ("info model.stride=true", [*I, "model.stride=true"], 2),
    # files in the wrong place, or of the wrong kind
    ("eval a file as run", ["eval", "{file}", "--tasks", ""], 2),
    ("calibrate a file as run", ["calibrate", "{file}"], 2),
    ("show-routing a file as run", ["show-routing", "{file}", "--text", "x", "--out", "{new}.png"], 2),
    ("lm-eval missing run", ["lm-eval", "{root}/nowhere", "--tasks", "xmod_cloze"], 2),
    ("plot a file as run", ["plot", "{file}", "--out", "{new}.png"], 2),
    ("results a file as sweep", ["results", "{file}"], 2),
    ("law predict fit not JSON", ["law", "predict", "{notjson_json}", "--input", "{table}"], 2),
    ("law predict fit of another kind", ["law", "predict", "{list_yaml}", "--input", "{table}"], 2),
    ("law predict missing input", ["law", "predict", "{fit_nan}", "--input", "{root}/none.csv"], 2),
    ("recommend law not JSON", ["recommend", "--compute", "1e15", "--context", "128",
                                "--active-params", "1e6", "--law", "{notjson_json}"], 2),
    ("report binary table", ["report", "{binary_csv}", "--out", "{new}"], 2),
    ("report --law not JSON", ["report", "{table}", "--out", "{new}", "--law", "{notjson_json}"], 2),
    ("train a directory as config", ["train", "{dir_yaml}", "--out", "{new}"], 2),
    ("train --device banana", [*T, "--device", "banana"], 2),
    ("sweep --data missing", [*S, "{spec_good}", "--out", "{new}", "--data", "{root}/nowhere", "--quiet"], 2),
    ("sweep --executor-opt without =", [*S, "{spec_good}", "--executor-opt", "folder"], 2),
    ("sweep --run-set of what is trained", [*S, "{spec_good}", "--out", "{new}", "--run-set", "train.lr=1"], 2),
    ("sweep --rate-from without runs", [*S, "{spec_good}", "--dry-run", "--rate-from", "{root}"], 2),
    # bench, demo
    ("bench --reps -1", ["bench", "--quick", "--reps", "-1"], 2),
    ("bench --reps 0", ["bench", "--quick", "--reps", "0"], 2),
    ("bench --reps abc", ["bench", "--reps", "abc"], 2),
    ("bench --device banana", ["bench", "--device", "banana"], 2),
    ("demo --compute nan", ["demo", "--compute", "nan"], 2),
    ("demo --compute -5", ["demo", "--compute", "-5", "--out", "{new}"], 2),
    ("demo --out a file", ["demo", "--out", "{file}"], 2),
]


MUST_SAY = {  # cases whose one line must name this cause (not merely some error)
    "sweep into another sweep's --out": "holds the runs of sweep 'other', not 't'",
    "sweep into an older sweep's --out": "none of them of this spec",
    **{f"{cmd} an export folder": "is an export" for cmd in ("eval", "calibrate", "show-routing",
                                                             "lm-eval")},
    "law fit causal loss n/a": "row 1: val_loss_causal=nan",
    "law fit causal loss inf": "row 1: val_loss_causal=inf",
    "law fit causal loss -5": "row 1: val_loss_causal=-5",
    "law fit causal loss text": "row 1: val_loss_causal='low'",
    "law predict NaN parameter": "alpha is nan",
    "generate --seed beyond 32 bits": "0..4294967295",
    "law fit --lr nan": "finite",
    "recommend --context 0": ">= 1",
    "law predict inf parameter": "alpha is inf",
    "recommend NaN parameter": "alpha is nan",
    "sweep vocabulary below the data's, once up front": "model.vocab_size 200, not the vocabulary",
    "sweep vocabulary above the data's, once up front": "model.vocab_size 400, not the vocabulary",
    "sweep context beyond the validation split, once up front": "fewer than context + 1",
    "info base chain loops": "loops",
    "info base not a name": "must be a preset name",
    "train vocabulary beyond memory": "GiB",
    "train width beyond memory": "GiB",
}


def _case_id(case: object) -> str:
    return case.values[0] if hasattr(case, "values") else case[0]  # type: ignore[index]


def test_the_table_is_large() -> None:
    assert len(CASES) >= 100
    commands = {(c.values[1] if hasattr(c, "values") else c[1])[:1][0] for c in CASES
                if (c.values[1] if hasattr(c, "values") else c[1])}
    assert commands >= {"info", "presets", "data", "train", "sweep", "results", "generate",
                        "eval", "lm-eval", "show-routing", "law", "recommend", "report",
                        "bench", "demo", "plot"}


@pytest.mark.parametrize(("name", "argv", "code"), CASES,
                         ids=[_case_id(c) for c in CASES])
def test_bad_input_is_one_line(
    name: str, argv: list[str], code: int, world: dict[str, str], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = [a.format(**world, new=str(tmp_path / "new")) for a in argv]
    got = main(args)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert got == code, (name, got, err)
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert MUST_SAY.get(name, "") in err, (name, err)


# --- faults of the machine -----------------------------------------------------------


def _train_args(world: dict[str, str], out: Path, *extra: str) -> list[str]:
    return ["train", world["cfg"], "--out", str(out), "--quiet", "--set", "train.max_steps=2",
            *[x for s in extra for x in ("--set", s)]]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_checkpoint_write_fault_is_one_line(
    code: int, world: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    real = os.replace

    def failing(src: object, dst: object) -> None:
        if "step_" in str(dst):
            raise OSError(code, os.strerror(code))
        real(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    out = tmp_path / "run"
    assert main(_train_args(world, out)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert os.strerror(code) in err and "step_00000002" in err, err
    assert not ckpt_io.abandoned_tmp_dirs(out)  # the half checkpoint was removed
    assert not (out / ".lock").exists()  # the lock was released


def test_full_disk_on_any_write_names_the_run(
    world: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)  # the lock's record is the first write
    out = tmp_path / "run"
    assert main(_train_args(world, out)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err and str(out) in err, err


def test_a_bug_is_one_line_and_a_trace_file(
    world: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import xmodlm.train.trainer as trainer

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(trainer, "evaluate", broken)
    out = tmp_path / "run"
    assert main(_train_args(world, out)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error" in err and "boom" in err, err
    trace = out / "error.log"
    assert str(trace) in err and "Traceback" in trace.read_text()
    monkeypatch.setattr("xmodlm.info.model_info", broken)  # no run directory: a temp file
    assert main(["info", "xmod-tiny"]) == 1
    err = capsys.readouterr().err
    where = err.rsplit("full trace in ", 1)[1].strip()
    assert Path(where).is_file() and "RuntimeError" in Path(where).read_text()
    Path(where).unlink()


# --- one writer per run directory ---------------------------------------------------


def test_second_writer_is_refused(
    world: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from xmodlm.train.lock import run_lock

    out = tmp_path / "run"
    with run_lock(out):
        assert main(_train_args(world, out)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"pid {os.getpid()}" in err
    assert socket.gethostname() in err
    assert not (out / ".lock").exists()
    assert main(_train_args(world, out)) == 0  # released: the run proceeds


def test_second_writer_process_is_refused(world: dict[str, str], tmp_path: Path) -> None:
    from xmodlm.train.lock import run_lock

    out = tmp_path / "run"
    with run_lock(out):
        proc = subprocess.run(
            [sys.executable, "-m", "xmodlm", *_train_args(world, out)],
            capture_output=True, text=True, timeout=120,
        )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"pid {os.getpid()}" in proc.stderr


def test_stale_lock_is_taken_over(
    world: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    assert main(_train_args(world, out)) == 0
    err = capsys.readouterr().err
    assert "stale lock" in err and f"pid {dead.pid}" in err
    assert not (out / ".lock").exists()


# --- resume leftovers, corrupt checkpoints, file modes --------------------------------


def test_resume_cleans_abandoned_checkpoints_and_torn_metrics(
    world: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert main(_train_args(world, out)) == 0
    tmp = out / "ckpt" / ".tmp_step_00000003_x1y2"
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"half")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 4.')  # torn by a kill
    capsys.readouterr()
    assert main([*_train_args(world, out), "--set", "train.max_steps=3", "--force"]) == 0
    assert not tmp.exists() and str(tmp) in capsys.readouterr().err
    from xmodlm.train.loggers import read_metrics

    steps = [r["step"] for r in read_metrics(out) if "loss" in r]
    assert steps == [1, 2, 3]


def test_corrupt_only_checkpoint_needs_restart(
    world: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert main(_train_args(world, out)) == 0
    (runs.checkpoint_dirs(out)[-1] / "state.pt").write_bytes(b"garbage")
    capsys.readouterr()
    assert main(_train_args(world, out, "train.max_steps=4")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--restart" in err, err
    assert main([*_train_args(world, out, "train.max_steps=4"), "--restart"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["status"] == "ok"


def test_files_follow_the_umask(world: dict[str, str], tmp_path: Path) -> None:
    old = os.umask(0o002)
    try:
        out = tmp_path / "run"
        assert main(_train_args(world, out)) == 0
    finally:
        os.umask(old)
    ckpt = runs.checkpoint_dirs(out)[-1]
    assert ckpt.stat().st_mode & 0o777 == 0o775
    for name in ("model.safetensors", "state.pt", "meta.json"):
        assert (ckpt / name).stat().st_mode & 0o777 == 0o664, name


def test_non_finite_final_loss_is_diverged(
    world: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import xmodlm.train.trainer as trainer

    real = trainer.evaluate

    def nan_eval(*args: object, **kwargs: object) -> dict:
        return {**real(*args, **kwargs), "val_loss_topk": float("nan")}

    monkeypatch.setattr(trainer, "evaluate", nan_eval)
    assert main(_train_args(world, tmp_path / "run")) == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "diverged"


# --- sweeps: checks up front, failures as rows ---------------------------------------


def test_sweep_spec_numbers_read_as_strings_are_numbers(world: dict[str, str]) -> None:
    from xmodlm.sweep import expand, load_spec
    from xmodlm.sweep.grammar import check_spec

    spec = load_spec(world["spec_good"])
    spec["compute"] = ["2e9"]
    spec["families"] = [{"family": "xmod", "stride": "2", "capacity": "0.5", "lr": "1e-3",
                         "balance_coef": "1e-2"}]
    runs = expand(check_spec(spec))
    assert runs[0].cfg.train.lr == 1e-3 and runs[0].cfg.model.stride == 2
    assert runs[0].cfg.model.balance_coef == 1e-2


def test_sweep_checks_data_once_before_any_run(world: dict[str, str], tmp_path: Path) -> None:
    from xmodlm.sweep import expand, load_spec, run_sweep

    runs = expand(load_spec(world["spec_no_data"]))
    with pytest.raises(UserError, match="not found"):
        run_sweep(runs, tmp_path / "s", progress=False)
    assert not list((tmp_path / "s").glob("runs/*"))


def test_failed_and_diverged_runs_are_rows(world: dict[str, str], tmp_path: Path) -> None:
    from xmodlm.law.table import finished_runs
    from xmodlm.sweep.results import COLUMNS, EXTRA, collect_results

    runs = tmp_path / "sweep" / "runs"
    ok = runs / "ok"
    ok.mkdir(parents=True)
    good = json.loads(json.dumps(_summary()))
    (ok / "summary.json").write_text(json.dumps(good))
    diverged = runs / "div"
    diverged.mkdir()
    (diverged / "summary.json").write_text(json.dumps(
        {**good, "status": "diverged", "final_val_loss": None, "skipped_steps": 5}))
    failed = runs / "fail"
    failed.mkdir()
    (failed / "sweep_config.yaml").write_text(Path(world["cfg"]).read_text())
    (failed / "failure.json").write_text(json.dumps(
        {"status": "failed", "attempts": 1, "error_tail": "loading\nxmod train: error: disk full"}))
    table, left_out = collect_results(tmp_path / "sweep")
    assert not left_out and list(table.columns) == COLUMNS + EXTRA and "error" in EXTRA
    by_id = table.set_index("run_id")
    assert by_id.loc["div", "status"] == "diverged" and "diverged" in by_id.loc["div", "error"]
    assert by_id.loc["fail", "status"] == "failed" and "disk full" in by_id.loc["fail", "error"]
    assert by_id.loc["fail", "family"] == "xmod" and by_id.loc["fail", "params_active"] > 0
    finished, dropped = finished_runs(table)
    assert list(finished["run_id"]) == ["ok"] and dropped == 2


def _summary() -> dict:
    return {"status": "ok", "family": "dense", "width": 32, "n_layers": 2, "stride": 1,
            "capacity": 1.0, "context": 32, "gating": "logit", "balance_coef": 0.0,
            "params_total": 1000, "params_active": 900, "flops_per_token": 6000,
            "tokens": 1e6, "seed": 0, "final_val_loss": 3.5, "val_bpb": 1.2, "steps": 10}


# --- sweeps: signals -----------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_a_sweep_in_one_go(
    signum: int, world: dict[str, str], tmp_path: Path
) -> None:
    """One signal: the running run checkpoints and is left resumable (no failure
    recorded, lock released), the queued run never starts, the sweep exits 128 + N."""
    spec = yaml.safe_load(Path(world["spec_good"]).read_text())
    spec["seeds"] = [0, 1]
    spec["set"] = [s for s in spec["set"] if not s.startswith("train.max_steps")]
    spec["set"] += ["train.max_steps=100000", "train.ckpt_every=100000", "train.log_every=1"]
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    out = tmp_path / "sweep"
    proc = subprocess.Popen(
        [sys.executable, "-m", "xmodlm", "sweep", str(tmp_path / "spec.yaml"), "--out", str(out),
         "--quiet", "--allow-dirty"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not list(out.glob("runs/*/metrics.jsonl")) or '"loss"' not in next(
                out.glob("runs/*/metrics.jsonl")).read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, (stdout, stderr)
    assert f"stopped by {signal.Signals(signum).name}" in stderr and "1 not started" in stderr
    started = [d for d in (out / "runs").iterdir() if d.is_dir()]
    assert len(started) == 1, started  # the queued run never started
    run = started[0]
    assert runs.checkpoint_dirs(run), "the interrupted run wrote no checkpoint"
    assert not (run / "failure.json").exists() and not (run / "summary.json").exists()
    assert not (run / ".lock").exists()  # the child let go of the run
    from xmodlm.sweep.runner import run_state

    assert run_state(run) == ("pending", 0)  # a rerun resumes it


# --- nothing lost: corpora, figures ----------------------------------------------------


def test_prepare_refuses_to_replace_a_corpus_of_another_vocabulary(
    world: dict[str, str], tiny_data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = _copy_data(tiny_data_dir, tmp_path / "corpus")
    before = {p.name: p.read_bytes() for p in corpus.iterdir()}
    src = str(tiny_data_dir.parent / "src")
    argv = ["data", "prepare", "--out", str(corpus), "--text", src, "--quiet"]
    assert main([*argv, "--vocab-size", "320"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "vocab_size 300" in err and "--force" in err, err
    assert {p.name: p.read_bytes() for p in corpus.iterdir()} == before
    assert main([*argv, "--vocab-size", "300"]) == 0  # the same request: verified, kept
    assert main([*argv, "--vocab-size", "320", "--force"]) == 0
    assert json.loads((corpus / "manifest.json").read_text())["vocab_size"] == 320


def test_a_plot_on_a_full_disk_keeps_the_earlier_plot(
    world: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "curves.png"
    assert main(["plot", world["run"], "--out", str(out)]) == 0
    good = out.read_bytes()

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    assert main(["plot", world["run"], "--out", str(out), "--title", "again"]) == 2
    assert "No space left" in capsys.readouterr().err
    assert out.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir()] == ["curves.png"]  # no temporary left


@pytest.mark.parametrize("argv", [
    ["plot", "{run}", "--out", "{out}.png"],
    ["show-routing", "{run}", "--text", "The ship", "--out", "{out}.png"],
], ids=["plot", "show-routing"])
def test_figures_never_write_through_a_link(
    argv: list[str], world: dict[str, str], tmp_path: Path
) -> None:
    victim = tmp_path / "elsewhere.txt"
    victim.write_text("precious\n")
    for suffix in (".png", ".html"):
        (tmp_path / f"fig{suffix}").symlink_to(victim)
    assert main([a.format(**world, out=tmp_path / "fig") for a in argv]) == 0
    assert victim.read_text() == "precious\n"
    assert not (tmp_path / "fig.png").is_symlink() and (tmp_path / "fig.png").stat().st_size > 0


def test_atomic_open_refuses_a_link_planted_at_its_temporary_name(tmp_path: Path) -> None:
    from xmodlm.fileio import atomic_write_text

    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "out.txt"
    tmp = target.with_name(f".out.txt.tmp{os.getpid()}-{threading.get_ident()}")
    tmp.symlink_to(victim)
    atomic_write_text(target, "new")
    assert target.read_text() == "new" and victim.read_text() == "precious"


# --- the environment, the run directory, the config chain -----------------------------


@pytest.mark.parametrize("env", [
    {"WORLD_SIZE": "2"}, {"WORLD_SIZE": "abc"}, {"WORLD_SIZE": "0"},
    {"WORLD_SIZE": "2", "RANK": "5"}, {"WORLD_SIZE": "2", "RANK": "-1"},
    {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "x"},
], ids=["no RANK", "WORLD_SIZE abc", "WORLD_SIZE 0", "RANK beyond", "RANK negative",
        "LOCAL_RANK x"])
def test_launcher_environment_is_checked(
    env: dict[str, str], world: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(_train_args(world, tmp_path / "run")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("RANK" in err or "WORLD_SIZE" in err), err
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


def _copy_run(run: str, dst: Path) -> Path:
    import shutil

    return Path(shutil.copytree(run, dst))


def test_stray_names_in_ckpt_are_ignored_with_a_note(
    world: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    run = _copy_run(world["run"], tmp_path / "run")
    newest = runs.checkpoint_dirs(run)[-1]
    shutil.copytree(newest, newest.with_name("step_00000005.bak"))  # a user's backup copy
    (run / "ckpt" / "step_00000009").write_text("not a directory")
    (run / "ckpt" / "step_1").mkdir()
    assert runs.checkpoint_dirs(run) == [newest]
    assert "step_00000005.bak" in capsys.readouterr().err
    assert main(["generate", str(run), "--prompt", "The", "--max-new-tokens", "2"]) == 0
    assert main(["eval", str(run), "--tasks", "", "--batches", "1", "--quiet"]) == 0
    assert main([*_train_args(world, run), "--set", "train.max_steps=3", "--force"]) == 0
    assert (run / "ckpt" / "step_00000005.bak").is_dir()  # never pruned: not ours


def test_finished_run_without_checkpoints_stops(
    world: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    run = _copy_run(world["run"], tmp_path / "run")
    shutil.rmtree(run / "ckpt")
    before = {n: (run / n).read_bytes() for n in ("summary.json", "metrics.jsonl")}
    capsys.readouterr()
    assert main(_train_args(world, run)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "finished" in err and "--restart" in err, err
    assert {n: (run / n).read_bytes() for n in before} == before
    assert main([*_train_args(world, run), "--restart"]) == 0  # on purpose: trained again


def test_a_base_of_a_base_is_merged(world: dict[str, str], tmp_path: Path) -> None:
    from xmodlm.config import load_config

    (tmp_path / "grand.yaml").write_text("model: {d_model: 64, n_heads: 2, n_layers: 6}\n")
    (tmp_path / "parent.yaml").write_text(f"base: {tmp_path / 'grand.yaml'}\nmodel: {{n_layers: 2}}\n")
    (tmp_path / "child.yaml").write_text(f"base: {tmp_path / 'parent.yaml'}\nname: child\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert (cfg.name, cfg.model.d_model, cfg.model.n_heads, cfg.model.n_layers) == (
        "child", 64, 2, 2)  # the grandparent's width arrives; the nearer depth wins
    chained, direct = load_config(world["chain"]), load_config(world["cfg"])
    assert dataclasses.replace(chained, name=direct.name) == direct


def test_info_counts_a_huge_model_without_building_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import xmodlm.model as model

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("info built the model")

    monkeypatch.setattr(model, "Transformer", no_build)
    assert main(["info", "xmod-tiny", "--set", "model.vocab_size=2e9", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["params_total"] > 5e11 and info["gate_gamma_init"] is None


def test_eval_of_a_read_only_run_keeps_its_items_elsewhere(
    world: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = _copy_run(world["run"], tmp_path / "run")
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p).startswith(str(run))
                        else real(p, mode, **kw))  # a read-only file system under the run
    argv = ["eval", str(run), "--tasks", "cloze", "--max-items", "4", "--batches", "1", "--json"]
    assert main([*argv, "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert "cannot be written" in err and json.loads(out)["tasks"]["cloze"]["items"] == 4
    assert not (run / "eval_items").exists() or not any((run / "eval_items").iterdir())
