"""The continuation scorer and the lm-evaluation-harness adapter (offline)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_generate import FAMILIES, _model
from test_train import small_cfg
from xmodlm.data.tokenizer import Tokenizer
from xmodlm.errors import UserError
from xmodlm.eval.scoring import rolling_logprob, score_continuations
from xmodlm.eval.tasks import load_or_build_items, score_task, sequence_logprobs, wilson_interval
from xmodlm.model.generate import generate
from xmodlm.runs import load_run
from xmodlm.train.trainer import train


def _direct(model: torch.nn.Module, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """log p(cont | ctx) from one plain forward pass over ctx + cont (must fit the context)."""
    seq = torch.tensor([ctx + cont])
    with torch.no_grad():
        logits = model(seq[:, :-1], routing_mode="causal").logits[0].float()
    pred = logits[len(ctx) - 1:]
    target = seq[0, len(ctx):]
    lp = torch.log_softmax(pred, -1).gather(-1, target[:, None]).sum()
    return float(lp), bool((pred.argmax(-1) == target).all())


@pytest.mark.parametrize("family", ["dense", "xmod_bce", "moe"])
def test_score_matches_direct_forward(family: str) -> None:
    model = _model(**FAMILIES[family])
    g = torch.Generator().manual_seed(1)
    reqs = []
    for n_ctx, n_cont in [(1, 5), (7, 3), (20, 11), (3, 1), (31, 1)]:
        toks = torch.randint(0, 97, (n_ctx + n_cont,), generator=g).tolist()
        reqs.append((toks[:n_ctx], toks[n_ctx:]))
    got = score_continuations(model, reqs, batch_size=3)
    for (ctx, cont), (lp, greedy) in zip(reqs, got, strict=True):
        want_lp, want_greedy = _direct(model, ctx, cont)
        assert lp == pytest.approx(want_lp, abs=1e-4)
        assert greedy == want_greedy
    # padding next to longer rows changes nothing (causal routing looks only backwards)
    alone = [score_continuations(model, [r], batch_size=1)[0][0] for r in reqs]
    assert [lp for lp, _ in got] == pytest.approx(alone, abs=1e-4)


def test_greedy_flag_and_long_inputs() -> None:
    model = _model(**FAMILIES["xmod_bce"])
    ctx = [5, 6, 7]
    greedy_cont = generate(model, [ctx], 6, temperature=0)[0]
    lp, greedy = score_continuations(model, [(ctx, greedy_cont)])[0]
    assert greedy and lp < 0
    other = [(greedy_cont[0] + 1) % 97, *greedy_cont[1:]]
    assert score_continuations(model, [(ctx, other)])[0][1] is False
    assert score_continuations(model, [(ctx, [])])[0] == (0.0, True)

    # 3.5 contexts of tokens: scored in disjoint windows, each token once, the last
    # window with a full context (the harness's rolling convention)
    C = model.cfg.context
    doc = torch.randint(0, 97, (C * 3 + C // 2,), generator=torch.Generator().manual_seed(2)).tolist()
    seq = [0, *doc]
    want = 0.0
    for start in range(1, len(seq), C):
        end = min(start + C, len(seq))
        win = seq[max(0, end - C - 1): end]
        want += _direct(model, win[: len(win) - (end - start)], win[len(win) - (end - start):])[0]
    got = rolling_logprob(model, [doc, doc[:10]], bos_id=0, batch_size=2)
    assert got[0] == pytest.approx(want, abs=1e-3)
    assert got[1] == pytest.approx(_direct(model, [0], doc[:10])[0], abs=1e-4)


def test_score_bad_input() -> None:
    model = _model()
    with pytest.raises(UserError, match="empty context"):
        score_continuations(model, [([], [1, 2])])
    with pytest.raises(UserError, match="outside the vocabulary"):
        score_continuations(model, [([1], [500])])
    with pytest.raises(UserError, match="batch_size"):
        score_continuations(model, [([1], [2])], batch_size=0)


def test_wilson_interval() -> None:
    lo, hi = wilson_interval(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-3) and hi == pytest.approx(0.5962, abs=1e-3)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0


# ---------------------------------------------------------------- the harness adapter


@pytest.fixture(scope="module")
def harness_run(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("harnessrun") / "run"
    cfg = small_cfg(tiny_data_dir, "train.max_steps=10")
    train(cfg, run, progress=False)
    return run


def _instances(kind: str, args: list[tuple]) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_adapter_methods(harness_run: Path) -> None:
    pytest.importorskip("lm_eval")
    from xmodlm.eval.harness import XModLM

    lm = XModLM(run_dir=str(harness_run), batch_size=4)
    _, model, _ = load_run(harness_run)
    tok = Tokenizer.load(harness_run / "tokenizer.json")
    eot = tok.eot_id

    # loglikelihood: the trailing space of the context moves to the continuation
    pairs = [("The whale was", " a ship."), ("", "The sea is here."), ("He said", " the")]
    got = lm.loglikelihood(_instances("loglikelihood", pairs), disable_tqdm=True)
    want = score_continuations(model, [
        ([eot, *tok.encode("The whale was")], tok.encode("The whale was a ship.")[len(tok.encode("The whale was")):]),
        ([eot], tok.encode("The sea is here.")),
        ([eot, *tok.encode("He said")], tok.encode("He said the")[len(tok.encode("He said")):]),
    ])
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=1e-5)

    # rolling: the whole text's log-likelihood after <|endoftext|>, any length
    texts = ["The whale was a ship. " * 30, "Short one."]
    rolled = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(t,) for t in texts]))
    assert rolled == pytest.approx(sequence_logprobs(model, tok, texts), abs=1e-4)
    assert len(tok.encode(texts[0])) > 2 * model.cfg.context  # the windowed path ran

    # generate_until: greedy, cut at the first stop string
    reqs = [("The whale", {"until": ["."], "max_gen_toks": 12}),
            ("He said", {"until": ["."], "max_gen_toks": 12})]
    outs = lm.generate_until(_instances("generate_until", reqs))
    for (ctx, _), text in zip(reqs, outs, strict=True):
        new = generate(model, [[eot, *tok.encode(ctx)]], 12, temperature=0, eot_id=eot,
                       vocab_limit=tok.vocab_size)[0]
        full = tok.decode([t for t in new if t != eot])
        assert text == full.split(".")[0]
        assert "." not in text


def test_adapter_bad_input(tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    from xmodlm.eval.harness import XModLM, run_harness

    with pytest.raises(UserError, match="run_dir"):
        XModLM()
    with pytest.raises(UserError, match="not found"):
        XModLM(run_dir=str(tmp_path / "nope"))
    with pytest.raises(UserError, match="no tasks"):
        run_harness(tmp_path, [""])


def test_lm_eval_cli_offline(harness_run: Path, tiny_data_dir: Path, tmp_path: Path) -> None:
    """`xmod lm-eval` end to end through the harness, offline, on the project's own items.

    The harness's cloze and minimal-pair accuracies must equal ``xmod eval``'s on
    the same items: same tokens, same scorer, only the harness's bookkeeping between.
    """
    pytest.importorskip("lm_eval")
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_DATASETS_OFFLINE="1",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    out = tmp_path / "lm_eval.json"
    proc = subprocess.run(
        [sys.executable, "-m", "xmodlm", "lm-eval", str(harness_run), "--tasks",
         "xmod_cloze,xmod_minimal_pairs,xmod_cloze_gen,xmod_heldout", "--limit", "12",
         "--out", str(out), "--json"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(out.read_text())
    res = record["results"]
    assert set(res) == {"xmod_cloze", "xmod_minimal_pairs", "xmod_cloze_gen", "xmod_heldout"}
    assert json.loads(proc.stdout)["results"] == res

    _, model, _ = load_run(harness_run)
    tok = Tokenizer.load(harness_run / "tokenizer.json")
    items_dir = harness_run / "eval_items" / "harness" / "items"
    for task, name in (("cloze", "xmod_cloze"), ("minimal_pairs", "xmod_minimal_pairs")):
        items = load_or_build_items(task, tiny_data_dir, items_dir)[:12]
        ours = score_task(task, items, model, tok)
        assert res[name]["acc,none"] == pytest.approx(ours["accuracy"])
    assert 0.0 <= res["xmod_cloze_gen"]["exact_match,strip"] <= 1.0

    # bits per byte of the first 12 held-out documents, recomputed here
    docs = [json.loads(x)["text"] for x in
            (harness_run / "eval_items" / "harness" / "heldout.jsonl").read_text().splitlines()][:12]
    nats = sum(sequence_logprobs(model, tok, docs))
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    bpb = -nats / n_bytes / torch.log(torch.tensor(2.0)).item()
    assert res["xmod_heldout"]["bits_per_byte,none"] == pytest.approx(bpb, rel=1e-4)

    # an unknown task: one line, exit 2
    bad = subprocess.run(
        [sys.executable, "-m", "xmodlm", "lm-eval", str(harness_run), "--tasks", "xmod_nope"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert bad.returncode == 2 and "unknown lm-eval task 'xmod_nope'" in bad.stderr
    assert "Traceback" not in bad.stderr
