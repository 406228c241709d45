"""Many clients at once: disconnects free every KV block; concurrent answers are exact."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from server_harness import API_KEY

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def wait_for_idle(server, since: float, timeout: float = 30.0) -> int:
    """Poll the engine thread's stats snapshot until one taken after ``since`` shows no KV
    block and no request in use (bounded); return the blocks in use."""
    deadline = time.monotonic() + timeout
    snap = server.server.state.engine.stats
    while time.monotonic() < deadline:
        snap = server.server.state.engine.stats
        idle = snap.stats.num_running == 0 and snap.stats.num_waiting == 0
        if snap.time > since and idle and snap.num_used_blocks == 0:
            return 0
        time.sleep(0.05)
    return snap.num_used_blocks


async def _cut_stream(
    client: httpx.AsyncClient, path: str, body: dict, after: float, from_first_chunk: bool
) -> int:
    """Start a streaming request and drop the connection ``after`` seconds later, counted from
    its first chunk (the stream is running) or from the start (it may still be queued)."""
    chunks = 0

    async def read() -> None:
        nonlocal chunks
        async with client.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            if from_first_chunk:
                await lines.__anext__()
                chunks += 1
                await asyncio.wait_for(_drain(lines), after)
            else:
                await _drain(lines)

    async def _drain(lines) -> None:
        nonlocal chunks
        async for _ in lines:
            chunks += 1

    try:
        await (read() if from_first_chunk else asyncio.wait_for(read(), after))
    except asyncio.TimeoutError:
        pass
    return chunks


async def _cut_plain(client: httpx.AsyncClient, body: dict, after: float) -> None:
    with pytest.raises(httpx.ReadTimeout):
        await client.post("/v1/completions", json=body, timeout=after)


def _generated(server) -> int:
    """Tokens the engine core has generated so far (0 before its first stats message, which
    is the case when this module runs first on a fresh server)."""
    stats = server.server.state.engine.stats.stats
    return stats.generation_tokens_total if stats is not None else 0


def test_disconnect_flood_frees_every_block(server, http):
    long = {"max_tokens": 200, "ignore_eos": True, "temperature": 0.7}

    async def flood():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(
            base_url=server.base_url, headers=HEADERS, timeout=60, limits=limits
        ) as c:
            tasks = []
            for i in range(100):
                running = i % 4 < 3
                if i % 2:
                    body = {"prompt": f"request number {i}", "stream": True, **long}
                    tasks.append(_cut_stream(c, "/v1/completions", body, 0.2, running))
                else:
                    msgs = [{"role": "user", "content": f"chat number {i}"}]
                    body = {"messages": msgs, "stream": True, "n": 2, **long}
                    tasks.append(_cut_stream(c, "/v1/chat/completions", body, 0.2, running))
            # Non-streaming clients that give up are aborted too.
            tasks += [_cut_plain(c, {"prompt": f"plain {i}", **long}, 0.2) for i in range(10)]
            return await asyncio.gather(*tasks)

    generated_before = _generated(server)
    since = time.monotonic()
    chunks = asyncio.run(flood())
    assert sum(1 for c in chunks if c) >= 75, "streams were not running when cut"
    assert wait_for_idle(server, since) == 0, "KV blocks leaked after client disconnects"
    # The requests were aborted, not run to the end (160 sequences x 200 tokens).
    generated = _generated(server) - generated_before
    assert generated < 160 * 200 // 2
    assert server.server.state.engine.num_open_channels == 0
    # The next request is served, completely.
    since = time.monotonic()
    r = http.post("/v1/completions", json={"prompt": "after", "max_tokens": 7, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 7
    assert wait_for_idle(server, since) == 0


def test_concurrent_clients_get_offline_greedy_tokens(server, offline):
    from engine.sampling_params import SamplingParams

    prompts = [
        f"Client {i} asks about paged attention and {'caches ' * (i % 5)}" for i in range(24)
    ]
    lengths = [4 + (i * 7) % 20 for i in range(24)]
    refs = offline.generate(
        prompts,
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths],
        use_tqdm=False,
    )

    async def one(c: httpx.AsyncClient, i: int):
        body = {
            "prompt": prompts[i],
            "max_tokens": lengths[i],
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        if i % 3 == 0:  # some stream, some do not
            ids, text = [], ""
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        choice = httpx.Response(200, content=line[6:]).json()["choices"][0]
                        ids += [int(t[9:]) for t in choice["logprobs"]["tokens"]]
                        text += choice["text"]
            return ids, text
        r = await c.post("/v1/completions", json=body)
        choice = r.json()["choices"][0]
        return [int(t[9:]) for t in choice["logprobs"]["tokens"]], choice["text"]

    async def run_all():
        async with httpx.AsyncClient(base_url=server.base_url, headers=HEADERS, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(24)))

    since = time.monotonic()
    results = asyncio.run(run_all())
    for i, (ids, text) in enumerate(results):
        assert ids == refs[i].outputs[0].token_ids, f"client {i}"
        assert text == refs[i].outputs[0].text, f"client {i}"
    assert wait_for_idle(server, since) == 0
