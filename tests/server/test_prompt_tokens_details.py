"""``--enable-prompt-tokens-details``: ``usage.prompt_tokens_details.cached_tokens`` counts the
prompt tokens the prefix cache served, in chat and completions responses, streamed or not."""

from __future__ import annotations

import json

import httpx
import pytest
from server_harness import RunningServer, engine_config

from engine.server.app import ServerOptions
from engine.server.serving import ServingOptions

BLOCK = 16  # engine_config's block size
LONG = " ".join(f"word{i}" for i in range(15))  # several blocks of prompt


@pytest.fixture(scope="module")
def details_server(tiny_model_dir):
    from engine.engine_core.core import EngineCore

    options = ServerOptions(serving=ServingOptions(enable_prompt_tokens_details=True))
    with RunningServer(lambda: EngineCore.from_config(engine_config(tiny_model_dir)), options) as s:
        yield s


def _stream_usage(base: str, route: str, body: dict) -> dict:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", base + route, json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    return events[-1]["usage"]


def test_cached_tokens_in_completions(details_server):
    base = details_server.base_url
    body = {"model": "tiny", "prompt": "first " + LONG, "max_tokens": 2}
    first = httpx.post(base + "/v1/completions", json=body, timeout=60).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    again = httpx.post(base + "/v1/completions", json=body, timeout=60).json()["usage"]
    cached = again["prompt_tokens_details"]["cached_tokens"]
    # Whole blocks of the same prompt, short of its last token (recomputed for its logits).
    assert cached % BLOCK == 0 and 0 < cached < again["prompt_tokens"]
    assert again["prompt_tokens"] - cached <= BLOCK
    streamed = _stream_usage(base, "/v1/completions", body)
    assert streamed["prompt_tokens_details"] == {"cached_tokens": cached}
    # Two prompts: their cached tokens add up.
    two = {**body, "prompt": [body["prompt"], "second " + LONG]}
    usage = httpx.post(base + "/v1/completions", json=two, timeout=60).json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": cached}


def test_cached_tokens_in_chat(details_server):
    base = details_server.base_url
    body = {"model": "tiny", "messages": [{"role": "user", "content": LONG}], "max_tokens": 2}
    httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
    usage = httpx.post(base + "/v1/chat/completions", json=body, timeout=60).json()["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached % BLOCK == 0 and 0 < cached < usage["prompt_tokens"]
    assert _stream_usage(base, "/v1/chat/completions", body)["prompt_tokens_details"] == {
        "cached_tokens": cached
    }


def test_left_out_without_the_flag(http):
    body = {"model": "tiny", "prompt": LONG, "max_tokens": 2}
    for _ in range(2):
        usage = http.post("/v1/completions", json=body).json()["usage"]
    assert usage.get("prompt_tokens_details") is None
