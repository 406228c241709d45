"""Scheduler + KV-cache manager benchmark (device-free).

Two measurements:

* **decode step time**: ``R`` running requests all decoding; the time of ``schedule()`` plus
  ``update_from_output()`` per step (the scheduler's share of every engine step), for each
  ``R`` in ``--running``.
* **KV waste**: a mixed workload (random prompt and output lengths, arrivals over time, a cache
  smaller than the demand, so preemption and prefix reuse happen); reports the fraction of
  allocated KV slots holding no computed or scheduled token at the step of peak KV usage.

Run ``python -m engine.benchmarks.scheduler`` (``--help`` for the knobs). No torch is imported.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence

from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache_manager import KVCacheGroupSpec
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler


def _groups(sliding_window: int | None) -> list[KVCacheGroupSpec]:
    if sliding_window is None:
        return [KVCacheGroupSpec()]
    return [KVCacheGroupSpec(), KVCacheGroupSpec(sliding_window)]


def _sampled(out) -> dict[str, list[int]]:
    """A stand-in sampler: one cheap deterministic token per sampling request."""
    return {e.request.request_id: [(e.start * 31 + 7) % 32000] for e in out.scheduled if e.samples}


def bench_decode(
    num_running: int,
    steps: int,
    block_size: int,
    prompt_len: int,
    prefix_caching: bool,
    sliding_window: int | None,
    seed: int = 0,
) -> dict:
    """Time ``steps`` pure-decode steps with ``num_running`` requests."""
    rng = random.Random(seed)
    groups = _groups(sliding_window)
    max_len = 2 * prompt_len + steps + 64
    num_blocks = 1 + len(groups) * num_running * (-(-max_len // block_size) + 1)
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=num_running, max_num_batched_tokens=max(8192, num_running)),
        CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        max_model_len=max_len + 1,
        num_blocks=num_blocks,
        kv_groups=groups,
    )
    for i in range(num_running):
        n = rng.randint(prompt_len // 2, prompt_len * 3 // 2)
        prompt = [rng.randrange(32000) for _ in range(n)]
        scheduler.add_request(Request(f"r{i}", prompt, max_tokens=steps + 64))
    # Prefill everything (chunked), then a few warm-up decode steps.
    warmup = 0
    while warmup < 5:
        out = scheduler.schedule()
        scheduler.update_from_output(out, _sampled(out))
        if len(out.scheduled) == num_running and all(e.is_decode for e in out.scheduled):
            warmup += 1
    # Wall time, and this thread's CPU time: on a shared machine the CPU time is the fair
    # measure (wall time also counts the moments other processes held the core).
    sched_times, update_times, cpu_times = [], [], []
    perf, cpu = time.perf_counter, time.thread_time
    for _ in range(steps):
        c0 = cpu()
        t0 = perf()
        out = scheduler.schedule()
        t1 = perf()
        c1 = cpu()
        sampled = _sampled(out)  # the sampler's work, not the scheduler's
        c2 = cpu()
        t2 = perf()
        scheduler.update_from_output(out, sampled)
        t3 = perf()
        c3 = cpu()
        assert len(out.scheduled) == num_running
        sched_times.append(t1 - t0)
        update_times.append(t3 - t2)
        cpu_times.append(c1 - c0 + c3 - c2)
    totals = sorted(a + b for a, b in zip(sched_times, update_times, strict=True))
    return {
        "running": num_running,
        "steps": steps,
        "block_size": block_size,
        "prefix_caching": prefix_caching,
        "sliding_window": sliding_window,
        "schedule_ms": 1e3 * statistics.mean(sched_times),
        "update_ms": 1e3 * statistics.mean(update_times),
        "step_ms_mean": 1e3 * statistics.mean(totals),
        "step_ms_median": 1e3 * statistics.median(totals),
        "step_ms_p99": 1e3 * totals[min(len(totals) - 1, int(0.99 * len(totals)))],
        "step_cpu_ms_mean": 1e3 * statistics.mean(cpu_times),
    }


def bench_waste(
    num_requests: int,
    block_size: int,
    prefix_caching: bool,
    sliding_window: int | None,
    seed: int = 0,
) -> dict:
    """Run a mixed workload to completion and report KV waste at peak usage."""
    rng = random.Random(seed)
    groups = _groups(sliding_window)
    shared = [rng.randrange(32000) for _ in range(1024)]  # a common system prompt pool
    specs = []
    for i in range(num_requests):
        n_prompt = int(min(2048, max(16, rng.lognormvariate(5.5, 0.9))))
        n_shared = rng.choice([0, 0, 64, 256, 1000])
        prompt = shared[: min(n_shared, n_prompt)]
        prompt += [rng.randrange(32000) for _ in range(n_prompt - len(prompt))]
        n_out = int(min(512, max(8, rng.lognormvariate(4.5, 0.8))))
        specs.append((i // 4, Request(f"r{i}", prompt, max_tokens=n_out, arrival_time=i)))
    demand = sum(-(-(r.max_total_tokens) // block_size) for _, r in specs)
    num_blocks = max(demand // 8, 2 * 2560 // block_size * len(groups) + 1)
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048),
        CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        max_model_len=4096,
        num_blocks=num_blocks,
        kv_groups=groups,
    )
    pending = list(reversed(specs))
    step = 0
    peak_usage, waste_at_peak, max_waste_busy = 0.0, 0.0, 0.0
    weighted_waste, weighted_usage = 0.0, 0.0
    t0 = time.perf_counter()
    while pending or scheduler.has_unfinished():
        while pending and pending[-1][0] <= step:
            scheduler.add_request(pending.pop()[1])
        step += 1
        out = scheduler.schedule()
        stats = scheduler.stats()
        if stats.kv_usage >= peak_usage:
            peak_usage, waste_at_peak = stats.kv_usage, stats.kv_waste
        if stats.kv_usage >= 0.5:
            max_waste_busy = max(max_waste_busy, stats.kv_waste)
        weighted_waste += stats.kv_waste * stats.kv_usage
        weighted_usage += stats.kv_usage
        scheduler.update_from_output(out, _sampled(out))
        for e in out.scheduled:
            r = e.request
            if e.samples and len(r.output_token_ids) >= r.max_tokens:
                scheduler.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
    elapsed = time.perf_counter() - t0
    final = scheduler.stats()
    assert final.num_used_blocks == 0
    return {
        "requests": num_requests,
        "block_size": block_size,
        "num_blocks": num_blocks,
        "prefix_caching": prefix_caching,
        "sliding_window": sliding_window,
        "steps": step,
        "peak_kv_usage": peak_usage,
        "kv_waste_at_peak": waste_at_peak,
        "max_kv_waste_at_usage_ge_50pct": max_waste_busy,
        "usage_weighted_mean_kv_waste": weighted_waste / weighted_usage if weighted_usage else 0.0,
        "prefix_cache_hit_rate": final.prefix_cache_hit_rate,
        "preemptions": final.num_preemptions,
        "scheduler_ms_per_step": 1e3 * elapsed / step,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; prints a table (or JSON with ``--json``)."""
    parser = argparse.ArgumentParser(
        prog="python -m engine.benchmarks.scheduler", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--running", default="256,1024", help="comma-separated request counts")
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=512, help="mean prompt length")
    parser.add_argument("--sliding-window", type=int, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--waste-requests", type=int, default=600, help="0 skips the waste run")
    parser.add_argument("--json", action="store_true", help="print JSON lines")
    args = parser.parse_args(argv)
    caching = not args.no_prefix_caching

    results = []
    for n in (int(x) for x in args.running.split(",") if x.strip()):
        results.append(
            bench_decode(
                n, args.steps, args.block_size, args.prompt_len, caching, args.sliding_window
            )
        )
    waste = None
    if args.waste_requests > 0:
        waste = bench_waste(args.waste_requests, args.block_size, caching, args.sliding_window)

    if args.json:
        for r in results:
            print(json.dumps({"bench": "decode_step", **r}))
        if waste is not None:
            print(json.dumps({"bench": "kv_waste", **waste}))
        return 0
    window = f", sliding window {args.sliding_window}" if args.sliding_window else ""
    print(
        f"decode steps: block size {args.block_size}, prefix caching {'on' if caching else 'off'}"
        f"{window}, {args.steps} timed steps"
    )
    print(
        f"{'running':>8} {'schedule':>9} {'update':>9} {'step mean':>10} {'median':>9} "
        f"{'p99':>8} {'step CPU':>9}  (ms)"
    )
    for r in results:
        print(
            f"{r['running']:>8} {r['schedule_ms']:>9.3f} {r['update_ms']:>9.3f} "
            f"{r['step_ms_mean']:>10.3f} {r['step_ms_median']:>9.3f} {r['step_ms_p99']:>8.3f} "
            f"{r['step_cpu_ms_mean']:>9.3f}"
        )
    if waste is not None:
        print(
            f"mixed workload: {waste['requests']} requests, {waste['num_blocks']} blocks, "
            f"{waste['steps']} steps, {waste['preemptions']} preemptions, prefix hit rate "
            f"{waste['prefix_cache_hit_rate']:.1%}"
        )
        print(
            f"  KV waste at peak usage ({waste['peak_kv_usage']:.1%}): "
            f"{waste['kv_waste_at_peak']:.2%}; worst while usage >= 50%: "
            f"{waste['max_kv_waste_at_usage_ge_50pct']:.2%}; usage-weighted mean: "
            f"{waste['usage_weighted_mean_kv_waste']:.2%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
