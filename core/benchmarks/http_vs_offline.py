"""The HTTP server against the offline engine, same model, same lengths, one table.

    python -m engine.benchmarks.http_vs_offline --shape qwen3-0.6b --num-prompts 512 \\
        --input-len 256 --output-len 256 --api-server-count 1,4 --num-workers 4

Writes a model folder for a built-in shape (config.json and a word-level tokenizer covering the
whole vocabulary, so that random weights stream real text; ``--model`` takes a real model
instead, ``embedded`` for the embedded default), then runs, each in its own process, exactly the
commands a user would:

1. ``engine bench throughput --model DIR --load-format dummy ...`` (offline, every request at
   once, greedy, ``ignore_eos``);
2. for each ``--api-server-count``: ``engine serve DIR --load-format dummy ...``, loaded by
   ``engine bench serve --num-workers K ...`` (streaming, ``ignore_eos``, the same random
   token-id prompts and lengths, every request at once or ``--max-concurrency`` at a time),
   then SIGTERM;

and prints output tokens/s for each, the share of offline, TTFT, TPOT, ITL and the busiest
client process's CPU share (to show the client was not the limit). ``--engine-args`` are added
to both the offline and the serve command (``--dtype bfloat16``, ``--max-num-seqs 512``...).
The results go to ``--out`` (a JSON file per run, the server logs).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_ENGINE = [sys.executable, "-c", "from engine.cli.main import main; raise SystemExit(main())"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(port: int, proc: subprocess.Popen, log: Path, timeout: float = 900.0) -> float:
    import httpx

    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"engine serve exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return time.perf_counter() - start
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"engine serve did not become ready in {timeout:.0f} s; see {log}")


def _show(cmd: list[str]) -> None:
    print("$ engine", shlex.join(cmd[len(_ENGINE) :]), flush=True)


def _offline(args: argparse.Namespace, model: str, out: Path) -> dict:
    record = out / "offline.json"
    cmd = [
        *_ENGINE, "bench", "throughput", "--model", model, *args.load_flags,
        "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
        "--output-len", str(args.output_len), "--seed", str(args.seed), "--json", str(record),
        *shlex.split(args.engine_args),
    ]  # fmt: skip
    _show(cmd)
    subprocess.run(cmd, check=True)
    result = json.loads(record.read_text())
    return {"output_tok_s": result["output_tokens_per_s"], "elapsed_s": result["elapsed_s"]}


def _served(args: argparse.Namespace, model: str, out: Path, api_servers: int) -> dict:
    port = _free_port()
    log = out / f"serve_api{api_servers}.log"
    serve = [
        *_ENGINE, "serve", model, *args.load_flags, "--port", str(port),
        "--served-model-name", "bench", "--api-server-count", str(api_servers),
        "--stream-interval", str(args.stream_interval), "--disable-uvicorn-access-log",
        "--data-parallel-size", str(args.data_parallel_size), *shlex.split(args.engine_args),
    ]  # fmt: skip
    _show(serve)
    with open(log, "w") as log_file:
        server = subprocess.Popen(serve, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        ready_s = _wait_ready(port, server, log)
        record = out / f"serve_api{api_servers}.json"
        client = [
            *_ENGINE, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
            "--model", "bench", "--num-prompts", str(args.num_prompts),
            "--random-input-len", str(args.input_len), "--random-output-len",
            str(args.output_len), "--seed", str(args.seed), "--ignore-eos",
            "--num-workers", str(args.num_workers), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--json", str(record),
        ]  # fmt: skip
        if args.max_concurrency:
            client += ["--max-concurrency", str(args.max_concurrency)]
        _show(client)
        subprocess.run(client, check=True)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    summary = json.loads(record.read_text())["summary"]
    summary["ready_s"] = ready_s
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-0.6b", help="A built-in shape (dummy weights).")
    parser.add_argument(
        "--model", default=None, help="A model to load instead (a directory, a .gguf, embedded)."
    )
    parser.add_argument("--max-concurrency", type=int, default=None, help="engine bench serve's.")
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--api-server-count", default="1,4", help="Comma-separated: one server run each."
    )
    parser.add_argument("--num-workers", type=int, default=4, help="engine bench serve's.")
    parser.add_argument("--stream-interval", type=int, default=1)
    parser.add_argument("--data-parallel-size", type=int, default=1)
    parser.add_argument(
        "--engine-args", default="--dtype bfloat16", help="Engine flags for every run."
    )
    parser.add_argument("--no-offline", action="store_true", help="Skip the offline run.")
    parser.add_argument("--out", default=None, help="Folder for logs and JSON (default: temp).")
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="http_vs_offline-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        from engine.benchmarks.workload import write_builtin_model

        model = write_builtin_model(args.shape, str(out / "model"), word_level_tokenizer=True)
        args.load_flags = ["--load-format", "dummy"]
    elif args.model == "embedded":
        from engine.default_model import resolve_model

        model, args.load_flags = str(resolve_model(None)[0]), []
    else:
        model, args.load_flags = args.model, []
    name = args.shape if args.model is None else os.path.basename(model.rstrip("/"))
    print(f"model {model}; results in {out}", flush=True)
    rows = []
    offline = None if args.no_offline else _offline(args, model, out)
    if offline is not None:
        rows.append(("offline, engine bench throughput", offline["output_tok_s"], None))
    for count in [int(c) for c in args.api_server_count.split(",")]:
        summary = _served(args, model, out, count)
        rows.append((f"engine serve --api-server-count {count}", summary["output_throughput"],
                     summary))  # fmt: skip
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print()
    print(
        f"{name}, {args.num_prompts} requests x {args.input_len} in / {args.output_len} out, "
        f"{'at most ' + str(args.max_concurrency) if args.max_concurrency else 'all'} at once, "
        f"greedy, ignore_eos; bench serve --num-workers {args.num_workers}, "
        f"stream interval {args.stream_interval}, DP {args.data_parallel_size}; "
        f"load average {load:.1f}"
    )
    head = (
        f"| {'path':38s} | output tok/s | of offline | mean TTFT ms | median TTFT ms "
        "| mean TPOT ms | median ITL ms | busiest client CPU |"
    )
    print(head)
    print("|" + "|".join("-" * (len(c) + 0) for c in head.split("|")[1:-1]) + "|")
    base = offline["output_tok_s"] if offline else None
    for label, tok_s, s in rows:
        share = f"{100 * tok_s / base:.1f}%" if base else "-"
        if s is None:
            print(f"| {label:38s} | {tok_s:12,.0f} | {share:>10s} | {'':12s} | {'':14s} | "
                  f"{'':12s} | {'':13s} | {'':18s} |")  # fmt: skip
            continue
        client = f"{100 * max(s['client_cpu_utilization']):.0f}%"
        print(
            f"| {label:38s} | {tok_s:12,.0f} | {share:>10s} | {s['mean_ttft_ms']:12.1f} | "
            f"{s['median_ttft_ms']:14.1f} | {s['mean_tpot_ms']:12.2f} | "
            f"{s['median_itl_ms']:13.2f} | {client:>18s} |"
        )
    (out / "table.json").write_text(json.dumps({"offline": offline, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
