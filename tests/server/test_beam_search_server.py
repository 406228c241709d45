"""vLLM's ``use_beam_search`` on /v1/completions and /v1/chat/completions: the same sequences
as the offline ``LLM.beam_search`` on the same weights, and clear 400s for what it refuses."""

from __future__ import annotations

import pytest
from server_harness import error_of

from engine.beam_search import BeamSearchParams

PROMPT = "A paged KV cache"
MESSAGES = [{"role": "user", "content": "What is beam search?"}]


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
