"""Greedy decoding of an exported model through ``transformers``: with the sparse
KV cache, without it, and ``xmod generate``'s decoder, side by side in one run.

    python benchmarks/hf_generate.py [--tokens 200] [--threads 1]

The model is X-MoD (stride 4, c = 0.125, width 256, 8 blocks, context 512) at its
initialisation, thresholds calibrated on random tokens, so that its sparse
blocks route about c of the tokens as a trained model's do. Each timing is the
best of two; the three must give the same tokens. docs/export.md quotes it.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable

import torch

from xmodlm.config import ModelConfig
from xmodlm.export import transformers_model
from xmodlm.model import Transformer
from xmodlm.model.generate import generate


def best_of(n: int, fn: Callable[[], list[int]]) -> tuple[float, list[int]]:
    best, out = float("inf"), []
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=200, help="new tokens to generate")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = ModelConfig(vocab_size=4096, d_model=256, n_layers=8, n_heads=4, context=512,
                      stride=4, capacity=0.125)
    cfg.validate()
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    model.calibrate_thresholds_(torch.randint(0, cfg.vocab_size, (4, cfg.context)))
    hf = transformers_model(model)
    prompt = torch.randint(0, cfg.vocab_size, (1, 10))
    n = args.tokens

    def through_hf(use_cache: bool) -> list[int]:
        out = hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          use_cache=use_cache, eos_token_id=None, pad_token_id=0)
        return out[0, prompt.shape[1]:].tolist()

    rows = {
        "xmod generate": best_of(2, lambda: generate(model, prompt.tolist(), n, temperature=0)[0]),
        "transformers, cache": best_of(2, lambda: through_hf(True)),
        "transformers, no cache": best_of(2, lambda: through_hf(False)),
    }
    want = rows["xmod generate"][1]
    print(f"{cfg.block_layout}, width {cfg.d_model}, c = {cfg.capacity}; {n} new tokens,"
          f" batch 1, {args.threads} thread(s), {platform.processor() or platform.machine()}")
    for name, (seconds, tokens) in rows.items():
        ratio = seconds / rows["transformers, cache"][0]
        print(f"{name:24s} {seconds:6.2f} s  {n / seconds:6.0f} tokens/s  {ratio:5.2f}x"
              f"  same tokens: {tokens == want}")


if __name__ == "__main__":
    main()
