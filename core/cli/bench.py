"""``engine bench throughput|latency|serve|scheduler``: the benchmark commands.

``throughput`` and ``latency`` run the whole engine (``engine.benchmarks.throughput`` and
``.latency``); ``serve`` loads a running server over HTTP (``engine.benchmarks.serve``);
``scheduler`` times the scheduler and KV-cache manager alone
(``engine.benchmarks.scheduler``, which parses its own flags). Nothing heavy is imported until a
benchmark runs.
"""

from __future__ import annotations

import argparse
from typing import Any


def _run_throughput(args: argparse.Namespace) -> int:
    from engine.benchmarks.throughput import run

    return run(args)


def _run_latency(args: argparse.Namespace) -> int:
    from engine.benchmarks.latency import run

    return run(args)


def _run_serve(args: argparse.Namespace) -> int:
    from engine.benchmarks.serve import run

    return run(args)


def _run_scheduler(args: argparse.Namespace) -> int:
    from engine.benchmarks.scheduler import main

    return int(main(args.scheduler_args) or 0)


def register(subparsers: Any) -> None:
    """Add ``engine bench`` and its four benchmarks."""
    from engine.benchmarks import latency, serve, throughput

    bench = subparsers.add_parser("bench", help="Benchmark the engine (throughput, latency, ...).")
    kinds = bench.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    p = kinds.add_parser("throughput", help="Offline throughput on a random workload.")
    throughput.add_cli_args(p)
    p.set_defaults(func=_run_throughput)
    p = kinds.add_parser("latency", help="Decode latency at fixed batch sizes.")
    latency.add_cli_args(p)
    p.set_defaults(func=_run_latency)
    p = kinds.add_parser(
        "serve", help="Load a running server: TTFT, TPOT, ITL and throughput (as vLLM's)."
    )
    serve.add_cli_args(p)
    p.set_defaults(func=_run_serve)
    p = kinds.add_parser(
        "scheduler",
        help="The scheduler and KV-cache manager alone (flags: engine bench scheduler -- --help).",
    )
    p.add_argument("scheduler_args", nargs=argparse.REMAINDER, help="Passed on unchanged.")
    p.set_defaults(func=_run_scheduler)
