"""``engine bench serve``: load a running server the way ``vllm bench serve`` does.

    engine serve MODEL &                      # or any OpenAI-compatible server
    engine bench serve --num-prompts 200 --random-input-len 512 --random-output-len 128 \\
        --request-rate 8 --max-concurrency 64

Requests are random token-id prompts (exact input lengths; ids drawn from the served model's
tokenizer, found through ``/v1/models``' ``root`` or given with ``--tokenizer`` /
``--vocab-size``) sent to ``/v1/completions`` with streaming. They arrive as a Poisson process
at ``--request-rate`` per second (``inf``: all at once); ``--burstiness`` is the shape of the
gamma distribution of the gaps (1 = Poisson, lower = burstier, as in vLLM), and
``--max-concurrency`` caps the requests in flight. Per request it records:

- TTFT, time to first token: from sending the request to the first streamed text;
- ITL, inter-token latency: the gaps between streamed chunks (one chunk per engine step);
- TPOT, time per output token after the first: ``(E2EL - TTFT) / (output tokens - 1)``;
- E2EL, end-to-end latency;

and prints throughput and the mean, median and chosen percentiles of each, in vLLM's layout.
``--json FILE`` writes everything, per-request figures included.

A Python client can be the bottleneck: parsing hundreds of streams' chunks in one asyncio loop
saturates a core long before a fast server does. ``--num-workers K`` spreads the requests over
K client processes (request ``i`` goes to worker ``i % K``, at the same arrival time it would
have had; ``--max-concurrency`` is shared out between them); each worker's CPU time is
reported, as a share of the run, so a run can show that its client did not saturate. On a small
machine the client shares the cores with the server, so compare runs made the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from itertools import accumulate
from typing import Any

from engine.benchmarks.common import write_json
from engine.benchmarks.workload import length_range, random_workload

METRICS = ("ttft", "tpot", "itl", "e2el")
_METRIC_NAMES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


@dataclass
class RequestResult:
    """One request as the client saw it (seconds, from the moment it was sent)."""

    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``engine bench serve`` (vLLM's names)."""
    p = parser
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="The server.")
    p.add_argument("--endpoint", default="/v1/completions", help="Completions endpoint path.")
    p.add_argument("--model", help="Model name to send (default: the server's first).")
    p.add_argument("--api-key", help="Sent as 'Authorization: Bearer KEY'.")
    p.add_argument("--tokenizer", help="Tokenizer for the prompt ids (default: the model's).")
    p.add_argument("--vocab-size", type=int, help="Draw prompt ids below this instead.")
    p.add_argument("--num-prompts", type=int, default=100, help="Requests to send.")
    p.add_argument("--random-input-len", type=int, default=1024, help="Prompt tokens.")
    p.add_argument("--random-output-len", type=int, default=128, help="max_tokens.")
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="Lengths uniform in [len * (1 - r), len * (1 + r)].",
    )
    p.add_argument("--seed", type=int, default=0, help="Seeds prompts, lengths and arrivals.")
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Requests per second (Poisson arrivals); inf sends them all at once.",
    )
    p.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape of the gaps.")
    p.add_argument("--max-concurrency", type=int, help="At most this many requests in flight.")
    p.add_argument(
        "--num-workers",
        type=int,
        default=1,
        help="Client processes sharing the requests, so that the client is not what limits "
        "a fast server; their CPU use is reported (default: %(default)s).",
    )
    p.add_argument("--ignore-eos", action="store_true", help="Generate every output token.")
    p.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl",
        help=f"Which of {','.join(METRICS)} to report.",
    )
    p.add_argument("--metric-percentiles", default="99", help="Percentiles, e.g. 50,90,99.")
    p.add_argument("--json", metavar="FILE", help="Write settings, summary and per-request data.")


def _check_args(args: argparse.Namespace) -> None:
    problems = []
    if args.num_prompts < 1:
        problems.append(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.request_rate <= 0:
        problems.append(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if args.burstiness <= 0:
        problems.append(f"--burstiness must be > 0, got {args.burstiness}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        problems.append(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.num_workers < 1:
        problems.append(f"--num-workers must be >= 1, got {args.num_workers}")
    unknown = set(args.percentile_metrics.split(",")) - set(METRICS)
    if unknown:
        problems.append(f"--percentile-metrics: unknown {sorted(unknown)}; use {METRICS}")
    if problems:
        raise SystemExit("engine bench serve: " + "; ".join(problems))


def _headers(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


async def _served_model(client: Any, args: argparse.Namespace) -> tuple[str, str | None]:
    """The model name to send and the path its tokenizer can be loaded from (``root``)."""
    import httpx

    from engine.config import ConfigError

    url = f"{args.base_url}/v1/models"
    try:
        r = await client.get(url, headers=_headers(args))
    except httpx.HTTPError as e:
        raise ConfigError(
            f"cannot reach the server at {args.base_url} ({type(e).__name__}: {e}); start it "
            "(engine serve) or point --base-url at it"
        ) from e
    if r.status_code != 200:
        hint = "pass its key with --api-key" if r.status_code == 401 else "check --base-url"
        raise ConfigError(f"GET {url} answered {r.status_code}: {r.text[:200]}; {hint}")
    cards = r.json()["data"]
    if args.model is not None:
        card = next((c for c in cards if c["id"] == args.model), {"root": None})
        return args.model, card.get("root")
    return cards[0]["id"], cards[0].get("root")


def _vocab_size(args: argparse.Namespace, root: str | None) -> int:
    if args.vocab_size:
        return args.vocab_size
    source = args.tokenizer or root
    if source is None:
        raise SystemExit("engine bench serve: give --tokenizer or --vocab-size for the prompts")
    from engine.config import ModelConfig
    from engine.tokenizer import load_tokenizer

    return len(load_tokenizer(ModelConfig(model=source)))


async def _one(
    client: Any, args: argparse.Namespace, model: str, prompt: list[int], max_tokens: int
) -> RequestResult:
    """Send one streamed completion; time its chunks."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": args.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(prompt_len=len(prompt))
    start = last = time.perf_counter()
    try:
        url = args.base_url + args.endpoint
        async with client.stream("POST", url, json=body, headers=_headers(args)) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = str(event["error"])
                    return result
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                choices = event.get("choices") or []
                if choices and choices[0].get("text"):
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
    except Exception as e:  # noqa: BLE001 - a failed request is counted, the run goes on
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2el = time.perf_counter() - start
    return result


def _gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before each request: gamma-distributed with mean ``1 / rate``."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(n)]


@dataclass
class ClientStats:
    """What one client process spent (seconds) during the timed run."""

    cpu_s: float
    wall_s: float

    @property
    def utilization(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0


def _http_client(concurrency: int) -> Any:
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=30.0))


async def _run_schedule(
    client: Any,
    args: argparse.Namespace,
    model: str,
    schedule: list[tuple[int, list[int], int, float]],
    concurrency: int,
) -> tuple[list[tuple[int, RequestResult]], float, float]:
    """Send ``(index, prompt, max_tokens, offset)`` requests, each ``offset`` seconds after the
    start, at most ``concurrency`` at a time; return the results by index and the wall-clock
    start and end (``time.time()``)."""
    gate = asyncio.Semaphore(concurrency)

    async def limited(index: int, prompt: list[int], max_tokens: int) -> tuple[int, Any]:
        async with gate:
            return index, await _one(client, args, model, prompt, max_tokens)

    start_wall, start = time.time(), time.perf_counter()
    tasks = []
    for index, prompt, max_tokens, offset in schedule:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(limited(index, prompt, max_tokens)))
    results = await asyncio.gather(*tasks)
    return list(results), start_wall, time.time()


def _schedule(args: argparse.Namespace, vocab: int) -> list[tuple[int, list[int], int, float]]:
    workload = random_workload(
        args.num_prompts,
        length_range(args.random_input_len, args.random_range_ratio),
        length_range(args.random_output_len, args.random_range_ratio),
        vocab,
        args.seed,
    )
    offsets = accumulate(_gaps(args.num_prompts, args.request_rate, args.burstiness, args.seed))
    return [
        (i, prompt, out_len, offset)
        for i, (prompt, out_len, offset) in enumerate(
            zip(workload.prompts, workload.output_lens, offsets, strict=True)
        )
    ]


def _worker_concurrency(total: int, workers: int, index: int) -> int:
    return max(1, total // workers + (1 if index < total % workers else 0))


def _worker_main(args, model, schedule, concurrency, barrier, results) -> None:
    """A client process of ``--num-workers``: its share of the schedule, then its figures."""

    async def main() -> tuple[list, float, float]:
        async with _http_client(concurrency) as client:
            await asyncio.to_thread(barrier.wait)  # every worker starts together
            return await _run_schedule(client, args, model, schedule, concurrency)

    cpu = time.process_time()
    try:
        done, start, end = asyncio.run(main())
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        results.put(("error", f"{type(e).__name__}: {e}"))
        raise
    results.put(("ok", [(i, asdict(r)) for i, r in done], start, end, time.process_time() - cpu))


async def _prepare(args: argparse.Namespace) -> tuple[str, list]:
    """The model name and the schedule, after one short warm-up request."""
    async with _http_client(4) as client:
        model, root = await _served_model(client, args)
        schedule = _schedule(args, _vocab_size(args, root))
        # One short request first: connection set-up and first-request costs stay out.
        warm = await _one(client, args, model, schedule[0][1][:16], 4)
        if warm.error:
            raise SystemExit(f"engine bench serve: the warm-up request failed: {warm.error}")
    return model, schedule


def _run_requests(
    args: argparse.Namespace,
) -> tuple[list[RequestResult], float, str, list[ClientStats]]:
    """Run the workload; returns the results in request order, the duration, the model and
    the client processes' CPU use."""
    model, schedule = asyncio.run(_prepare(args))
    total = args.max_concurrency or args.num_prompts
    workers = min(args.num_workers, args.num_prompts)
    if workers == 1:

        async def alone() -> tuple[list, float, float]:
            async with _http_client(total) as client:
                return await _run_schedule(client, args, model, schedule, total)

        cpu = time.process_time()
        done, start, end = asyncio.run(alone())
        clients = [ClientStats(time.process_time() - cpu, end - start)]
        return [r for _, r in sorted(done, key=lambda x: x[0])], end - start, model, clients

    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(workers)
    queue = ctx.Queue()
    procs = []
    for w in range(workers):
        share = [item for item in schedule if item[0] % workers == w]
        concurrency = _worker_concurrency(total, workers, w)
        args_copy = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "func"})
        procs.append(
            ctx.Process(
                target=_worker_main,
                args=(args_copy, model, share, concurrency, barrier, queue),
                name=f"bench-serve-{w}",
            )
        )
    for p in procs:
        p.start()
    replies = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    errors = [r[1] for r in replies if r[0] == "error"]
    if errors:
        raise SystemExit(f"engine bench serve: a client worker failed: {errors[0]}")
    by_index: dict[int, RequestResult] = {}
    for _, done, _, _, _ in replies:
        for i, r in done:
            by_index[i] = RequestResult(**r)
    start = min(r[2] for r in replies)
    end = max(r[3] for r in replies)
    clients = [ClientStats(r[4], r[3] - r[2]) for r in replies]
    return [by_index[i] for i in sorted(by_index)], end - start, model, clients


def _percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of a non-empty list."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(
    results: list[RequestResult], duration: float, metrics: list[str], percentiles: list[float]
) -> dict[str, Any]:
    """Throughput and latency statistics (milliseconds) over the successful requests."""
    ok = [r for r in results if not r.error]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.e2el for r in ok],
    }
    for name in metrics:
        values = [v * 1000.0 for v in samples[name]]
        if not values:
            continue
        summary[f"mean_{name}_ms"] = sum(values) / len(values)
        summary[f"median_{name}_ms"] = _percentile(values, 50)
        for q in percentiles:
            summary[f"p{q:g}_{name}_ms"] = _percentile(values, q)
    return summary


def format_summary(summary: dict[str, Any], metrics: list[str], percentiles: list[float]) -> str:
    """vLLM's result block."""
    rows = [
        "{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="),
        f"{'Successful requests:':<40}{summary['completed']:<10}",
        f"{'Failed requests:':<40}{summary['failed']:<10}",
        f"{'Benchmark duration (s):':<40}{summary['duration_s']:<10.2f}",
        f"{'Total input tokens:':<40}{summary['total_input_tokens']:<10}",
        f"{'Total generated tokens:':<40}{summary['total_output_tokens']:<10}",
        f"{'Request throughput (req/s):':<40}{summary['request_throughput']:<10.2f}",
        f"{'Output token throughput (tok/s):':<40}{summary['output_throughput']:<10.2f}",
        f"{'Total Token throughput (tok/s):':<40}{summary['total_token_throughput']:<10.2f}",
    ]
    for name in metrics:
        if f"mean_{name}_ms" not in summary:
            continue
        title, short = _METRIC_NAMES[name]
        rows.append("{s:{c}^50}".format(s=title, c="-"))
        rows.append(f"{f'Mean {short} (ms):':<40}{summary[f'mean_{name}_ms']:<10.2f}")
        rows.append(f"{f'Median {short} (ms):':<40}{summary[f'median_{name}_ms']:<10.2f}")
        for q in percentiles:
            rows.append(f"{f'P{q:g} {short} (ms):':<40}{summary[f'p{q:g}_{name}_ms']:<10.2f}")
    if "client_cpu_s" in summary:
        utilization = summary["client_cpu_utilization"]
        rows.append("{s:{c}^50}".format(s="Client", c="-"))
        rows.append(f"{'Client processes:':<40}{len(utilization):<10}")
        rows.append(
            f"{'Client CPU, busiest process (s):':<40}{max(summary['client_cpu_s']):<10.2f}"
        )
        rows.append(
            f"{'Client CPU, busiest process (% of run):':<40}{100 * max(utilization):<10.1f}"
        )
    rows.append("=" * 50)
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print the result block (and write ``--json``)."""
    _check_args(args)
    metrics = args.percentile_metrics.split(",")
    percentiles = [float(q) for q in args.metric_percentiles.split(",")]
    results, duration, model, clients = _run_requests(args)
    summary = summarize(results, duration, metrics, percentiles)
    summary["client_cpu_s"] = [round(c.cpu_s, 3) for c in clients]
    summary["client_cpu_utilization"] = [round(c.utilization, 3) for c in clients]
    print(format_summary(summary, metrics, percentiles))
    failures = [r.error for r in results if r.error]
    if failures:
        print(f"first failure: {failures[0]}", file=sys.stderr)
    if args.json:
        record = {
            "settings": {
                k: (str(v) if isinstance(v, float) and math.isinf(v) else v)
                for k, v in vars(args).items()
                if k not in ("func", "api_key")  # no secrets in result files
            },
            "model": model,
            "summary": summary,
            "requests": [asdict(r) for r in results],
        }
        write_json(args.json, record)
    return 0 if not failures else 1
