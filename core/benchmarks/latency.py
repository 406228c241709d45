"""``engine bench latency``: decode speed at fixed batch sizes, like ``vllm bench latency``.

For each batch size ``B`` in ``--batch-sizes``: ``B`` random prompts of ``--input-len`` tokens
generate ``--output-len`` tokens each (greedy, ``ignore_eos``), ``--num-iters`` times. Reported
per batch size: the median end-to-end seconds, output tokens/s (``B * output_len / seconds``,
prefill included, as the vLLM peer measures), the prefill time (the same batch with one new
token) and the per-step decode time ``(seconds - prefill) / (output_len - 1)``.

Batch-1 decode as measured against vLLM::

    engine bench latency --model llama-3.1-8b --load-format dummy --batch-sizes 1 \\
        --input-len 128 --output-len 512 --seed 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence

from engine.benchmarks.common import (
    add_common_args,
    build_llm,
    engine_settings,
    generate,
    hardware,
    write_json,
)
from engine.benchmarks.workload import random_workload, warmup_workload


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``engine bench latency``."""
    add_common_args(parser)
    parser.add_argument(
        "--batch-sizes", default="1", help="Comma-separated batch sizes (default: %(default)s)."
    )
    parser.add_argument("--input-len", type=int, default=128, help="Prompt tokens.")
    parser.add_argument("--output-len", type=int, default=512, help="New tokens per request.")
    parser.add_argument("--num-iters", type=int, default=3, help="Timed runs per batch size.")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark for parsed flags; prints a table and optionally writes JSON."""
    sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]
    if not sizes or min(sizes) < 1 or args.output_len < 2:
        raise SystemExit("--batch-sizes needs positive integers and --output-len >= 2")
    llm, ready_s = build_llm(args)
    vocab = llm.llm_engine.vocab_size
    print(f"engine ready in {ready_s:.1f} s", flush=True)
    warm = warmup_workload(vocab)
    generate(llm, warm.prompts, warm.output_lens)
    rows = []
    print(f"{'batch':>5} {'seconds':>8} {'out tok/s':>10} {'prefill ms':>10} {'step ms':>8}")
    for batch in sizes:
        work = random_workload(
            batch, (args.input_len,) * 2, (args.output_len,) * 2, vocab, args.seed
        )
        # The prompts repeat across runs: without prefix caching off, later runs would skip
        # the prefill. Each run gets a fresh first token so nothing is reused.
        times, prefills = [], []
        for it in range(args.num_iters + 1):
            prompts = [
                [10 + (it * 7919 + i) % (vocab - 20)] + p[1:] for i, p in enumerate(work.prompts)
            ]
            _, pre = generate(llm, prompts, [1] * batch)
            prompts = [
                [10 + (it * 7919 + i + batch) % (vocab - 20)] + p[1:]
                for i, p in enumerate(work.prompts)
            ]
            outs, sec = generate(llm, prompts, work.output_lens)
            if it:  # the first run warms this batch size up
                times.append(sec)
                prefills.append(pre)
        sec, pre = statistics.median(times), statistics.median(prefills)
        tokens = batch * args.output_len
        row = {
            "batch_size": batch,
            "seconds": round(sec, 4),
            "output_tokens_per_s": round(tokens / sec, 1),
            "prefill_ms": round(1e3 * pre, 2),
            "decode_step_ms": round(1e3 * (sec - pre) / (args.output_len - 1), 3),
            "decode_tokens_per_s": round(batch * (args.output_len - 1) / (sec - pre), 1),
            "runs_s": [round(t, 4) for t in times],
        }
        rows.append(row)
        print(
            f"{batch:>5} {sec:>8.3f} {row['output_tokens_per_s']:>10.1f} "
            f"{row['prefill_ms']:>10.2f} {row['decode_step_ms']:>8.3f}",
            flush=True,
        )
    write_json(
        args.json,
        {
            "benchmark": "latency",
            "model": args.model,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "seed": args.seed,
            "start_to_ready_s": round(ready_s, 2),
            "results": rows,
            "settings": engine_settings(llm),
            "hardware": hardware(),
        },
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m engine.benchmarks.latency ...``"""
    parser = argparse.ArgumentParser(
        prog="engine bench latency", description=__doc__.split("\n\n")[0]
    )
    add_cli_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
