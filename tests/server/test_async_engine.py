"""The engine thread and its failure modes, against a deterministic fake engine.

These cover what a real model cannot be made to do on demand: an engine step that raises, and
an idle engine thread that must sleep rather than spin.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from fake_engine import FakeEngine
from server_harness import RunningServer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from engine.testing.tiny_models import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def test_engine_failure_answers_500_and_health_503(tokenizer):
    fake = FakeEngine(tokenizer, step_delay=0.01)
    with RunningServer(lambda: fake) as srv, httpx.Client(base_url=srv.base_url, timeout=30) as c:
        assert c.get("/health").status_code == 200
        results = {}

        def long_request():
            results["r"] = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 120})

        t = threading.Thread(target=long_request)
        t.start()
        # Fail the engine once the request is running.
        deadline = time.monotonic() + 10
        while not fake.requests and time.monotonic() < deadline:
            time.sleep(0.005)
        fake.fail_on_step = RuntimeError("device lost")
        t.join(30)
        assert not t.is_alive(), "the in-flight request hung"
        r = results["r"]
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["code"] == "engine_dead" and "device lost" in err["message"]
        assert err["type"] == "server_error"

        health = c.get("/health")
        assert health.status_code == 503
        assert health.json()["error"]["code"] == "engine_dead"
        after = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert after.status_code == 500 and after.json()["error"]["code"] == "engine_dead"
        stream = c.post("/v1/completions", json={"prompt": "hi", "stream": True})
        assert stream.status_code == 500


def test_engine_failure_ends_open_streams(tokenizer):
    fake = FakeEngine(tokenizer, step_delay=0.01)
    with RunningServer(lambda: fake) as srv, httpx.Client(base_url=srv.base_url, timeout=30) as c:
        body = {"prompt": "hello", "max_tokens": 120, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line)
            assert first.startswith("data: {")
            fake.fail_on_step = RuntimeError("kaboom")
            rest = [line for line in lines if line]
        assert '"engine_dead"' in rest[-2] and rest[-1] == "data: [DONE]"


def test_idle_engine_thread_sleeps(tokenizer):
    fake = FakeEngine(tokenizer)
    calls = []
    original = fake.has_unfinished_requests

    def counting():
        calls.append(1)
        return original()

    fake.has_unfinished_requests = counting
    with RunningServer(lambda: fake) as srv, httpx.Client(base_url=srv.base_url, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200
        time.sleep(0.05)  # let the thread go back to sleep
        before = len(calls)
        time.sleep(0.3)
        assert len(calls) - before <= 1, "the idle engine thread is polling"
        # And it wakes up for the next request.
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200


def test_slow_stream_reader_gets_every_token(tokenizer):
    """A reader slower than the engine gets merged chunks, never a lost or repeated token."""
    fake = FakeEngine(tokenizer, step_delay=0.0)
    with RunningServer(lambda: fake) as srv, httpx.Client(base_url=srv.base_url, timeout=30) as c:
        body = {"prompt": "abc", "max_tokens": 60, "n": 2, "logprobs": 0}
        full = c.post("/v1/completions", json=body).json()
        texts = {0: "", 1: ""}
        lp_tokens = {0: 0, 1: 0}
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                time.sleep(0.01)
                choice = httpx.Response(200, content=line[6:]).json()["choices"][0]
                texts[choice["index"]] += choice["text"]
                lp_tokens[choice["index"]] += len(choice["logprobs"]["tokens"])
        for choice in full["choices"]:
            assert texts[choice["index"]] == choice["text"]
            assert lp_tokens[choice["index"]] == 60


def test_rejected_request_leaves_engine_usable(tokenizer):
    fake = FakeEngine(tokenizer, max_model_len=64)
    with RunningServer(lambda: fake) as srv, httpx.Client(base_url=srv.base_url, timeout=30) as c:
        # Token ids that pass the server's checks but that the engine refuses.
        r = c.post("/v1/completions", json={"prompt": [0, 5, 5], "max_tokens": 1})
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {
            "message": "token 0 is reserved",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": None,
        }
        assert c.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


def test_stream_interval_sends_a_chunk_every_n_tokens(tokenizer):
    """--stream-interval 4: the first token streams at once, then every 4 tokens (chunks
    merge for a reader that fell behind), the rest with the finish; the text is the
    non-streamed text."""
    from engine.server.launcher import LaunchOptions

    fake = FakeEngine(tokenizer, step_delay=0.002)
    launch = LaunchOptions(
        port=0, log_stats_interval=0, access_log=False, exit_on_engine_death=False,
        stream_interval=4,
    )  # fmt: skip
    with (
        RunningServer(lambda: fake, launch=launch) as srv,
        httpx.Client(base_url=srv.base_url, timeout=30) as c,
    ):
        body = {"prompt": "interval", "max_tokens": 18, "logprobs": 0}
        full = c.post("/v1/completions", json=body).json()["choices"][0]
        sizes, text = [], ""
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = httpx.Response(200, content=line[6:]).json()["choices"][0]
                    sizes.append(len(choice["logprobs"]["tokens"]))
                    text += choice["text"]
    assert text == full["text"] and sum(sizes) == 18
    assert len(sizes) >= 3, sizes
    sent = 0
    for size in sizes[:-1]:  # after 1 token, then after 1 + 4k tokens
        sent += size
        assert size > 0 and sent % 4 == 1, sizes
