"""Microbenchmark of ``engine.sampler.Sampler.sample``.

``python -m engine.benchmarks.sampler --rows 256 --vocab 32000 --device cpu`` times an
all-greedy batch and a mixed batch (greedy, random, seeded, top-k/top-p/min-p, penalties,
logprobs) and prints the median milliseconds per call.
"""

from __future__ import annotations

import argparse
import statistics
import time


def _mixed_rows(num_rows: int, vocab: int, sampler, prompt_len: int, output_len: int):
    import random

    from engine.sampler import SamplingRow
    from engine.sampling_params import SamplingParams

    rng = random.Random(0)
    rows = []
    for i in range(num_rows):
        kind = i % 4
        if kind == 0:
            params = SamplingParams(temperature=0.0)
        elif kind == 1:
            params = SamplingParams(temperature=0.8, top_p=0.95, top_k=50)
        elif kind == 2:
            params = SamplingParams(temperature=1.0, min_p=0.05, seed=i, logprobs=5)
        else:
            params = SamplingParams(
                temperature=0.7, repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1
            )
        gens = [sampler.make_generator(params.seed) if params.seed is not None else None]
        rows.append(
            SamplingRow(
                params=params,
                prompt_token_ids=[rng.randrange(vocab) for _ in range(prompt_len)],
                output_token_ids=[rng.randrange(vocab) for _ in range(output_len)],
                generators=gens,
                eos_token_ids=[2],
            )
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print one line per scenario."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    args = parser.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    from engine.sampler import Sampler, SamplingRow
    from engine.sampling_params import SamplingParams

    device = torch.device(args.device)
    sampler = Sampler(args.vocab, device)
    logits = torch.randn(args.rows, args.vocab, device=device) * 3
    greedy = [
        SamplingRow(SamplingParams(temperature=0.0), [1, 2, 3], [4], [None])
        for _ in range(args.rows)
    ]
    mixed = _mixed_rows(args.rows, args.vocab, sampler, args.prompt_len, args.output_len)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for name, rows in (("greedy", greedy), ("mixed", mixed)):
        times = []
        for _ in range(args.iters + 2):
            x = logits.clone()
            sync()
            start = time.perf_counter()
            sampler.sample(x, rows)
            sync()
            times.append(time.perf_counter() - start)
        ms = statistics.median(times[2:]) * 1e3
        print(f"{name:7s} rows={args.rows} vocab={args.vocab} device={device}: {ms:.2f} ms/step")


if __name__ == "__main__":
    main()
