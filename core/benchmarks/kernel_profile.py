"""Where a decode step's GPU time goes, kernel by kernel.

``python -m engine.benchmarks.kernel_profile --model qwen3-0.6b --load-format dummy
--batch-size 256 --context-len 800`` starts ``batch-size`` requests with ``context-len``-token
prompts, runs them until every one is decoding, then records ``--steps`` engine steps with
``torch.profiler`` and prints the GPU kernels grouped by name: calls per step, microseconds per
step and share of the step's kernel time, plus the wall time per step. With captured decode
graphs the kernels inside each replay are listed the same way (CUPTI reports them); add
``--enforce-eager`` to see the eager launches instead.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from engine.benchmarks.common import (
    add_common_args,
    build_llm,
    hardware,
    run_and_release,
    sampling_params,
    write_json,
)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser)
    parser.add_argument("--batch-size", type=int, default=1, help="Requests decoding together.")
    parser.add_argument("--context-len", type=int, default=512, help="Prompt tokens each.")
    parser.add_argument("--steps", type=int, default=20, help="Profiled decode steps.")
    parser.add_argument("--top", type=int, default=25, help="Kernels listed.")
    parser.add_argument(
        "--phase",
        choices=("decode", "prefill"),
        default="decode",
        help="Profile decode steps (default), or the first steps after the requests arrive "
        "(prefill chunks mixed with decodes).",
    )


def _kernel_events(prof: Any) -> list[tuple[str, float]]:
    """(name, microseconds) of every GPU kernel/memcpy the profiler saw."""
    out = []
    for ev in prof.events():
        device_type = str(getattr(ev, "device_type", ""))
        if "CUDA" not in device_type:
            continue
        out.append((ev.name, float(ev.device_time) if hasattr(ev, "device_time") else 0.0))
    return out


def run(args: argparse.Namespace) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    llm, ready_s = build_llm(args)
    engine = llm.llm_engine
    vocab = engine.runner.vocab_size
    print(f"engine ready in {ready_s:.1f} s", flush=True)
    total = args.steps + 40
    loras = args.lora_requests
    for i in range(args.batch_size):
        prompt = [10 + (i * 7919 + j * 31) % (vocab - 20) for j in range(args.context_len)]
        lora = {"lora_request": loras[i % len(loras)]} if loras else {}
        engine.add_request(f"p{i}", None, sampling_params(total), prompt_token_ids=prompt, **lora)
    if args.phase == "decode":
        # Past the prefill and a few decode steps (graphs warm, allocator settled).
        for _ in range(200):
            engine.step()
            if engine.scheduler.stats().num_waiting == 0:
                break
        for _ in range(10):
            engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    engine.abort_request([f"p{i}" for i in range(args.batch_size)])

    per_name: dict[str, list[float]] = defaultdict(list)
    for name, us in _kernel_events(prof):
        per_name[name].append(us)
    gpu_us = sum(sum(v) for v in per_name.values()) / args.steps
    rows = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))
    print(
        f"batch {args.batch_size}, context {args.context_len}: wall {1e3 * wall / args.steps:.3f} "
        f"ms/step, kernel time {gpu_us / 1e3:.3f} ms/step, "
        f"{sum(len(v) for v in per_name.values()) / args.steps:.0f} kernels/step"
    )
    print(f"{'us/step':>9} {'share':>6} {'calls':>6}  kernel")
    table = []
    for name, times in rows[: args.top]:
        us = sum(times) / args.steps
        calls = len(times) / args.steps
        table.append({"kernel": name, "us_per_step": round(us, 2), "calls_per_step": calls})
        print(f"{us:9.1f} {100 * us / max(gpu_us, 1e-9):5.1f}% {calls:6.1f}  {name[:110]}")
    lora_us = sum(sum(t) for name, t in per_name.items() if "lora" in name.lower()) / args.steps
    lora_calls = sum(len(t) for name, t in per_name.items() if "lora" in name.lower()) / args.steps
    if loras or lora_calls:
        print(
            f"LoRA kernels: {lora_us:.1f} us/step ({100 * lora_us / max(gpu_us, 1e-9):.1f}% of "
            f"the kernel time), {lora_calls:.0f} launches/step"
        )
    write_json(
        args.json,
        {
            "benchmark": "kernel_profile",
            "batch_size": args.batch_size,
            "context_len": args.context_len,
            "wall_ms_per_step": round(1e3 * wall / args.steps, 4),
            "kernel_ms_per_step": round(gpu_us / 1e3, 4),
            "kernels": table,
            "lora_kernel_us_per_step": round(lora_us, 2),
            "lora_kernel_share": round(lora_us / max(gpu_us, 1e-9), 4),
            "num_loras": args.num_loras,
            "hardware": hardware(),
            "start_to_ready_s": round(ready_s, 2),
        },
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.benchmarks.kernel_profile", description=__doc__.split("\n\n")[0]
    )
    add_cli_args(parser)
    return run_and_release(run, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
