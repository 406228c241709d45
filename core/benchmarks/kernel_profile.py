"""Where a decode step's GPU time goes, kernel by kernel.

``python -m engine.benchmarks.kernel_profile --model qwen3-0.6b --load-format dummy
--batch-size 256 --context-len 800`` starts ``batch-size`` requests with ``context-len``-token
prompts, runs them until every one is decoding, then records ``--steps`` engine steps with
``torch.profiler`` and prints the GPU kernels grouped by name: calls per step, microseconds per
step and share of the step's kernel time, plus the wall time per step. With captured decode
graphs the kernels inside each replay are listed the same way (CUPTI reports them); add
``--enforce-eager`` to see the eager launches instead.

A kernel's own duration overstates what it costs when kernels overlap: with programmatic
dependent launch (``engine_triton/kernels/pdl.py``) a kernel starts while its predecessor still
runs and waits inside, so its duration includes that wait. The *path* column charges each
kernel only the time by which it extends the timeline (its end minus the latest end before it,
in start order), so the path times and the idle gaps add up to the GPU span exactly. Idle gaps
shorter than ``--gap-split-us`` (default 20) are counted as launch gaps between kernels of one
step; longer ones as host time between steps.
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
        "--gap-split-us",
        type=float,
        default=20.0,
        help="Idle gaps shorter than this count as launch gaps, longer ones as host time.",
    )
    parser.add_argument(
        "--phase",
        choices=("decode", "prefill"),
        default="decode",
        help="Profile decode steps (default), or the first steps after the requests arrive "
        "(prefill chunks mixed with decodes).",
    )


def _kernel_events(prof: Any) -> list[tuple[str, float, float, float]]:
    """(name, microseconds, start, end) of every GPU kernel/memcpy the profiler saw; start and
    end in the profiler's microsecond clock."""
    out = []
    for ev in prof.events():
        device_type = str(getattr(ev, "device_type", ""))
        if "CUDA" not in device_type:
            continue
        us = float(ev.device_time) if hasattr(ev, "device_time") else 0.0
        span = getattr(ev, "time_range", None)
        start = float(span.start) if span is not None else 0.0
        end = float(span.end) if span is not None else start + us
        out.append((ev.name, us, start, end))
    return out


def critical_path(
    events: Sequence[tuple[str, float, float, float]], gap_split_us: float
) -> tuple[dict[str, float], float, float]:
    """Per kernel name, the microseconds by which its launches extend the GPU timeline (end
    minus the latest earlier end, in start order); plus the idle time in gaps shorter than
    ``gap_split_us`` (between the kernels of a step) and in longer ones (host time)."""
    path: dict[str, float] = defaultdict(float)
    short_idle = long_idle = 0.0
    latest_end = None
    for name, _, start, end in sorted(events, key=lambda e: (e[2], e[3])):
        if latest_end is None:
            latest_end = start
        gap = start - latest_end
        if gap > 0:
            if gap < gap_split_us:
                short_idle += gap
            else:
                long_idle += gap
        path[name] += max(0.0, end - max(start, latest_end))
        latest_end = max(latest_end, end)
    return path, short_idle, long_idle


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

    steps = args.steps
    events = _kernel_events(prof)
    per_name: dict[str, list[float]] = defaultdict(list)
    for name, us, _, _ in events:
        per_name[name].append(us)
    path, launch_idle, host_idle = critical_path(events, args.gap_split_us)
    gpu_us = sum(sum(v) for v in per_name.values()) / steps
    rows = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))
    print(
        f"batch {args.batch_size}, context {args.context_len}: wall {1e3 * wall / steps:.3f} "
        f"ms/step, kernel time {gpu_us / 1e3:.3f} ms/step, "
        f"{sum(len(v) for v in per_name.values()) / steps:.0f} kernels/step"
    )
    print(
        f"GPU timeline per step: {sum(path.values()) / steps:.1f} us in kernels (path), "
        f"{launch_idle / steps:.1f} us idle in gaps < {args.gap_split_us:g} us, "
        f"{host_idle / steps:.1f} us idle in longer gaps"
    )
    print(f"{'us/step':>9} {'share':>6} {'path us':>8} {'calls':>6}  kernel")
    table = []
    for name, times in rows[: args.top]:
        us = sum(times) / steps
        calls = len(times) / steps
        table.append(
            {
                "kernel": name,
                "us_per_step": round(us, 2),
                "path_us_per_step": round(path[name] / steps, 2),
                "calls_per_step": calls,
            }
        )
        print(
            f"{us:9.1f} {100 * us / max(gpu_us, 1e-9):5.1f}% {path[name] / steps:8.1f} "
            f"{calls:6.1f}  {name[:100]}"
        )
    lora_us = sum(sum(t) for name, t in per_name.items() if "lora" in name.lower()) / steps
    lora_calls = sum(len(t) for name, t in per_name.items() if "lora" in name.lower()) / steps
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
            "wall_ms_per_step": round(1e3 * wall / steps, 4),
            "kernel_ms_per_step": round(gpu_us / 1e3, 4),
            "path_ms_per_step": round(sum(path.values()) / steps / 1e3, 4),
            "launch_gap_ms_per_step": round(launch_idle / steps / 1e3, 4),
            "host_gap_ms_per_step": round(host_idle / steps / 1e3, 4),
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
