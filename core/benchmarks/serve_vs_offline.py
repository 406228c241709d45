"""Offline ``LLM.generate`` vs the HTTP server at saturation, on the same model and flags.

    python -m engine.benchmarks.serve_vs_offline [--model DIR] [--num-prompts 128] ...

Without ``--model`` a tiny random Llama is built in a temporary directory. The same prompts
(random token ids, greedy, ``ignore_eos``, fixed output length) run offline in this process and
against ``engine serve`` (a subprocess with the same engine flags), all requests at once from a
minimal raw-socket asyncio client, streaming and non-streaming. The modes alternate
``--repeats`` times (the idle server costs nothing while the offline engine runs) and the best
run of each counts. It prints tokens/s, the CPU seconds per 1000 tokens (steadier than wall
time on a shared machine) of the engine (offline: the process; served: the engine-core
process, and apart the HTTP front end), the client's, and the time from launching
``engine serve`` to ``/health`` answering 200.

Both engines are alive at once, so on a GPU they share it: each gets half of
``--gpu-memory-utilization`` (default 0.9: 0.45 each), since each sizes its KV cache from the
device's total memory. On the CPU ``--cpu-kv-cache-gb`` sizes each cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts(vocab_size: int, special: set[int], num: int, length: int, seed: int) -> list:
    rng = random.Random(seed)
    pool = [t for t in range(vocab_size) if t not in special]
    return [[rng.choice(pool) for _ in range(length)] for _ in range(num)]


def _engine_flags(args: argparse.Namespace) -> dict:
    """The engine settings both runs use (``LLM`` keyword names)."""
    modes = set(args.modes.split(","))
    both = "offline" in modes and bool(modes & {"stream", "plain"})
    return {
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "cpu_kv_cache_gb": args.cpu_kv_cache_gb,
        # Each engine sizes its KV cache from the device's *total* memory: two of them at
        # 0.9 would ask for 180% of it. Half each when both run.
        "gpu_memory_utilization": args.gpu_memory_utilization / (2 if both else 1),
        "platform": args.platform,
        "enable_prefix_caching": False,  # random prompts; keep the two runs identical
    }


class OfflineRunner:
    """The offline ``LLM`` with the benchmark's engine flags, loaded once."""

    def __init__(self, model: str, args: argparse.Namespace) -> None:
        from engine.llm import LLM
        from engine.sampling_params import SamplingParams

        self.llm = LLM(model, **_engine_flags(args))
        self.params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    def run(self, prompts: list) -> dict:
        """Generate for every prompt at once; return elapsed seconds and generated tokens."""
        self.llm.generate(prompts[:4], self.params, use_tqdm=False)  # warm up
        cpu = time.process_time()
        start = time.perf_counter()
        outs = self.llm.generate(prompts, self.params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return {
            "elapsed": elapsed,
            "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "cpu": time.process_time() - cpu,
        }


def server_command(model: str, args: argparse.Namespace, port: int) -> list[str]:
    """``engine serve`` with the same engine flags as the offline run."""
    flags = _engine_flags(args)
    return [
        sys.executable,
        "-c",
        "from engine.cli.main import main; raise SystemExit(main())",
        "serve",
        model,
        "--port",
        str(port),
        "--dtype",
        flags["dtype"],
        "--max-model-len",
        str(flags["max_model_len"]),
        "--max-num-seqs",
        str(flags["max_num_seqs"]),
        "--max-num-batched-tokens",
        str(flags["max_num_batched_tokens"]),
        "--cpu-kv-cache-gb",
        str(flags["cpu_kv_cache_gb"]),
        "--gpu-memory-utilization",
        str(flags["gpu_memory_utilization"]),
        "--platform",
        flags["platform"],
        "--no-enable-prefix-caching",
        "--served-model-name",
        "bench",
        "--disable-uvicorn-access-log",
    ]


def start_server(model: str, args: argparse.Namespace) -> tuple[subprocess.Popen, str, float]:
    """Launch ``engine serve`` with the same engine flags; wait for /health 200."""
    import httpx

    port = _free_port()
    cmd = server_command(model, args, port)
    log = open(Path(tempfile.gettempdir()) / f"serve_vs_offline_{port}.log", "w")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    base = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"engine serve exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    return proc, base, time.perf_counter() - start


async def _one(host: str, port: int, prompt: list[int], output_len: int, stream: bool) -> int:
    """One request over a raw HTTP/1.1 connection; returns the completion tokens.

    A minimal client (no HTTP library, the body read whole at the end) keeps the load
    generator's own CPU small: on a small machine it shares the cores with the server.
    """
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload)
    )
    data = await reader.read(-1)  # until the server closes the connection
    writer.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"request failed: {head[:200]!r} {rest[:500]!r}")
    usage_at = rest.rfind(b'"usage":{')
    usage = json.JSONDecoder().raw_decode(rest[usage_at + 8 :].decode())[0]
    return usage["completion_tokens"]


async def _saturate(
    base: str, prompts: list, output_len: int, stream: bool, server_pid: int
) -> dict:
    import psutil

    host, port = base.removeprefix("http://").split(":")
    port = int(port)
    server = psutil.Process(server_pid)
    cores = server.children(recursive=True)  # the engine-core process(es)

    def cpu_of(procs: list) -> float:
        return sum(t.user + t.system for t in (p.cpu_times() for p in procs))

    await asyncio.gather(*(_one(host, port, p, output_len, stream) for p in prompts[:4]))
    front, core = cpu_of([server]), cpu_of(cores)
    client_cpu = time.process_time()
    start = time.perf_counter()
    counts = await asyncio.gather(*(_one(host, port, p, output_len, stream) for p in prompts))
    elapsed = time.perf_counter() - start
    return {
        "elapsed": elapsed,
        "tokens": sum(counts),
        "cpu": cpu_of(cores) - core,
        "front_end_cpu": cpu_of([server]) - front,
        "client_cpu": time.process_time() - client_cpu,
    }


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="Model directory (default: a tiny Llama).")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--cpu-kv-cache-gb", type=float, default=1.0)
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="Device memory for the two engines together: each gets half when both run "
        "(default: %(default)s).",
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--platform", default="auto")
    parser.add_argument("--hidden-size", type=int, default=256, help="Tiny model width.")
    parser.add_argument("--num-layers", type=int, default=4, help="Tiny model depth.")
    parser.add_argument("--modes", default="offline,stream,plain", help="What to run.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="Runs per mode (best counts).")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch intra-op threads in both runs (OMP_NUM_THREADS for the server); 1 is "
        "steadier on a shared machine.",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The same OpenMP wait policy as the server's engine core, which `engine serve` gives
    # PASSIVE (engine.cpu_threads): on a quiet 2-core machine spinning threads decode about 15%
    # faster, so an offline run that spins against a served core that sleeps measures the
    # policy, not the HTTP path. libgomp reads it when torch loads, so before that.
    from engine.cpu_threads import prefer_passive_openmp

    prefer_passive_openmp()
    if args.torch_threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)
        import torch

        torch.set_num_threads(args.torch_threads)

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from engine.testing.tiny_models import build_tiny_model

            model = str(
                build_tiny_model(
                    tmp,
                    "llama",
                    hidden_size=args.hidden_size,
                    num_layers=args.num_layers,
                    num_heads=max(1, args.hidden_size // 64),
                    num_kv_heads=max(1, args.hidden_size // 128),
                    intermediate_size=args.hidden_size * 2,
                    max_position_embeddings=args.max_model_len,
                )
            )
        from engine.config import ModelConfig
        from engine.tokenizer import load_tokenizer

        # The engine's own loader: a .gguf file's tokenizer is converted and cached there.
        tok = load_tokenizer(ModelConfig(model=str(model)))
        prompts = _prompts(
            len(tok), set(tok.all_special_ids), args.num_prompts, args.input_len, args.seed
        )
        modes = args.modes.split(",")
        print(
            f"model {model}: {args.num_prompts} prompts x {args.input_len} tokens in, "
            f"{args.output_len} out, max_num_seqs {args.max_num_seqs}, best of {args.repeats}; "
            f"gpu_memory_utilization {_engine_flags(args)['gpu_memory_utilization']:g} per "
            "engine on an accelerator"
        )
        # The server idles (its engine core sleeps) while the offline engine runs, and the
        # runs alternate, so that load drifting on a shared machine hits every mode alike.
        proc = base = None
        if "stream" in modes or "plain" in modes:
            proc, base, ready_s = start_server(model, args)
            print(f"engine serve: ready (/health 200) {ready_s:.2f} s after launch")
        results: dict[str, list[dict]] = {m: [] for m in ("offline", "stream", "plain")}
        try:
            offline = OfflineRunner(model, args) if "offline" in modes else None
            for _ in range(args.repeats):
                if offline is not None:
                    results["offline"].append(offline.run(prompts))
                for mode in ("stream", "plain"):
                    if mode in modes:
                        results[mode].append(
                            asyncio.run(
                                _saturate(
                                    base, prompts, args.output_len, mode == "stream", proc.pid
                                )
                            )
                        )
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(60)
        offline_tps = offline_cpu = None
        labels = {
            "offline": "offline LLM.generate",
            "stream": "HTTP, streaming",
            "plain": "HTTP, non-streaming",
        }
        for name, runs in results.items():
            if not runs:
                continue
            rates = sorted(r["tokens"] / r["elapsed"] for r in runs)
            best = rates[-1]
            # CPU seconds the engine (core) spent per 1000 generated tokens (least of the
            # runs): robust to other load on the machine, unlike wall-clock rates.
            cpu_per_k = min(1000 * r["cpu"] / r["tokens"] for r in runs)
            if name == "offline":
                offline_tps, offline_cpu = best, cpu_per_k
            share = f" = {100 * best / offline_tps:5.1f}%" if offline_tps else ""
            # No share when a run's CPU time rounds to 0 (too short for the clock to see).
            cpu_share = (
                f" = {100 * offline_cpu / cpu_per_k:5.1f}%" if offline_cpu and cpu_per_k else ""
            )
            client = ""
            if "client_cpu" in runs[0]:
                front_k = min(1000 * r["front_end_cpu"] / r["tokens"] for r in runs)
                client_k = min(1000 * r["client_cpu"] / r["tokens"] for r in runs)
                client = f", front end {front_k:.3f}, client {client_k:.3f}"
            all_rates = ", ".join(f"{x:.0f}" for x in rates)
            print(
                f"{labels[name]:21s} {best:8.1f} tokens/s{share} | "
                f"engine CPU {cpu_per_k:.3f} s/1k tokens{cpu_share}{client}"
                f"   (runs: {all_rates} tokens/s)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
