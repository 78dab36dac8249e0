"""Evaluation of a trained run: losses, routing stats, downstream tasks, routing pictures."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from test_train import small_cfg
from xmodlm import flops
from xmodlm.errors import UserError
from xmodlm.eval import evaluate_run
from xmodlm.eval.tasks import (
    build_cloze,
    build_minimal_pairs,
    flip_agreement,
    load_documents,
    swap_adjacent,
    wrong_determiner,
)
from xmodlm.train.trainer import train


@pytest.fixture(scope="module")
def tiny_run(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("evalrun") / "run"
    cfg = small_cfg(tiny_data_dir, "train.max_steps=12", "train.eval_every=6")
    train(cfg, run, progress=False)
    return run


def test_corruptions() -> None:
    rng = random.Random(0)
    assert flip_agreement("The men were here.") == "The men was here."
    assert flip_agreement("Is it so?") == "Are it so?"
    assert flip_agreement("No verb here.") is None
    assert wrong_determiner("He saw a ship.") == "He saw an ship."
    assert wrong_determiner("An apple fell.") == "A apple fell."
    assert wrong_determiner("He ate a apple.") is None  # already wrong: not a pair
    assert wrong_determiner("The sea.") is None
    swapped = swap_adjacent("The whale saw the ship.", rng)
    assert swapped is not None and swapped != "The whale saw the ship."
    assert sorted(swapped.lower().split()) == sorted("the whale saw the ship.".split())
    assert swap_adjacent("Whale whale.", rng) is None
    assert swap_adjacent("The whale.", rng) is None  # "whale." is not a bare word


def test_items_deterministic(tiny_data_dir: Path) -> None:
    docs = load_documents(tiny_data_dir, "test")
    a, b = build_cloze(docs, seed=3, max_items=20), build_cloze(docs, seed=3, max_items=20)
    assert a == b and 0 < len(a) <= 20
    for it in a:
        assert len(it["candidates"]) == 4 and len(set(it["candidates"])) == 4
        assert it["candidates"][it["answer"]] == it["prefix"] + it["word"] + "."
    assert build_cloze(docs, seed=4, max_items=20) != a
    p = build_minimal_pairs(docs, seed=3, max_items=20)
    assert p == build_minimal_pairs(docs, seed=3, max_items=20) and p
    assert all(it["good"] != it["bad"] for it in p)


def test_evaluate_run(tiny_run: Path, tmp_path: Path) -> None:
    items = tmp_path / "items"
    res = evaluate_run(tiny_run, max_batches=2, max_items=12, items_dir=items)
    for key in ("val_loss_topk", "val_loss_causal", "val_bpb"):
        assert 0 < res[key] < 10, (key, res[key])
    assert 0 <= res["routing_agreement"] <= 1
    assert len(res["capacity_causal"]) == 2 and all(0 <= c <= 1 for c in res["capacity_causal"])
    assert set(res["tasks"]) == {"cloze", "minimal_pairs"}
    assert res["tasks"]["cloze"]["chance"] == 0.25 and res["tasks"]["minimal_pairs"]["chance"] == 0.5
    for task in res["tasks"].values():
        assert 0 <= task["accuracy"] <= 1 and 0 < task["items"] <= 12
    json.dumps(res)  # JSON-able for `xmod eval --json`
    # KV bytes per token: dense blocks cache every token, sparse ones their routed share
    from xmodlm.runs import load_run

    cfg = load_run(tiny_run)[0].model
    token_bytes = 2 * cfg.d_model * 4  # key and value, fp32
    n_dense = cfg.block_layout.count("D")
    routed = sum(res["capacity_causal"]) / len(res["capacity_causal"])
    assert res["kv_bytes_per_token"] >= n_dense * token_bytes
    assert res["kv_fraction"] == pytest.approx(res["kv_bytes_per_token"] / (token_bytes * cfg.n_layers))
    assert res["kv_fraction"] < 1 or routed == 1
    saved = (items / "cloze.jsonl").read_text()
    assert (items / "minimal_pairs.jsonl").is_file()
    again = evaluate_run(tiny_run, max_batches=1, max_items=12, items_dir=items, tasks=["cloze"])
    assert (items / "cloze.jsonl").read_text() == saved
    assert again["tasks"]["cloze"] == res["tasks"]["cloze"]


def test_evaluate_errors(tiny_run: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="unknown task 'squad'"):
        evaluate_run(tiny_run, tasks=["squad"])
    with pytest.raises(UserError, match="not found"):
        evaluate_run(tmp_path / "nope")
    with pytest.raises(UserError, match="unknown split"):
        evaluate_run(tiny_run, split="dev", tasks=())


def test_data_of_another_tokenizer_is_refused(
    tiny_run: Path, tiny_data_dir: Path, tmp_path: Path
) -> None:
    """Same texts, another tokenizer (a smaller vocabulary, so the size check passes):
    the token ids would mean other tokens, so evaluation refuses and names the fix."""
    from xmodlm.data.prepare import prepare

    texts = sorted((tiny_data_dir.parent / "src").glob("*.txt"))
    other = prepare(tmp_path / "other", vocab_size=280, texts=texts)
    assert other["vocab_size"] <= 300
    with pytest.raises(UserError, match="another tokenizer.*data prepare --tokenizer"):
        evaluate_run(tiny_run, data_dir=tmp_path / "other", tasks=())


def test_evaluate_bad_data_and_mismatched_checkpoint(
    tiny_run: Path, tiny_data_dir: Path, tmp_path: Path
) -> None:
    """A too-short or empty test split and a config that does not fit the weights: one line each."""
    import shutil

    import numpy as np
    import yaml

    short = tmp_path / "short"
    shutil.copytree(tiny_data_dir, short)
    np.arange(10, dtype=np.uint16).tofile(short / "test.bin")
    with pytest.raises(UserError, match="holds 10 tokens but manifest.json says"):
        evaluate_run(tiny_run, data_dir=short, tasks=())
    manifest = json.loads((short / "manifest.json").read_text())
    manifest["splits"]["test"]["tokens"] = 10
    (short / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="fewer than context"):
        evaluate_run(tiny_run, data_dir=short, tasks=())
    (short / "test_docs.jsonl").write_text("")
    shutil.copy(tiny_data_dir / "test.bin", short / "test.bin")
    shutil.copy(tiny_data_dir / "manifest.json", short / "manifest.json")
    with pytest.raises(UserError, match="no sentences usable for task 'cloze'"):
        evaluate_run(tiny_run, data_dir=short, tasks=["cloze"], max_batches=1)

    other = tmp_path / "other"
    shutil.copytree(tiny_run, other)
    cfg = yaml.safe_load((other / "config.yaml").read_text())
    cfg["model"]["d_model"] *= 2
    (other / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(UserError, match="does not match the run's configuration") as err:
        evaluate_run(other, tasks=())
    assert "\n" not in str(err.value)


def test_show_routing_and_training_plots(tiny_run: Path, tmp_path: Path) -> None:
    from xmodlm.report.routing_plots import plot_training, show_routing

    png, page = tmp_path / "r.png", tmp_path / "r.html"
    info = show_routing(tiny_run, "The whale <b> saw the ship.", png, page)
    assert png.stat().st_size > 1000
    html = page.read_text()
    assert "<html" in html and "&lt;" in html and "<span" in html
    assert len(info["tokens"]) == len(info["depth"]) > 0
    assert all(0 <= d <= info["n_sparse"] for d in info["depth"])
    paths = plot_training(tiny_run, tmp_path / "plots")
    assert paths and all(Path(p).stat().st_size > 1000 for p in paths)


def test_decode_runs_side_by_side(tiny_run: Path, tiny_data_dir: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """xmod bench --decode-runs: trained runs decode real test prompts in turns; KV bytes
    are what each model cached (a dense run caches every token in every block)."""
    from xmodlm.cli import main

    dense = tmp_path / "dense"
    train(small_cfg(tiny_data_dir, "train.max_steps=4", "model.stride=1", "model.capacity=1.0"),
          dense, progress=False)
    assert main(["bench", "--decode-runs", f"{dense},{tiny_run}", "--reps", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    d, x = out["runs"][str(dense)], out["runs"][str(tiny_run)]
    assert d["family"] == "dense" and x["family"] == "xmod" and out["rounds"] == 2
    assert x["threshold_rule"] == "calibrated" and d["threshold_rule"] is None
    assert out["machine"]["git_commit"] and out["command"].startswith("xmod bench --decode-runs")
    half = 16  # context 32
    assert d["prompt_len"] == x["prompt_len"] == half
    assert d["kv_bytes_used"] == 4 * 2 * half * 2 * 32 * 4  # blocks x tokens x (k, v) x width x fp32
    assert x["kv_bytes_used"] < d["kv_bytes_used"] or x["routed_fraction"] == 1
    assert x["kv_bytes_vs_first"] == pytest.approx(x["kv_bytes_used"] / d["kv_bytes_used"])
    assert d["tokens_per_s"] > 0 and d["tokens_per_s_vs_first"] == 1.0
    assert main(["bench", "--decode-runs", str(dense)]) == 2
    assert main(["bench", "--decode-runs", f"{dense},{tmp_path / 'none'}"]) == 2


def test_training_calibrates_and_eval_reports_both_rules(tiny_run: Path, tmp_path: Path) -> None:
    """The trained run's checkpoint carries calibrated thresholds; eval reports the
    rule in effect beside the half rule, with FLOPs against the budget and KV
    bytes against the ideal; `xmod calibrate` restores thresholds a run lost."""
    import shutil

    from xmodlm.eval.calibrate import calibrate_run
    from xmodlm.flops import kv_bytes_formula
    from xmodlm.runs import checkpoint_dirs, load_run, rewrite_model_weights

    cfg, model, _ = load_run(tiny_run)
    assert model.threshold_rule() == "calibrated"
    res = evaluate_run(tiny_run, max_batches=2, tasks=())
    assert res["threshold_rule"] == "calibrated" and res["threshold_source"] == "checkpoint"
    assert res["test_loss_causal_half"] == res["val_loss_causal_half"] > 0
    assert len(res["capacity_causal_half"]) == len(res["capacity_causal"]) == 2
    fl = res["flops_per_token"]
    assert fl["budget"] == flops.count(cfg.model).flops_forward
    assert fl["causal"] == flops.inference_flops(cfg.model, res["capacity_causal"])
    assert fl["causal_over_budget"] == pytest.approx(fl["causal"] / fl["budget"])
    assert res["kv_bytes_ideal"] == kv_bytes_formula(cfg.model, 1)
    assert res["kv_over_ideal"] == pytest.approx(res["kv_bytes_per_token"] / res["kv_bytes_ideal"])
    # a run whose checkpoint lost its thresholds: eval calibrates in memory, the same way
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    ckpt = checkpoint_dirs(run)[-1]
    for block in model.routed_blocks():
        block.router.threshold.zero_()
        block.router.calibrated.zero_()
    rewrite_model_weights(ckpt, model)
    assert load_run(run)[1].threshold_rule() == "half (not calibrated)"
    lost = evaluate_run(run, max_batches=2, tasks=())
    assert lost["threshold_source"].startswith("calibrated here")
    assert lost["val_loss_causal"] == res["val_loss_causal"]
    record = calibrate_run(run)
    assert record["rule_before"] == "half (not calibrated)" and record["rule"] == "calibrated"
    assert (run / "calibration.json").is_file()
    again = evaluate_run(run, max_batches=2, tasks=())
    assert again["threshold_source"] == "checkpoint"
    assert again["val_loss_causal"] == res["val_loss_causal"]
