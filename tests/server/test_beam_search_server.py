"""vLLM's ``use_beam_search`` on /v1/completions and /v1/chat/completions: the same sequences
as the offline ``LLM.beam_search`` on the same weights, and clear 400s for what it refuses."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections import Counter

import pytest
from server_harness import API_KEY, error_of

from engine.beam_search import BeamSearchParams

PROMPT = "A paged KV cache"
MESSAGES = [{"role": "user", "content": "What is beam search?"}]
# The per-beam engine requests of engine.server.beam: <request id>-s<step>-<prompt>-<beam>.
BEAM_REQUEST = re.compile(r"-s(\d+)-\d+-\d+$")


def search_step(request_id: str) -> int | None:
    m = BEAM_REQUEST.search(request_id)
    return int(m.group(1)) if m else None


def offline_beams(offline, ids, width, max_tokens, **kw):
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, **kw)
    return offline.beam_search([ids], params)[0].sequences


@pytest.mark.parametrize("width", [1, 3])
def test_completions_match_offline(http, offline, server, width):
    body = {
        "prompt": PROMPT,
        "max_tokens": 6,
        "n": width,
        "use_beam_search": True,
        "ignore_eos": True,
        "length_penalty": 0.5,
    }
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    want = offline_beams(offline, ids, width, 6, ignore_eos=True, length_penalty=0.5)
    assert [c["index"] for c in data["choices"]] == list(range(width))
    assert [c["text"] for c in data["choices"]] == [s.text for s in want]
    assert [c["finish_reason"] for c in data["choices"]] == ["length"] * width
    assert data["usage"]["completion_tokens"] == 6 * width
    assert server.engine.num_used_blocks == 0


def test_completions_several_prompts(http, offline):
    body = {"prompt": [PROMPT, "Beams"], "max_tokens": 4, "n": 2, "use_beam_search": True}
    data = http.post("/v1/completions", json=body).json()
    texts = [c["text"] for c in sorted(data["choices"], key=lambda c: c["index"])]
    want = []
    for prompt in body["prompt"]:
        ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
        want += [s.text for s in offline_beams(offline, ids, 2, 4)]
    assert texts == want


@pytest.mark.parametrize("length_penalty", [-3.8e16, 3.8e16, -3e38, 3e38])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_huge_length_penalties_are_served(http, server, route, length_penalty):
    """Any finite length_penalty is valid; length ** penalty underflowed to 0.0 (a 500:
    ZeroDivisionError, found by schemathesis) or overflowed (OverflowError)."""
    body = {"max_tokens": 3, "n": 2, "use_beam_search": True, "ignore_eos": False,
            "length_penalty": length_penalty}  # fmt: skip
    body.update({"prompt": PROMPT} if route == "/v1/completions" else {"messages": MESSAGES})
    r = http.post(route, json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    assert server.engine.num_used_blocks == 0


def test_chat_matches_offline(http, offline, server):
    body = {"messages": MESSAGES, "max_tokens": 5, "n": 2, "use_beam_search": True}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    ids = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    want = offline_beams(offline, ids, 2, 5)
    assert [c["message"]["content"] for c in choices] == [s.text for s in want]
    assert [c["message"]["role"] for c in choices] == ["assistant", "assistant"]
    assert server.engine.num_used_blocks == 0


@pytest.mark.parametrize(
    ("route", "extra", "param", "words"),
    [
        ("/v1/completions", {"n": 11, "ignore_eos": True}, "n", "at most 10"),
        ("/v1/chat/completions", {"n": 11, "ignore_eos": True}, "n", "at most 10"),
        ("/v1/completions", {"n": 1000}, "n", "[1, 128]"),
        ("/v1/completions", {"n": 2, "stream": True}, "stream", "stream"),
        ("/v1/chat/completions", {"n": 2, "stream": True}, "stream", "stream"),
        ("/v1/completions", {"n": 2, "logprobs": 2}, "logprobs", "logprobs"),
        ("/v1/completions", {"n": 2, "early_stopping": "sometimes"}, "early_stopping", ""),
    ],
)
def test_refusals(http, server, route, extra, param, words):
    body = {"max_tokens": 4, "use_beam_search": True, **extra}
    if route == "/v1/completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = MESSAGES
    err = error_of(http.post(route, json=body), 400)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert words in err["message"]
    assert server.engine.num_used_blocks == 0


def test_each_search_step_is_one_engine_step(http, offline, server, monkeypatch):
    """A step's beam requests reach the core together, so it scores them in one step (as the
    offline path's one generate call); added one by one, each started a core step of its own."""
    core = server.engine
    real_step = core.step
    per_core_step: list[Counter] = []  # search step -> beams scored, per core step with beams

    def step():
        outputs = real_step()
        beams = Counter(search_step(o.request_id) for o in outputs)
        beams.pop(None, None)
        if beams:
            per_core_step.append(beams)
        return outputs

    monkeypatch.setattr(core, "step", step)
    width, max_tokens = 3, 5
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "n": width, "use_beam_search": True,
            "ignore_eos": True}  # fmt: skip
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    server.engine  # noqa: B018 - a barrier: the core handled everything
    monkeypatch.undo()
    # ignore_eos: no hypothesis ends before max_tokens, so every step runs, in order.
    assert per_core_step == [Counter({0: 1})] + [Counter({s: width}) for s in range(1, max_tokens)]
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    want = offline_beams(offline, ids, width, max_tokens, ignore_eos=True)
    assert [c["text"] for c in r.json()["choices"]] == [s.text for s in want]


def test_disconnect_aborts_every_beam_in_flight(server, monkeypatch):
    """A client that leaves mid-search: the front end aborts every beam request the core
    holds, the search adds no more, and no KV block stays in use."""
    core = server.engine
    real_step, real_abort = core.step, core.abort_requests
    in_flight: set[str] = set()
    holding, release = threading.Event(), threading.Event()
    aborted: set[str] = set()
    steps_seen: set[int] = set()

    def step():
        held = {rid for rid in core._requests if (search_step(rid) or 0) >= 2}
        if held and not holding.is_set():
            in_flight.update(held)
            holding.set()  # the core holds a search step's beams, not yet scored
            release.wait(30)
        outputs = real_step()
        steps_seen.update(s for o in outputs if (s := search_step(o.request_id)) is not None)
        return outputs

    def abort_requests(request_ids):
        aborted.update([request_ids] if isinstance(request_ids, str) else request_ids)
        return real_abort(request_ids)

    monkeypatch.setattr(core, "step", step)
    monkeypatch.setattr(core, "abort_requests", abort_requests)
    state = server.server.state.engine
    body = json.dumps({"prompt": PROMPT, "max_tokens": 200, "n": 4, "use_beam_search": True,
                       "ignore_eos": True}).encode()  # fmt: skip
    sock = socket.create_connection(("127.0.0.1", int(server.base_url.rsplit(":", 1)[1])))
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert holding.wait(60), "the search did not reach its third step"
    finally:
        sock.close()  # the client goes away while the core holds the beams
    try:
        deadline = time.monotonic() + 30
        while state.num_open_channels and time.monotonic() < deadline:
            time.sleep(0.01)
        assert state.num_open_channels == 0, "the disconnect was not noticed"
    finally:
        release.set()
    core = server.engine  # a barrier: the core handled the aborts
    monkeypatch.undo()
    assert len(in_flight) == 4
    assert in_flight <= aborted, "beam requests in flight were not aborted"
    assert max(steps_seen) <= 2, "the search went on after the client left"
    assert not core.has_unfinished_requests()
    assert core.num_used_blocks == 0
