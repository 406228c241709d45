"""``engine bench latency``: decode speed at fixed batch sizes, like ``vllm bench latency``.

For each batch size ``B`` in ``--batch-sizes``: ``B`` random prompts of ``--input-len`` tokens
generate ``--output-len`` tokens each (greedy, ``ignore_eos``), ``--num-iters`` times. Reported
per batch size: the median end-to-end seconds, output tokens/s (``B * output_len / seconds``,
prefill included, as the vLLM peer measures), the prefill time (the same batch with one new
token) and the per-step decode time ``(seconds - prefill) / (output_len - 1)``. With a
multi-process executor (``--tensor-parallel-size``/``--pipeline-parallel-size`` > 1, or
``--distributed-executor-backend mp``) also each worker's time per step and the share of it
spent in collectives (timed on the workers during the timed runs; on a GPU only eager steps
are timed: run with ``--enforce-eager`` for the split).

Batch-1 decode as measured against vLLM::

    engine bench latency --model llama-3.1-8b --load-format dummy --batch-sizes 1 \\
        --input-len 128 --output-len 512 --seed 3

Speculative decoding: with ``--speculative-config`` the table adds the acceptance rate and
the mean acceptance length (tokens per verified draft, the target's own included).
``--self-continuation`` makes every prompt contain the model's own greedy continuation: the
random prompt is extended once by ``--output-len`` greedy tokens, and the timed runs continue
from there. With vLLM's dummy weights (``--model-loader-extra-config '{"dummy_init":
"uniform"}'``) the greedy output settles on one repeated token, which a prompt lookup then
drafts correctly, so the mechanism is measured near full acceptance (the default
normal(0, 0.02) weights give output that does not repeat: nothing to draft). Run the same
command without ``--speculative-config`` for the baseline on the very same prompts.
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
    memory_report,
    run_and_release,
    write_json,
)
from engine.benchmarks.workload import random_workload, warmup_workload
from engine.spec_decode.stats import acceptance_summary


class CollectiveTotals:
    """The workers' time in steps and in collectives over the timed runs (rank 0's, the
    slowest rank's collectives, and the per-op split), for multi-process executors."""

    def __init__(self, llm: object) -> None:
        self.executor = llm.llm_engine.runner  # type: ignore[attr-defined]
        self.step_s = 0.0
        self.per_rank: list[float] = []
        self.ops: dict[str, float] = {}

    def start(self) -> None:
        self.executor.collective_rpc("time_collectives", True)

    def stop(self) -> None:
        stats = self.executor.collective_rpc("collective_stats")
        self.executor.collective_rpc("time_collectives", False)
        self.step_s += stats[0]["step_seconds"]
        totals = [sum(v["seconds"] for k, v in r.items() if k != "step_seconds") for r in stats]
        if not self.per_rank:
            self.per_rank = [0.0] * len(totals)
        self.per_rank = [a + b for a, b in zip(self.per_rank, totals, strict=True)]
        for op, v in stats[0].items():
            if op != "step_seconds":
                self.ops[op] = self.ops.get(op, 0.0) + v["seconds"]

    def summary(self, steps: int) -> dict[str, object]:
        comm = self.per_rank[0] if self.per_rank else 0.0
        return {
            "worker_step_ms": round(1e3 * self.step_s / steps, 3),
            "collective_ms_per_step": round(1e3 * comm / steps, 3),
            "share_of_worker_step": round(comm / self.step_s, 4) if self.step_s else 0.0,
            "collective_ms_per_step_by_rank": [round(1e3 * c / steps, 3) for c in self.per_rank],
            "rank0_ms_per_step_by_op": {k: round(1e3 * v / steps, 3) for k, v in self.ops.items()},
        }


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``engine bench latency``."""
    add_common_args(parser)
    parser.add_argument(
        "--batch-sizes", default="1", help="Comma-separated batch sizes (default: %(default)s)."
    )
    parser.add_argument("--input-len", type=int, default=128, help="Prompt tokens.")
    parser.add_argument("--output-len", type=int, default=512, help="New tokens per request.")
    parser.add_argument("--num-iters", type=int, default=3, help="Timed runs per batch size.")
    parser.add_argument(
        "--self-continuation",
        action="store_true",
        help="Prompts end with the model's own greedy continuation of --output-len tokens "
        "(copy-heavy inputs for speculative decoding; see the module docs).",
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark for parsed flags; prints a table and optionally writes JSON."""
    sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]
    if not sizes or min(sizes) < 1 or args.output_len < 2:
        raise SystemExit("--batch-sizes needs positive integers and --output-len >= 2")
    llm, ready_s = build_llm(args)
    vocab = llm.llm_engine.vocab_size
    print(f"engine ready in {ready_s:.1f} s", flush=True)
    loras = args.lora_requests
    warm = warmup_workload(vocab)
    generate(llm, warm.prompts, warm.output_lens, loras)
    counter = _StepCounter(llm.llm_engine)
    rows = []
    # Multi-process executors: time the workers' collectives during the timed runs.
    workers = getattr(llm.llm_engine.runner, "workers", None)
    header = f"{'batch':>5} {'seconds':>8} {'out tok/s':>10} {'prefill ms':>10} {'step ms':>8}"
    if llm.llm_engine.config.speculative is not None:
        header += f" {'accept':>8} {'mean len':>8} {'tok/step':>8}"
    if workers:
        header += f" {'worker ms':>9} {'comm ms':>8} {'comm %':>6}"
    print(header)
    for batch in sizes:
        work = random_workload(
            batch, (args.input_len,) * 2, (args.output_len,) * 2, vocab, args.seed
        )
        if getattr(args, "self_continuation", False):
            outs, _ = generate(llm, work.prompts, work.output_lens)
            work.prompts = [
                p + list(o.outputs[0].token_ids) for p, o in zip(work.prompts, outs, strict=True)
            ]
        spec_before = llm.llm_engine.get_stats().spec_decoding
        # The prompts repeat across runs: without prefix caching off, later runs would skip
        # the prefill. Each run gets a fresh first token so nothing is reused.
        times, prefills, decode_steps = [], [], []
        comm = CollectiveTotals(llm) if workers else None
        timed_steps = 0
        for it in range(args.num_iters + 1):
            prompts = [
                [10 + (it * 7919 + i) % (vocab - 20)] + p[1:] for i, p in enumerate(work.prompts)
            ]
            steps_before = counter.steps
            _, pre = generate(llm, prompts, [1] * batch, loras)
            pre_steps = counter.steps - steps_before
            prompts = [
                [10 + (it * 7919 + i + batch) % (vocab - 20)] + p[1:]
                for i, p in enumerate(work.prompts)
            ]
            steps_before = counter.steps
            if comm is not None and it:
                comm.start()
            outs, sec = generate(llm, prompts, work.output_lens, loras)
            if comm is not None and it:
                comm.stop()
            if it:  # the first run warms this batch size up
                times.append(sec)
                prefills.append(pre)
                decode_steps.append(counter.steps - steps_before - pre_steps)
                timed_steps += counter.steps - steps_before
        sec, pre = statistics.median(times), statistics.median(prefills)
        steps = max(1, int(statistics.median(decode_steps)))
        tokens = batch * args.output_len
        row = {
            "batch_size": batch,
            "seconds": round(sec, 4),
            "output_tokens_per_s": round(tokens / sec, 1),
            "prefill_ms": round(1e3 * pre, 2),
            # Per engine step after the prefill (one token per sequence without speculation).
            "decode_step_ms": round(1e3 * (sec - pre) / steps, 3),
            "decode_steps": steps,
            "tokens_per_step": round((args.output_len - 1) / steps, 3),
            "decode_tokens_per_s": round(batch * (args.output_len - 1) / (sec - pre), 1),
            "runs_s": [round(t, 4) for t in times],
        }
        spec = llm.llm_engine.get_stats().spec_decoding
        if spec is not None:
            row.update(acceptance_summary(spec, spec_before))
        line = (
            f"{batch:>5} {sec:>8.3f} {row['output_tokens_per_s']:>10.1f} "
            f"{row['prefill_ms']:>10.2f} {row['decode_step_ms']:>8.3f}"
        )
        if "acceptance_rate" in row:
            line += (
                f" {row['acceptance_rate']:>8.3f} {row['mean_acceptance_length']:>8.2f} "
                f"{row['tokens_per_step']:>8.2f}"
            )
        if comm is not None:
            # Per engine step of the timed runs (prefill included; fewer with speculation).
            row["collectives"] = comm.summary(max(1, timed_steps))
            c = row["collectives"]
            line += (
                f" {c['worker_step_ms']:>9.3f} {c['collective_ms_per_step']:>8.3f} "
                f"{100 * c['share_of_worker_step']:>5.1f}%"
            )
        rows.append(row)
        print(line, flush=True)
    write_json(
        args.json,
        {
            "benchmark": "latency",
            "model": args.model,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "seed": args.seed,
            "self_continuation": bool(getattr(args, "self_continuation", False)),
            "speculative_config": (
                None
                if llm.llm_engine.config.speculative is None
                else vars(llm.llm_engine.config.speculative)
            ),
            "num_loras": args.num_loras,
            "lora_rank": args.lora_rank if args.num_loras else None,
            "start_to_ready_s": round(ready_s, 2),
            "results": rows,
            "settings": engine_settings(llm),
            "memory": memory_report(llm),
            "hardware": hardware(),
        },
    )
    return 0


class _StepCounter:
    """Counts the engine's steps (a speculative step yields several tokens per sequence)."""

    def __init__(self, engine) -> None:
        self.steps = 0
        step = engine.step

        def counted():
            self.steps += 1
            return step()

        engine.step = counted


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m engine.benchmarks.latency ...``"""
    parser = argparse.ArgumentParser(
        prog="engine bench latency", description=__doc__.split("\n\n")[0]
    )
    add_cli_args(parser)
    return run_and_release(run, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
