"""X-MoD's inference and step-time figures alone: ``python benchmarks/efficiency.py --out F``.

The decode section of ``xmod bench`` at its three decode sizes (X-MoD at S = 4
and 8 against FLOP-matched dense and dense of the same active depth, batch 1
and 8, at the process's thread count) and the width scan (one thread), without
the training-step rounds of every model at every size, which take most of a
full bench's half hour. The JSON carries the machine record (CPU, commit).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from xmodlm.bench import compile as bench_compile
from xmodlm.bench.decode import decode
from xmodlm.bench.run import DECODE_SIZES, MACHINE_KEYS
from xmodlm.bench.sizes import DEVICE_PEAK_N, family_configs, size_named
from xmodlm.bench.widths import width_scan
from xmodlm.hardware import environment_record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--no-widths", action="store_true")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        print(f"[efficiency] {msg}", file=sys.stderr, flush=True)

    result: dict = {"threads": torch.get_num_threads(), "load_avg_start": list(os.getloadavg()),
                    "decode": {}}
    for name in DECODE_SIZES:
        say(f"decode at {name}")
        result["decode"][name] = decode(family_configs(size_named(name).dense()), quick=False)
    if not args.no_widths:
        result["width_scan"] = width_scan(torch.device("cpu"), ("compiled_model",), False,
                                          DEVICE_PEAK_N["cpu"], say)
    bench_compile.reset()
    env = environment_record()
    result["machine"] = {k: env.get(k) for k in MACHINE_KEYS}
    result["load_avg_end"] = list(os.getloadavg())
    result["wall_s"] = time.perf_counter() - t0
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
