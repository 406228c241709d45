"""What the HTTP front end spends per streamed token, without a model or a network.

    python -m engine.benchmarks.stream_overhead [--streams 256] [--tokens 128] [--endpoint chat]

The real FastAPI app and ``AsyncEngine`` run in this process over a stand-in engine core that
answers every running request with one token per step at once (as a decode step does), and
the ASGI app is called directly with a ``send`` that keeps the bytes: what is measured is the
front end's own work (output processing: detokenization, stop-string hold-back,
``RequestOutput``; the stream generator and SSE encoding; Starlette's response machinery), not
uvicorn's socket writes. It prints microseconds of CPU per token and per SSE chunk, once with
every token streamed and once per ``--stream-interval``, and non-streaming for comparison.

The tokenizer is word-level (token ``i`` is the word ``t<i>``), as in the GPU serving
benchmark, so that every token is text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any


class InstantCore:
    """An async engine-core client whose core answers at once: one token per running
    sequence per ``step()``; every request takes exactly ``max_tokens`` steps."""

    def __init__(self, tokenizer: Any, max_model_len: int = 4096) -> None:
        from engine.config import EngineConfig, ModelConfig
        from engine.engine_core.routing import DataParallelRouter

        self.tokenizer = tokenizer
        self.config = EngineConfig(
            ModelConfig(model="bench", served_model_name="bench", max_model_len=max_model_len)
        )
        self.router = DataParallelRouter(1)
        self.stats: dict[int, Any] = {}
        self.num_engines = 1
        self.core = None
        self._running: dict[str, list[int]] = {}  # request id -> [tokens left, position]

    def set_callbacks(self, on_outputs: Any, on_stats: Any, on_dead: Any) -> None:
        self._on_outputs = on_outputs

    async def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    async def add_requests(self, requests: list[Any]) -> None:
        for req in requests:
            self._running[req.request_id] = [req.sampling_params.max_tokens, 0]

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._running.pop(rid, None)

    def finish_sequences(self, sequences: list[tuple[str, int]]) -> None:
        for rid, _ in sequences:
            self._running.pop(rid, None)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def step(self) -> None:
        from engine.engine_core.messages import EngineCoreOutput

        outputs = []
        vocab = len(self.tokenizer)
        for rid, state in list(self._running.items()):
            state[0] -= 1
            state[1] += 1
            out = EngineCoreOutput(rid, [10 + (state[1] * 7919) % (vocab - 10)])
            if state[0] == 0:
                out.finish_reason = "length"
                del self._running[rid]
            outputs.append(out)
        if outputs:
            self._on_outputs(outputs)


async def _request(app: Any, path: str, body: dict, sink: list[int]) -> None:
    """Call the ASGI app for one POST; count the SSE chunks it sends."""
    payload = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"bench")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
    }
    sent = False
    forever = asyncio.Event()

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await forever.wait()  # the client never disconnects
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            sink[0] += message.get("body", b"").count(b"data: {")
            sink[1] += len(message.get("body", b""))

    await app(scope, receive, send)


async def _run(args: argparse.Namespace, stream: bool, interval: int) -> dict[str, float]:
    from engine.benchmarks.workload import write_word_level_tokenizer
    from engine.server.app import ServerOptions, ServerState, build_app
    from engine.server.async_engine import AsyncEngine
    from engine.server.metrics import ServerMetrics
    from engine.server.serving import ServingContext

    tokenizer = write_word_level_tokenizer(args.vocab_size)
    core = InstantCore(tokenizer)
    engine = AsyncEngine(core, stream_interval=interval)
    await engine.start()
    engine.observer = ServerMetrics("bench", log_stats_interval_s=0)
    options = ServerOptions()
    state = ServerState()
    app = build_app(options, state)
    state.set_ready(ServingContext(engine, options.serving), engine.observer)
    prompt = " ".join(f"t{10 + i}" for i in range(args.input_len))
    if args.endpoint == "chat":
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": prompt}]}
    else:
        path, body = "/v1/completions", {"prompt": prompt}
    body |= {"model": "bench", "max_tokens": args.tokens, "ignore_eos": True, "stream": stream}
    sink = [0, 0]
    tasks = [asyncio.create_task(_request(app, path, body, sink)) for _ in range(args.streams)]
    while core.num_running < args.streams:  # every request is in
        await asyncio.sleep(0)
    cpu, wall = time.process_time(), time.perf_counter()
    while core.num_running:
        core.step()
        for _ in range(3):  # let every stream write its chunk (as between engine steps)
            await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    tokens = args.streams * args.tokens
    return {
        "us_per_token": 1e6 * cpu / tokens,
        "us_per_chunk": 1e6 * cpu / max(1, sink[0]),
        "chunks": sink[0],
        "bytes_per_chunk": sink[1] / max(1, sink[0]),
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=256, help="Concurrent requests.")
    parser.add_argument("--tokens", type=int, default=128, help="Output tokens each.")
    parser.add_argument("--input-len", type=int, default=32, help="Prompt words.")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    parser.add_argument("--stream-interval", type=int, default=8, help="The second streamed run.")
    parser.add_argument("--repeats", type=int, default=3, help="Best of (least CPU).")
    args = parser.parse_args(argv)
    runs = [("streaming, every token", True, 1)]
    runs.append(
        (f"streaming, --stream-interval {args.stream_interval}", True, args.stream_interval)
    )
    runs.append(("non-streaming", False, 1))
    print(f"{args.streams} requests x {args.tokens} tokens, /v1/{args.endpoint}")
    for label, stream, interval in runs:
        best = min(
            (asyncio.run(_run(args, stream, interval)) for _ in range(args.repeats)),
            key=lambda r: r["us_per_token"],
        )
        chunk = f", {best['us_per_chunk']:.1f} us per chunk" if stream else ""
        print(
            f"{label:34s} {best['us_per_token']:6.1f} us CPU per token{chunk} "
            f"({best['chunks']} chunks of {best['bytes_per_chunk']:.0f} bytes)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
