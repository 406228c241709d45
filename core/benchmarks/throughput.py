"""``engine bench throughput``: offline throughput on a random workload, like
``vllm bench throughput --dataset-name random``.

Every request is submitted at once through ``engine.llm.LLM.generate`` (token-id prompts,
greedy, ``ignore_eos``, each request's own output length) and the run is timed end to end.
Prints requests/s, total tokens/s and output tokens/s; ``--json FILE`` also records the
settings, the start-to-ready time and a per-step split of wall time into GPU span and host-only
time (see ``engine.benchmarks.step_profile``).

nano-vllm's benchmark on the Qwen3-0.6B shape::

    engine bench throughput --model qwen3-0.6b --load-format dummy --num-prompts 256 \\
        --min-input-len 100 --max-input-len 1024 --min-output-len 100 --max-output-len 1024
"""

from __future__ import annotations

import argparse
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
from engine.benchmarks.workload import (
    WORKLOADS,
    length_range,
    named_workload,
    random_workload,
    warmup_workload,
)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``engine bench throughput``."""
    add_common_args(parser)
    w = parser.add_argument_group("workload (random token ids)")
    w.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="random",
        help="random: lengths from the flags below; mixed: chat / long-context / generation "
        "requests (engine.benchmarks.workload.MIXED_KINDS); shared-prefix: every request "
        "behind one 2,000-token system prompt, 64-512 own prompt tokens and 64-384 out "
        "(default: %(default)s).",
    )
    w.add_argument("--num-prompts", type=int, default=1000, help="Requests (default: %(default)s).")
    w.add_argument(
        "--input-len", type=int, default=1024, help="Prompt tokens (default: %(default)s)."
    )
    w.add_argument("--output-len", type=int, default=128, help="New tokens (default: %(default)s).")
    w.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="Draw lengths uniformly in [len*(1-r), len*(1+r)], as vLLM (default: %(default)s).",
    )
    for kind in ("input", "output"):
        w.add_argument(f"--min-{kind}-len", type=int, default=None, help=f"Explicit {kind} range.")
        w.add_argument(f"--max-{kind}-len", type=int, default=None, help=f"Explicit {kind} range.")
    w.add_argument("--no-warmup", action="store_true", help="Skip the untimed warm-up requests.")
    parser.add_argument(
        "--engine-core-process",
        action="store_true",
        help="Run the engine core in a process of its own, behind the same ZMQ client as "
        "engine serve (default: in this process, as LLM does; always with "
        "--data-parallel-size > 1).",
    )
    parser.add_argument(
        "--expert-load",
        action="store_true",
        help="MoE models: count the tokens routed to each expert of every layer during the run "
        "and report the imbalance (adds a few device ops per layer and step).",
    )


def _range(args: argparse.Namespace, kind: str) -> tuple[int, int]:
    lo, hi = getattr(args, f"min_{kind}_len"), getattr(args, f"max_{kind}_len")
    if lo is None and hi is None:
        return length_range(getattr(args, f"{kind}_len"), args.random_range_ratio)
    if lo is None or hi is None or not 1 <= lo <= hi:
        raise SystemExit(f"--min-{kind}-len and --max-{kind}-len go together, 1 <= min <= max")
    return lo, hi


def run(args: argparse.Namespace) -> int:
    """Run the benchmark for parsed flags; prints and optionally writes the results."""
    from engine.benchmarks.step_profile import StepProfiler, TritonCompileWatch

    input_range, output_range = _range(args, "input"), _range(args, "output")
    llm, ready_s = build_llm(args)
    engine = llm.llm_engine
    vocab = engine.vocab_size
    print(f"engine ready in {ready_s:.1f} s", flush=True)
    loras = args.lora_requests
    if not args.no_warmup:
        warm = warmup_workload(vocab)
        generate(llm, warm.prompts, warm.output_lens, loras)
    if args.workload != "random":
        work = named_workload(args.workload, args.num_prompts, vocab, args.seed)
    else:
        work = random_workload(args.num_prompts, input_range, output_range, vocab, args.seed)
    # The per-step split needs the engine core in this process (not with data parallelism).
    in_process = getattr(engine.client, "core", None) is not None
    profiler = StepProfiler(engine, expert_load=args.expert_load) if in_process else None
    with TritonCompileWatch() as jit:
        outs, seconds = generate(llm, work.prompts, work.output_lens, loras)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = work.input_tokens
    result = {
        "benchmark": "throughput",
        "model": args.model,
        "num_prompts": args.num_prompts,
        "workload": args.workload,
        "input_len_range": list(input_range),
        "output_len_range": list(output_range),
        "seed": args.seed,
        "num_loras": args.num_loras,
        "lora_rank": args.lora_rank if args.num_loras else None,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "expected_output_tokens": work.output_tokens,
        "elapsed_s": round(seconds, 3),
        "requests_per_s": round(len(outs) / seconds, 3),
        "total_tokens_per_s": round((in_tokens + out_tokens) / seconds, 1),
        "output_tokens_per_s": round(out_tokens / seconds, 1),
        "start_to_ready_s": round(ready_s, 2),
        "step_split": profiler.summary() if profiler is not None else None,
        "triton_variants_compiled_in_run": jit.variants,
        "settings": engine_settings(llm),
        "memory": memory_report(llm),
        "hardware": hardware(),
    }
    print(
        f"Throughput: {result['requests_per_s']:.2f} requests/s, "
        f"{result['total_tokens_per_s']:.2f} total tokens/s, "
        f"{result['output_tokens_per_s']:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {in_tokens}")
    print(f"Total num output tokens:  {out_tokens}")
    split = result["step_split"]
    if split is None:
        pass
    elif getattr(engine.runner, "model", None) is None:  # the model runs in worker processes
        print(
            f"Steps: {split['steps']} ({split['decode_only_steps']} decode-only), mean "
            f"{split['mean_step_ms']:.2f} ms (no GPU/host split: the model runs in the "
            f"{engine.runner.name} executor's workers)"
        )
    else:
        print(
            f"Steps: {split['steps']} ({split['decode_only_steps']} decode-only), mean "
            f"{split['mean_step_ms']:.2f} ms: GPU span {split['mean_gpu_span_ms']:.2f} ms, "
            f"host-only {split['mean_host_only_ms']:.2f} ms (schedule "
            f"{split['mean_schedule_ms']:.2f} ms)"
        )
    if split is not None:
        print(
            f"Mixed/prefill steps: {split['eager_steps']}, {split['eager_gpu_span_s']:.3f} s of "
            f"GPU span (longest {split['max_eager_step_ms']:.1f} ms), "
            f"{split['eager_launch_s']:.3f} s of host launching them; Triton variants first met "
            f"in the run: {len(jit.variants)} {sorted(set(jit.variants))}"
        )
        load = split.get("expert_load")
        if load:
            print(
                f"Expert load over {load['layers']} MoE layers: busiest expert / mean "
                f"{load['mean_max_over_mean']:.2f} on average, worst layer {load['worst_layer']} "
                f"at {load['worst_max_over_mean']:.2f}"
            )
    write_json(args.json, result)
    llm.shutdown()
    return 0 if out_tokens == work.output_tokens else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m engine.benchmarks.throughput ...``"""
    parser = argparse.ArgumentParser(
        prog="engine bench throughput", description=__doc__.split("\n\n")[0]
    )
    add_cli_args(parser)
    return run_and_release(run, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
