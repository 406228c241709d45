"""Structured outputs over HTTP: OpenAI's ``response_format``, vLLM's ``structured_outputs``
and its older ``guided_*`` fields, on the real engine; the offline ``LLM`` on the same model
is the reference for exact tokens."""

from __future__ import annotations

import json
import re

import pytest

from engine.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Tokyo", "Lima"]},
        "rank": {"type": "integer", "minimum": 1, "maximum": 9},
        "open": {"type": "boolean"},
    },
    "required": ["city", "rank", "open"],
}
PROMPT = "The quick brown fox"


def check_schema(value) -> None:
    assert isinstance(value, dict) and set(value) == {"city", "rank", "open"}, value
    assert value["city"] in ("Paris", "Tokyo", "Lima")
    assert type(value["rank"]) is int and 1 <= value["rank"] <= 9
    assert type(value["open"]) is bool


def offline_structured(llm, prompt, max_tokens, **constraint):
    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**constraint),
    )
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def complete(http, **body):
    body = {"model": "tiny", "prompt": PROMPT, "temperature": 0, "max_tokens": 80, **body}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and body["error"]["type"] == "invalid_request_error"
    return body["error"]


def test_completions_fields_match_the_offline_engine(http, offline):
    compact = {"json": SCHEMA, "disable_any_whitespace": True}
    cases = [
        ({"structured_outputs": compact}, compact),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA},
                }
            },
            {"json": SCHEMA},
        ),
        ({"guided_json": SCHEMA}, {"json": SCHEMA}),
        ({"guided_json": json.dumps(SCHEMA)}, {"json": SCHEMA}),
        ({"guided_regex": r"[a-z]{2,6}-[0-9]{1,3}"}, {"regex": r"[a-z]{2,6}-[0-9]{1,3}"}),
        ({"guided_choice": ["left", "right"]}, {"choice": ["left", "right"]}),
        ({"guided_grammar": 'root ::= "(" [0-9]+ ")"'}, {"grammar": 'root ::= "(" [0-9]+ ")"'}),
        ({"structured_outputs": {"choice": ["up", "down"]}}, {"choice": ["up", "down"]}),
    ]
    for fields, constraint in cases:
        want = offline_structured(offline, PROMPT, 40, **constraint)
        got = complete(http, max_tokens=40, **fields)
        assert got["text"] == want.text, fields
        assert got["finish_reason"] == want.finish_reason, fields
    check_schema(json.loads(complete(http, structured_outputs=compact)["text"]))
    assert re.fullmatch(
        r"[a-z]{2,6}-[0-9]{1,3}", complete(http, guided_regex=r"[a-z]{2,6}-[0-9]{1,3}")["text"]
    )
    assert complete(http, guided_choice=["left", "right"])["text"] in ("left", "right")


def test_chat_response_format_json_schema(http, server):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Name a city as JSON."}],
        "temperature": 0.9,
        "seed": 4,
        "max_tokens": 80,
        "n": 2,
        "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True},
    }
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        check_schema(json.loads(choice["message"]["content"]))
    # OpenAI's form; a one-key schema keeps a random model's output short.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    body.pop("structured_outputs")
    body.update(
        n=1,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": True},
        },
    )
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert set(json.loads(choice["message"]["content"])) == {"ok"}
    assert type(json.loads(choice["message"]["content"])["ok"]) is bool
    assert server.engine.num_used_blocks == 0


def test_streamed_choice_equals_the_whole_text(http):
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "temperature": 0,
        "max_tokens": 20,
        "stream": True,
        "guided_choice": ["alpha beta gamma", "delta"],
    }
    text, reasons = "", []
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                reasons.append(choice["finish_reason"])
    assert text in ("alpha beta gamma", "delta") and reasons[-1] == "stop"
    body.pop("stream")
    assert complete(http, **body)["text"] == text


@pytest.mark.parametrize(
    "fields, param, fragment",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "objec"}},
                }
            },
            "response_format",
            "invalid JSON schema",
        ),
        (
            {"guided_json": {"type": "integer", "minimum": "x"}},
            "guided_json",
            "invalid JSON schema",
        ),
        ({"guided_regex": "[a-"}, "guided_regex", "invalid regex"),
        ({"guided_grammar": "root ::= nowhere"}, "guided_grammar", "invalid grammar"),
        ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs", "invalid grammar"),
        (
            {"response_format": {"type": "xml"}},
            "response_format",
            "must be one of text, json_object, json_schema",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", '"json_schema" object'),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
            "response_format",
            "JSON schema object",
        ),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "exactly one of",
        ),
        ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "unknown field"),
        ({"structured_outputs": {}}, "structured_outputs", "got none"),
        ({"guided_choice": []}, "guided_choice", "must have at least 1 item"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        (
            {"guided_regex": "a+", "response_format": {"type": "json_object"}},
            "guided_regex",
            "only one of",
        ),
        ({"guided_regex": "a+", "min_tokens": 3}, "min_tokens", "min_tokens cannot be combined"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_structured_outputs_are_400_and_the_server_keeps_serving(
    http, server, path, fields, param, fragment
):
    if path == "/v1/completions":
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, **fields}
    else:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            **fields,
        }
    err = error_of(http.post(path, json=body), 400)
    assert err["param"] == param, err
    assert fragment in err["message"], err
    assert "/project/" not in err["message"]
    assert complete(http, max_tokens=8, guided_choice=["fine"])["text"] == "fine"
    assert server.engine.num_used_blocks == 0


def test_response_format_text_is_unconstrained(http, offline):
    want = offline.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    got = complete(http, max_tokens=8, ignore_eos=True, response_format={"type": "text"})
    assert got["text"] == want.text and got["finish_reason"] == "length"


def test_grammars_compile_off_the_engine_thread(http, server, monkeypatch):
    """The server compiles a new grammar on a worker thread; the engine thread then finds it
    in the cache, so other requests never wait for a compilation."""
    import threading

    from engine.structured_output import grammar_key

    manager = server.engine.structured_outputs
    calls = []
    compile_ = manager.compile

    def recording(params):
        cached = grammar_key(params) in manager._cache
        calls.append((threading.current_thread().name, cached))
        return compile_(params)

    monkeypatch.setattr(manager, "compile", recording)
    schema = {**SCHEMA, "title": "compiled off the engine thread"}  # not cached yet
    check_schema(json.loads(complete(http, structured_outputs={"json": schema,
                                     "disable_any_whitespace": True})["text"]))  # fmt: skip
    first_thread, was_cached = calls[0]
    assert first_thread != "engine-loop" and not was_cached
    assert ("engine-loop", True) in calls[1:] and ("engine-loop", False) not in calls
    # A constraint that does not compile fails on the worker: a 400, and the engine never saw it.
    calls.clear()
    err = error_of(http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT,
                   "guided_regex": "(unclosed"}), 400)  # fmt: skip
    assert err["param"] == "guided_regex" and "regex" in err["message"]
    assert [name for name, _ in calls] and "engine-loop" not in [name for name, _ in calls]
    assert server.engine.num_used_blocks == 0
