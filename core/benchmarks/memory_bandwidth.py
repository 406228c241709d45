"""How fast this machine's CPU streams memory: the physical limit of batch-1 decode.

``python -m engine.benchmarks.memory_bandwidth --threads 2`` times, with torch's intra-op
threads set to ``--threads``, a few ways of reading ``--megabytes`` of memory once (a float32
and a bfloat16 sum, and a bfloat16 matrix-vector product of an LM head's shape, 640 columns)
and prints the best of ``--repeats`` runs of each in GB/s. Batch-1 decode reads every weight
once per token, so bytes per token over the best rate is the fastest a token can be; compare
it with a measured tokens/s (docs/benchmarks.md does so for the embedded GGUF model).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence


def measure(megabytes: float, threads: int, repeats: int) -> dict[str, float]:
    """GB/s of each way of reading ``megabytes`` once, the best of ``repeats`` runs."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _measure(megabytes, repeats)
    finally:
        torch.set_num_threads(before)


def _measure(megabytes: float, repeats: int) -> dict[str, float]:
    import torch

    nbytes = int(megabytes * 1e6) // 1280 * 1280  # whole rows of 640 bfloat16 values
    f32 = torch.empty(nbytes // 4).normal_()
    bf16 = torch.empty(nbytes // 2, dtype=torch.bfloat16).normal_()
    matrix = bf16.view(-1, 640)
    vector = torch.randn(640, dtype=torch.bfloat16)
    cases: dict[str, Callable[[], object]] = {
        "float32 sum": f32.sum,
        "bfloat16 sum": bf16.sum,
        "bfloat16 matrix-vector": lambda: torch.mv(matrix, vector),
    }
    rates = {}
    for name, fn in cases.items():
        fn()  # warm-up
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        rates[name] = nbytes / best / 1e9
    return rates


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.benchmarks.memory_bandwidth")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--megabytes", type=float, default=250.0, help="bytes read per run")
    parser.add_argument("--repeats", type=int, default=7, help="runs of each; the best counts")
    args = parser.parse_args(argv)
    rates = measure(args.megabytes, args.threads, args.repeats)
    for name, rate in rates.items():
        print(f"{name}: {rate:.2f} GB/s")
    print(f"best: {max(rates.values()):.2f} GB/s ({args.threads} threads, {args.megabytes:g} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
