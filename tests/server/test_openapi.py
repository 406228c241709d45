"""The OpenAPI document describes the server as it answers (issue 11, item 8): each route's
real statuses with the error envelope, the right media types, ``Allow`` on 405, and the limits
the server enforces. ``tests/schemathesis/run.py`` fuzzes the live server against it
(``--checks all``); these tests pin the document's parts that run relies on."""

from __future__ import annotations

import re

import pytest
from server_harness import error_of

from engine.server.openapi import decimal_below

ENVELOPE = {"$ref": "#/components/schemas/ErrorResponse"}
POSTS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]


@pytest.fixture(scope="module")
def spec(server):
    import httpx

    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        return c.get("/openapi.json").json()


def props(spec, name):
    return spec["components"]["schemas"][name]["properties"]


def integer_alt(schema):
    return next(a for a in schema.get("anyOf", [schema]) if a.get("type") == "integer")


def test_post_routes_list_their_real_responses(spec):
    for path in POSTS:
        responses = spec["paths"][path]["post"]["responses"]
        assert "422" not in responses, path
        for status in ("400", "404", "413", "500", "503"):
            assert responses[status]["content"] == {"application/json": {"schema": ENVELOPE}}
        # The session server requires an API key: /v1 routes say 401 and declare it.
        v1 = path.startswith("/v1")
        assert ("401" in responses) is v1, path
        assert ("security" in spec["paths"][path]["post"]) is v1
    assert spec["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    names = set(spec["components"]["schemas"])
    assert {"ErrorResponse", "ErrorInfo"} <= names
    assert not {"HTTPValidationError", "ValidationError"} & names
    error = spec["components"]["schemas"]["ErrorInfo"]
    assert set(error["required"]) == {"message", "type", "param", "code"}


def test_a_generative_model_does_not_document_embeddings(spec, http):
    """The route answers a 400 on a generative model, so the document leaves it out (the
    pooling server's document is checked in test_embeddings_api)."""
    assert "/v1/embeddings" not in spec["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/messages"} <= set(spec["paths"])
    assert error_of(http.post("/v1/embeddings", json={"input": "hi"}), 400)


def test_media_types(spec, server, http):
    completions = spec["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert set(completions) == {"application/json", "text/event-stream"}
    health = spec["paths"]["/health"]["get"]["responses"]
    assert "content" not in health["200"] and health["503"]["content"]["application/json"]
    r = http.get("/health")
    assert r.status_code == 200 and r.content == b"" and "content-type" not in r.headers
    metrics = spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert set(metrics) == {"text/plain"}
    assert http.get("/metrics").headers["content-type"].startswith("text/plain")


@pytest.mark.parametrize(
    "method, path, allow",
    [
        ("GET", "/v1/completions", "POST"),
        ("DELETE", "/health", "GET"),
        ("PUT", "/tokenize", "POST"),
    ],
)
def test_405_says_allow(http, method, path, allow):
    r = http.request(method, path)
    assert error_of(r, 405)["type"] == "invalid_request_error"
    assert allow in [m.strip() for m in r.headers["allow"].split(",")]


def test_served_limits_are_in_the_schema(spec, server):
    ctx = server.server.state.ctx
    vocab = ctx.token_ids.limit
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        p = props(spec, name)
        assert integer_alt(p["n"]) == {**integer_alt(p["n"]), "minimum": 1, "maximum": 128}
        assert integer_alt(p["prompt_logprobs"])["maximum"] == 20
        assert integer_alt(p["stop_token_ids"]["anyOf"][0]["items"])["maximum"] == vocab - 1
        assert integer_alt(p["max_tokens"])["maximum"] == ctx.max_model_len - 1
        seed = integer_alt(p["seed"])
        assert (seed["minimum"], seed["maximum"]) == (-(2**63), 2**63 - 1)  # exact integers
        text, strings = p["stop"]["anyOf"][0]["oneOf"]
        assert text["minLength"] == 1 and strings["items"]["minLength"] == 1
    completion = props(spec, "CompletionRequest")
    assert integer_alt(completion["logprobs"])["maximum"] == 20
    forms = completion["prompt"]["oneOf"]
    assert forms[0] == {"type": "string"}
    assert all(f["minItems"] == 1 for f in forms[1:])
    assert forms[2]["items"]["maximum"] == vocab - 1
    assert forms[1]["maxItems"] == ctx.options.limits.max_prompts
    chat = props(spec, "ChatCompletionRequest")
    assert integer_alt(chat["top_logprobs"])["maximum"] == 20
    assert chat["tools"]["anyOf"][0]["minItems"] == 1
    assert chat["chat_template"] == {**chat["chat_template"], "type": "null"}  # not trusted
    kwargs = chat["chat_template_kwargs"]["anyOf"][0]["propertyNames"]["not"]["enum"]
    assert {"tokenize", "padding", "chat_template"} <= set(kwargs)
    message = spec["components"]["schemas"]["ChatMessage"]["properties"]
    assert message["role"]["minLength"] == 1
    detokenize = props(spec, "DetokenizeRequest")["tokens"]["items"]
    assert detokenize["maximum"] == vocab - 1 and detokenize["minimum"] == 0


def test_logit_bias_key_pattern_matches_what_the_server_takes(spec, http, server):
    vocab = server.server.state.ctx.token_ids.model_vocab
    alt = props(spec, "CompletionRequest")["logit_bias"]["anyOf"][0]
    pattern = re.compile(alt["propertyNames"]["pattern"])
    for key in ["0", "7", str(vocab - 1), str(vocab), "007", "-1", "+3", " 3", "1.0", "x"]:
        body = {"prompt": "hi", "max_tokens": 1, "logit_bias": {key: 1}}
        accepted = http.post("/v1/completions", json=body).status_code == 200
        assert accepted is bool(pattern.match(key)), key


@pytest.mark.parametrize("limit", [1, 2, 9, 10, 11, 99, 100, 101, 384, 1000, 151936, 262208])
def test_decimal_below(limit):
    pattern = re.compile(f"^{decimal_below(limit)}$")
    for n in range(0, min(limit + 50, 3000)):
        assert bool(pattern.match(str(n))) is (n < limit), n
    for n in (limit - 1, limit, limit + 1, limit * 10):
        assert bool(pattern.match(str(n))) is (n < limit), n
    assert not pattern.match("0" + str(limit - 1))  # no leading zeros


def test_document_before_the_model_loads():
    """While starting the document has the static limits (503 everywhere), no served ones."""
    from engine.server.app import ServerOptions, ServerState, build_app

    app = build_app(ServerOptions(), ServerState())
    doc = app.openapi()
    n = props(doc, "CompletionRequest")["n"]
    assert n["maximum"] == 2**63 - 1 and "securitySchemes" not in doc["components"]
    assert "401" not in doc["paths"]["/v1/completions"]["post"]["responses"]


def test_openapi_is_open(server):
    """Clients fetch the document without a key (it says which routes need one)."""
    import httpx

    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        assert c.get("/openapi.json").status_code == 200
        assert c.get("/v1/models").status_code == 401
