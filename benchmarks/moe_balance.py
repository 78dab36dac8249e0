"""Expert load of the fine-grained MoE with and without its balancing pieces.

How the defaults of ``model.moe_aux_coef`` and ``model.moe_bias_rate`` were chosen
(the paper gives neither; docs/architecture.md, "The MoE baseline"): a tiny MoE
(width 128, 4 layers, context 128, 64 routed experts of width 64, top 6, 2 shared,
the paper's shape at G = 8) trains ``--steps`` AdamW steps on the prepared corpus
for each (aux coefficient, bias rate) pair, calling ``after_optimizer_step`` after
every step as the trainer does. Reported per pair: the training expert load
(max / mean assignments of a layer's experts, per step, averaged over the last
quarter of the steps; mean over layers and the worst layer), the held-out
expert load and loss on fixed validation batches. One JSON line per pair.
``python benchmarks/moe_balance.py --data DIR [--steps 200] [--pairs 0,0 1e-2,1e-3 ...]``
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from xmodlm.config import ModelConfig, TrainConfig
from xmodlm.data.batches import get_batch, load_manifest, load_split, val_batches
from xmodlm.eval.loss import evaluate
from xmodlm.model import Transformer
from xmodlm.train.optim import build_optimizer

PAIRS = ("0,0", "1e-2,0", "0,1e-3", "1e-3,1e-3", "1e-2,1e-3", "1e-2,1e-2")


def run(data_dir: str, aux: float, rate: float, steps: int, seed: int) -> dict[str, object]:
    """Train one tiny fine-grained MoE and summarise its expert load."""
    vocab = load_manifest(data_dir)["vocab_size"]
    cfg = ModelConfig(vocab_size=vocab, d_model=128, n_layers=4, n_heads=4, d_ff=512,
                      context=128, mlp="moe", moe_router="fine", n_experts=64, moe_top_k=6,
                      moe_shared=2, moe_granularity=8, moe_aux_coef=aux, moe_bias_rate=rate)
    cfg.validate()
    torch.manual_seed(seed)
    model = Transformer(cfg)
    train_cfg = TrainConfig(lr=3e-3)
    opt = build_optimizer(model, train_cfg)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))))
    train = load_split(data_dir, "train")
    loads: list[list[float]] = []
    t0 = time.perf_counter()
    for step in range(steps):
        x, y = get_batch(train, 8, cfg.context, seed, step)
        out = model(x, y, return_stats=True)
        out.total_loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        model.after_optimizer_step()
        loads.append(out.stats["expert_load_max_over_mean"])
    tail = loads[-max(1, steps // 4):]
    per_layer = [statistics.mean(step[i] for step in tail) for i in range(cfg.n_layers)]
    ev = evaluate(model, val_batches(load_split(data_dir, "val"), 8, 8, cfg.context),
                  torch.device("cpu"), "fp32")
    return {
        "aux_coef": aux, "bias_rate": rate, "steps": steps, "seed": seed,
        "train_load_max_over_mean": round(statistics.mean(per_layer), 3),
        "train_load_worst_layer": round(max(per_layer), 3),
        "val_load_max_over_mean": [round(v, 3) for v in ev["expert_load_max_over_mean"]],
        "val_loss": round(ev["val_loss_topk"], 4),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a prepared corpus (xmod data prepare)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pairs", nargs="+", default=list(PAIRS), help="aux_coef,bias_rate")
    parser.add_argument("--threads", type=int, default=1, help="1: steadier on a shared CPU")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for pair in args.pairs:
        aux, rate = (float(v) for v in pair.split(","))
        print(json.dumps(run(args.data, aux, rate, args.steps, args.seed)), flush=True)


if __name__ == "__main__":
    main()
