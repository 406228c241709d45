"""Raw HTTP error cases: each answers the right 4xx with the OpenAI envelope, and the server
keeps answering correctly afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from server_harness import API_KEY, MAX_MODEL_LEN, error_of, keep_alive_after


@pytest.fixture(scope="module")
def reference(server):
    """A greedy answer taken before any error, to compare with after each."""
    with httpx.Client(
        base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    ) as c:
        body = {"prompt": "Hello world", "max_tokens": 6, "temperature": 0}
        return body, c.post("/v1/completions", json=body).json()["choices"][0]["text"]


@pytest.fixture(autouse=True)
def still_serving(http, reference):
    yield
    body, text = reference
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == text


def test_malformed_json(http):
    r = http.post(
        "/v1/completions", content=b'{"prompt": "x", ', headers={"content-type": "application/json"}
    )
    err = error_of(r, 400)
    assert err["type"] == "invalid_request_error" and "Malformed JSON" in err["message"]
    # Without a content type too (curl -d).
    r = http.post("/v1/chat/completions", content=b"{nope")
    assert "Malformed JSON" in error_of(r, 400)["message"]
    r = http.post("/v1/completions", json=["not", "an", "object"])
    assert "JSON object" in error_of(r, 400)["message"]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": "abc"}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/completions", {"prompt": "x", "n": 1.5}, "n"),
        ("/v1/completions", {"prompt": "x", "stop": 5}, "stop"),
        ("/v1/chat/completions", {"messages": "hello"}, "messages"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages.0.role"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "logprobs": "x"}, "logprobs"),
    ],
)
def test_wrong_types_are_400_naming_the_field(http, path, body, param):
    err = error_of(http.post(path, json=body), 400)
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
        ({"prompt": "x", "temperature": -0.5}, "temperature"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "top_k": -3}, "top_k"),
        ({"prompt": "x", "min_p": 2}, "min_p"),
        ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
        ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "n": 129}, "n"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "logprobs": -1}, "logprobs"),
        ({"prompt": "x", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids.0"),
        ({"prompt": [1, 2, 10**9]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
    ],
)
def test_invalid_values_are_400(http, body, param):
    err = error_of(http.post("/v1/completions", json=body), 400)
    assert err["param"] == param, err


@pytest.mark.parametrize(
    "body, param",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"response_format": {"type": "xml"}}, "response_format"),
    ],
)
def test_invalid_chat_values_are_400(http, body, param):
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    err = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == param, err


def test_prompt_too_long(http):
    long_ids = [5] * (MAX_MODEL_LEN + 10)
    err = error_of(http.post("/v1/completions", json={"prompt": long_ids}), 400)
    assert err["code"] == "context_length_exceeded"
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in err["message"]
    assert f"{MAX_MODEL_LEN + 10} tokens" in err["message"]
    # The prompt fits, the prompt plus max_tokens does not.
    err = error_of(http.post("/v1/completions", json={"prompt": [5] * 200, "max_tokens": 100}), 400)
    assert err["code"] == "context_length_exceeded" and "300 tokens" in err["message"]
    chat = {"messages": [{"role": "user", "content": "x " * 300}]}
    err = error_of(http.post("/v1/chat/completions", json=chat), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"


def test_unknown_model_404(http):
    err = error_of(http.post("/v1/completions", json={"prompt": "x", "model": "nope"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "`nope`" in err["message"]
    chat = {"model": "nope", "messages": [{"role": "user", "content": "x"}]}
    assert error_of(http.post("/v1/chat/completions", json=chat), 404)["param"] == "model"


def test_unknown_route_and_method(http):
    assert error_of(http.get("/v1/nothing"), 404)["type"] == "not_found_error"
    assert error_of(http.get("/v1/completions"), 405)["type"] == "invalid_request_error"


def test_api_key_required(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        body = {"prompt": "x", "max_tokens": 1}
        missing = error_of(c.post("/v1/completions", json=body), 401)
        assert missing["code"] == "invalid_api_key" and "Missing" in missing["message"]
        wrong = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert error_of(wrong, 401)["message"] == "Incorrect API key provided."
        assert wrong.headers["www-authenticate"] == "Bearer"
        # Operational endpoints stay open (probes carry no key).
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200


def test_body_too_large(http):
    big = b'{"prompt": "' + b"x" * (16 * 1024 * 1024 + 1) + b'"}'
    err = error_of(http.post("/v1/completions", content=big), 413)
    assert err["code"] == "request_too_large"

    def chunked():
        yield b'{"prompt": "'
        for _ in range(17):
            yield b"x" * (1024 * 1024)
        yield b'"}'

    r = http.post("/v1/completions", content=chunked())
    assert error_of(r, 413)["code"] == "request_too_large"


def test_request_log_line_shows_a_token_prompt_once_and_truncated(caplog):
    """``--max-log-len`` truncates the text and the ids; a token-id prompt is not repeated."""
    import logging
    from types import SimpleNamespace

    from engine.server.serving import ServingContext

    ctx = SimpleNamespace(options=SimpleNamespace(log_requests=True, max_log_len=3))
    with caplog.at_level(logging.INFO, logger="engine.server.requests"):
        ServingContext.log_request(ctx, "r1", [11, 12, 13, 14, 15], [11, 12, 13, 14, 15], "P")
        ServingContext.log_request(ctx, "r2", "abcdef", [1, 2, 3, 4], "P")
    first, second = (r.getMessage() for r in caplog.records)
    assert first == "request r1: prompt: None, params: P, prompt_token_ids: [11, 12, 13]"
    assert second == "request r2: prompt: 'abc', params: P, prompt_token_ids: [1, 2, 3]"


def test_unexpected_exception_is_a_whole_500_and_the_connection_lives_on(server, monkeypatch):
    """An exception no route handles answers a complete 500 envelope, and the same keep-alive
    connection serves the next request (it was reset before: the handler replied inside
    Starlette's ServerErrorMiddleware, which re-raised)."""

    async def broken_encode(text, add_special_tokens=True):
        if text == "trigger an internal error":
            raise RuntimeError("tokenizer exploded")
        return await real_encode(text, add_special_tokens)

    ctx = server.server.state.ctx
    real_encode = ctx.encode
    monkeypatch.setattr(ctx, "encode", broken_encode)
    body = json.dumps({"prompt": "trigger an internal error", "max_tokens": 2})
    err = keep_alive_after(server, body, 500)
    assert err["type"] == "server_error"
    assert err["message"] == "internal server error: RuntimeError: tokenizer exploded"
