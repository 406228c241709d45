"""The Anthropic Messages API (``/v1/messages``) through the official ``anthropic`` client, on
the real engine: the same prompt and greedy tokens as the OpenAI chat route, Anthropic's
event sequence, stop reasons, tool use through the server's parsers and forced tool use,
``count_tokens``, and errors in Anthropic's envelope."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from server_harness import API_KEY, RunningServer
from test_tools import TWO_CALLS, ScriptedEngine, tool_options

SYSTEM = "You are terse."
# One conversation, as Anthropic writes it and as OpenAI does (text blocks join with "\n").
ANTHROPIC_TURNS = [
    {"role": "user", "content": "Hello world"},
    {"role": "assistant", "content": [{"type": "text", "text": "Hi."}, {"type": "text", "text": "Yes?"}]},
    {"role": "user", "content": [{"type": "text", "text": "The quick brown fox"}]},
]  # fmt: skip
OPENAI_TURNS = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Hello world"},
    {"role": "assistant", "content": "Hi.\nYes?"},
    {"role": "user", "content": "The quick brown fox"},
]
WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
TIME = {"name": "get_time", "description": "Current time", "input_schema": {"type": "object"}}
# Bounded arguments, so that a random model's constrained output ends within max_tokens.
CITY = {
    "name": "get_weather",
    "description": "Weather of a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture()
def ac(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture()
def raw(server) -> httpx.Client:
    """Plain HTTP with Anthropic's key header (to read events and error bodies as sent)."""
    with httpx.Client(
        base_url=server.base_url, headers={"x-api-key": API_KEY}, timeout=60
    ) as client:
        yield client


def kw(**body) -> dict:
    """``body`` as the client's keyword arguments: its latest versions have no sampling
    parameters (temperature, top_p, top_k), which go in ``extra_body`` instead."""
    extra = {k: body.pop(k) for k in ("temperature", "top_p", "top_k") if k in body}
    return {**body, "extra_body": extra} if extra else body


def sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    """``(event name, data)`` of each event, checking that the name and the data agree."""
    assert response.headers["content-type"].startswith("text/event-stream")
    events = []
    for chunk in response.text.split("\n\n"):
        if not chunk.strip():
            continue
        lines = chunk.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), chunk
        name, data = lines[0][7:], json.loads(lines[1][6:])
        assert data["type"] == name
        events.append((name, data))
    return events


def texts(message) -> list[str]:
    """The text of each text block (the client's streamed blocks are another class)."""
    assert all(b.type == "text" for b in message.content)
    return [b.text for b in message.content]


def anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    return body["error"]["message"]


def no_blocks_used(server) -> None:
    assert server.engine.num_used_blocks == 0


# ------------------------------------------------------------ generation


def test_greedy_text_equals_the_chat_route(ac, client, server):
    """The same conversation gives the same prompt and the same greedy tokens on both routes;
    the stop reason follows the chat route's finish reason."""
    for max_tokens in (16, 3):
        chat = client.chat.completions.create(
            model="tiny", messages=OPENAI_TURNS, max_tokens=max_tokens, temperature=0
        )
        msg = ac.messages.create(
            **kw(
                model="tiny",
                system=SYSTEM,
                messages=ANTHROPIC_TURNS,
                max_tokens=max_tokens,
                temperature=0,
            )
        )
        text = chat.choices[0].message.content
        assert text, "the tiny model wrote nothing: pick another conversation"
        assert msg.type == "message" and msg.role == "assistant" and msg.model == "tiny"
        assert msg.id.startswith("msg_")
        assert [(b.type, b.text) for b in msg.content] == [("text", text)]
        assert msg.usage.input_tokens == chat.usage.prompt_tokens
        assert msg.usage.output_tokens == chat.usage.completion_tokens
        finish = chat.choices[0].finish_reason
        assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[finish]
        assert msg.stop_sequence is None
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 3
    # System as text blocks: the same prompt.
    blocks = ac.messages.create(
        **kw(
            model="tiny",
            system=[{"type": "text", "text": SYSTEM}],
            messages=ANTHROPIC_TURNS,
            max_tokens=3,
            temperature=0,
        )
    )
    assert texts(blocks) == texts(msg) and blocks.usage == msg.usage
    no_blocks_used(server)


def test_stream_events_in_anthropic_order(ac, raw, server):
    body = dict(model="tiny", system=SYSTEM, messages=ANTHROPIC_TURNS, max_tokens=16,
                temperature=0)  # fmt: skip
    whole = ac.messages.create(**kw(**body))
    events = sse_events(raw.post("/v1/messages", json={**body, "stream": True}))
    names = [name for name, _ in events]
    deltas = names.count("content_block_delta")
    assert deltas >= 1
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"] == {"input_tokens": whole.usage.input_tokens, "output_tokens": 0}
    assert events[1][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    text = ""
    for _, data in events[3 : 3 + deltas]:
        assert data["index"] == 0 and data["delta"]["type"] == "text_delta"
        text += data["delta"]["text"]
    assert text == whole.content[0].text
    assert events[-3][1] == {"type": "content_block_stop", "index": 0}
    assert events[-2][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": whole.stop_reason, "stop_sequence": None},
        "usage": {"output_tokens": whole.usage.output_tokens},
    }
    # The official client's accumulation gives the non-streamed message.
    with ac.messages.stream(**kw(**body)) as stream:
        final = stream.get_final_message()
    assert texts(final) == texts(whole) and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    no_blocks_used(server)


def test_stop_sequences(ac, server):
    body = dict(model="tiny", messages=ANTHROPIC_TURNS, max_tokens=16, temperature=0)
    text = ac.messages.create(**kw(**body)).content[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    expected = text[: text.index(stop)]
    msg = ac.messages.create(**kw(**body), stop_sequences=["never-written", stop])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert "".join(b.text for b in msg.content) == expected
    with ac.messages.stream(**kw(**body), stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert texts(final) == texts(msg)
    no_blocks_used(server)


def test_prefill_continues_the_last_assistant_message(ac, client):
    turns = [*ANTHROPIC_TURNS, {"role": "assistant", "content": "Sure"}]
    msg = ac.messages.create(**kw(model="tiny", messages=turns, max_tokens=5, temperature=0))
    chat = client.chat.completions.create(
        model="tiny",
        messages=[*OPENAI_TURNS[1:], {"role": "assistant", "content": "Sure"}],
        max_tokens=5,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert "".join(b.text for b in msg.content) == chat.choices[0].message.content
    assert msg.usage.input_tokens == chat.usage.prompt_tokens


def test_sampling_fields_and_metadata_are_taken(ac, server):
    msg = ac.messages.create(
        **kw(
            model="tiny",
            messages=USER,
            max_tokens=4,
            temperature=0.7,
            top_p=0.9,
            top_k=5,
            metadata={"user_id": "u-1"},
        )
    )
    assert msg.usage.output_tokens >= 1
    no_blocks_used(server)


# ------------------------------------------------------------ count_tokens


def test_count_tokens_is_the_prompt_the_engine_sees(ac, http, server):
    counted = ac.messages.count_tokens(model="tiny", system=SYSTEM, messages=ANTHROPIC_TURNS)
    msg = ac.messages.create(
        **kw(model="tiny", system=SYSTEM, messages=ANTHROPIC_TURNS, max_tokens=1, temperature=0)
    )
    assert counted.input_tokens == msg.usage.input_tokens
    tok = http.post("/tokenize", json={"messages": OPENAI_TURNS}).json()
    assert counted.input_tokens == tok["count"]
    # Tools reach the prompt (the session server has no parser: count_tokens needs none).
    with_tools = ac.messages.count_tokens(model="tiny", messages=USER, tools=[WEATHER])
    plain = ac.messages.count_tokens(model="tiny", messages=USER)
    assert with_tools.input_tokens >= plain.input_tokens
    no_blocks_used(server)


# ------------------------------------------------------------ errors and auth


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"messages": USER}, "max_tokens: this field is required"),
        ({"messages": [], "max_tokens": 4}, "messages: must have at least 1 item"),
        ({"messages": [{"role": "system", "content": "x"}], "max_tokens": 4},
         "messages.0: role must be 'user' or 'assistant'"),
        # Not a string: the role picks the message's model, and {} is no dictionary key (a 500).
        ({"messages": [{"role": {}, "content": "x"}], "max_tokens": 4},
         "messages.0: role must be 'user' or 'assistant'"),
        ({"messages": [{"role": ["user"], "content": "x"}], "max_tokens": 4},
         "messages.0: role must be 'user' or 'assistant'"),
        ({"messages": USER, "max_tokens": 4, "tools": [], "tool_choice": {"type": "any"}},
         "tool_choice is only allowed when tools are given"),
        ({"messages": USER, "max_tokens": "5"}, "max_tokens: expected an integer, got a string"),
        ({"messages": USER, "max_tokens": 0}, "max_tokens: must be at least 1"),
        ({"messages": [{"role": "user", "content": 5}], "max_tokens": 4}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": []}], "max_tokens": 4},
         "messages.0.content: must have at least 1 item"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}],
          "max_tokens": 4}, "'document'"),
        ({"messages": USER, "max_tokens": 4, "temperature": 1.5},
         "temperature: must be at most 1"),
        ({"messages": USER, "max_tokens": 4, "stop_sequences": "x"},
         "stop_sequences: expected an array"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                      "input": {}}]}], "max_tokens": 4},
         "'tool_use'"),
        ({"messages": [*USER, {"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}], "max_tokens": 4},
         "messages.1.content.0: Input tag 'tool_result'"),
        ({"messages": USER, "max_tokens": 4, "tools": [{**WEATHER, "name": "get weather"}],
          "tool_choice": {"type": "none"}}, "tools.0.name"),
        ({"messages": USER, "max_tokens": 4, "tool_choice": {"type": "any"}},
         "tool_choice is only allowed when tools are given"),
        ({"messages": USER, "max_tokens": 4, "tools": [WEATHER, WEATHER],
          "tool_choice": {"type": "none"}}, "duplicate tool name"),
        ({"messages": USER, "max_tokens": 300}, "maximum context length"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}],
          "max_tokens": 4}, "this model takes no image inputs"),
    ],
)  # fmt: skip
def test_bad_requests_are_400_in_anthropic_envelope(raw, server, body, words):
    r = raw.post("/v1/messages", json={"model": "tiny", **body})
    message = anthropic_error(r, 400, "invalid_request_error")
    assert words in message
    no_blocks_used(server)


def test_unhashable_role_on_count_tokens_is_a_400(raw):
    r = raw.post("/v1/messages/count_tokens",
                 json={"model": "tiny", "messages": [{"role": {}, "content": ""}], "tools": []})  # fmt: skip
    assert "role must be 'user' or 'assistant'" in anthropic_error(r, 400, "invalid_request_error")


def test_empty_tools_are_no_tools(raw):
    """``tools: []`` (which the schema allows) is a request without tools, on both routes;
    it was a 500 (the chat path's tools take at least one)."""
    counts = [
        raw.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": USER, **extra})
        for extra in ({}, {"tools": []}, {"tools": [], "tool_choice": {"type": "none"}})
    ]
    assert [r.status_code for r in counts] == [200] * 3
    assert len({r.json()["input_tokens"] for r in counts}) == 1
    r = raw.post("/v1/messages", json={"model": "tiny", "messages": USER, "max_tokens": 2,
                                       "tools": []})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["stop_reason"] in ("max_tokens", "end_turn")


def test_errors_through_the_client(ac):
    with pytest.raises(anthropic.NotFoundError) as e:
        ac.messages.create(model="gpt-9", messages=USER, max_tokens=4)
    assert e.value.body["error"]["type"] == "not_found_error"
    assert "gpt-9" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        ac.messages.count_tokens(model="gpt-9", messages=USER)
    with pytest.raises(anthropic.BadRequestError) as e:
        ac.messages.create(model="tiny", messages=[{"role": "tool", "content": "x"}], max_tokens=4)
    assert e.value.body["error"]["type"] == "invalid_request_error"


def test_api_key_headers_and_envelopes(server):
    url = server.base_url
    body = {"model": "tiny", "messages": USER, "max_tokens": 1}
    r = httpx.post(url + "/v1/messages", json=body)
    assert "x-api-key" in anthropic_error(r, 401, "authentication_error")
    r = httpx.post(url + "/v1/messages", json=body, headers={"x-api-key": "wrong"})
    anthropic_error(r, 401, "authentication_error")
    # Both headers are accepted, on either API.
    bearer = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.post(url + "/v1/messages", json=body, headers=bearer, timeout=60).is_success
    chat = {"model": "tiny", "messages": USER, "max_tokens": 1}
    r = httpx.post(url + "/v1/chat/completions", json=chat, headers={"x-api-key": API_KEY},
                   timeout=60)  # fmt: skip
    assert r.status_code == 200
    # The OpenAI routes keep OpenAI's envelope.
    r = httpx.post(url + "/v1/chat/completions", json=chat)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", messages=USER, max_tokens=1
        )
    r = httpx.post(url + "/v1/messages", content=b"{", headers={"x-api-key": API_KEY})
    assert "Malformed JSON" in anthropic_error(r, 400, "invalid_request_error")
    r = httpx.get(url + "/v1/messages", headers={"x-api-key": API_KEY})
    anthropic_error(r, 405, "invalid_request_error")


# ------------------------------------------------------------ forced tool use (tiny model)


@pytest.mark.parametrize(
    "tool_choice",
    [
        {"type": "any", "disable_parallel_tool_use": True},
        {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    ],
    ids=["any", "tool"],
)
def test_forced_tool_use_is_a_tool_use_block(ac, server, tool_choice):
    """Forced tool use needs no parser flags: guided decoding writes a call that fits the
    schema; streamed and not, the same call."""
    body = dict(model="tiny", messages=USER, tools=[CITY], tool_choice=tool_choice,
                max_tokens=64, temperature=0)  # fmt: skip
    msg = ac.messages.create(**kw(**body))
    assert msg.stop_reason == "tool_use"
    (block,) = msg.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.id.startswith("toolu_") and block.input["city"] in ("Paris", "Rome")
    with ac.messages.stream(**kw(**body)) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content] == [
        ("tool_use", block.name, block.input)
    ]
    no_blocks_used(server)


# ------------------------------------------------------------ tool parsers (scripted output)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    from engine.testing.tiny_models import build_tokenizer

    engine = ScriptedEngine(build_tokenizer(tmp_path_factory.mktemp("tok")), max_model_len=512,
                            step_delay=0.0)  # fmt: skip
    engine.script = TWO_CALLS
    with RunningServer(lambda: engine, tool_options("hermes")) as running:
        yield running


@pytest.fixture()
def sac(scripted) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=scripted.base_url, api_key="x", max_retries=0)


def blocks(message) -> list[tuple]:
    return [
        (b.type, b.text) if b.type == "text" else (b.type, b.name, b.input) for b in message.content
    ]


CALLS = [
    ("text", "Let me check.\n"),
    ("tool_use", "get_weather", {"city": "Paris"}),
    ("tool_use", "get_time", {"tz": "CET"}),
]


def test_tool_use_round_trip_through_the_parser(scripted, sac):
    msg = sac.messages.create(model="fake-model", messages=USER, tools=[WEATHER, TIME],
                              max_tokens=200)  # fmt: skip
    assert msg.stop_reason == "tool_use" and blocks(msg) == CALLS
    ids = [b.id for b in msg.content if b.type == "tool_use"]
    assert all(i.startswith("toolu_") for i in ids) and ids[0] != ids[1]
    # Streamed: the client accumulates the same blocks from input_json_delta events.
    with sac.messages.stream(model="fake-model", messages=USER, tools=[WEATHER, TIME],
                             max_tokens=200) as stream:  # fmt: skip
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and blocks(final) == CALLS
    # One call only when parallel tool use is off.
    one = sac.messages.create(model="fake-model", messages=USER, tools=[WEATHER, TIME],
                              tool_choice={"type": "auto", "disable_parallel_tool_use": True},
                              max_tokens=200)  # fmt: skip
    assert blocks(one) == CALLS[:2]
    # tool_choice none: the text as it is.
    plain = sac.messages.create(model="fake-model", messages=USER, tools=[WEATHER, TIME],
                                tool_choice={"type": "none"}, max_tokens=200)  # fmt: skip
    assert blocks(plain) == [("text", TWO_CALLS)] and plain.stop_reason == "end_turn"
    # The results go back as tool_result blocks: the template renders them as tool messages.
    history = [
        *USER,
        {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": ids[0], "content": "18C"},
                {"type": "tool_result", "tool_use_id": ids[1],
                 "content": [{"type": "text", "text": "12:00"}]},
            ],
        },
    ]  # fmt: skip
    counted = sac.messages.count_tokens(model="fake-model", messages=history, tools=[WEATHER])
    openai_history = [
        *USER,
        {
            "role": "assistant",
            "content": "Let me check.\n",
            "tool_calls": [
                {"id": ids[0], "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": ids[1], "type": "function",
                 "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": ids[0], "content": "18C"},
        {"role": "tool", "tool_call_id": ids[1], "content": "12:00"},
    ]  # fmt: skip
    tools = [{"type": "function", "function": {"name": "get_weather", "description":
              "Weather of a city", "parameters": WEATHER["input_schema"]}}]  # fmt: skip
    with httpx.Client(base_url=scripted.base_url, timeout=30) as c:
        tok = c.post("/tokenize", json={"messages": openai_history, "tools": tools}).json()
        text = c.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert counted.input_tokens == tok["count"]
    assert f"[result {ids[1]}: 12:00]" in text and "[call get_weather city=Paris]" in text
    answer = sac.messages.create(model="fake-model", messages=history, tools=[WEATHER],
                                 max_tokens=200)  # fmt: skip
    assert answer.usage.input_tokens == tok["count"]


def test_tool_use_stream_events(scripted):
    body = {"model": "fake-model", "messages": USER, "tools": [WEATHER, TIME],
            "max_tokens": 200, "stream": True}  # fmt: skip
    with httpx.Client(base_url=scripted.base_url, timeout=30) as c:
        events = sse_events(c.post("/v1/messages", json=body))
    starts = [(d["index"], d["content_block"]["type"]) for n, d in events
              if n == "content_block_start"]  # fmt: skip
    assert starts == [(0, "text"), (1, "tool_use"), (2, "tool_use")]
    names = [n for n, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    assert names.count("content_block_stop") == 3
    json_deltas = [d["delta"]["partial_json"] for n, d in events
                   if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]  # fmt: skip
    assert [json.loads(j) for j in json_deltas] == [{"city": "Paris"}, {"tz": "CET"}]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


# ------------------------------------------------------------ the OpenAPI document


def test_openapi_documents_the_messages_routes(http, server):
    spec = http.get("/openapi.json").json()
    anthropic_envelope = {"$ref": "#/components/schemas/AnthropicErrorResponse"}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        post = spec["paths"][path]["post"]
        for status in ("400", "401", "404", "413", "500", "503"):
            schema = post["responses"][status]["content"]["application/json"]["schema"]
            assert schema == anthropic_envelope, (path, status)
        assert {"bearer": []} in post["security"] and {"apiKey": []} in post["security"]
    assert spec["components"]["securitySchemes"]["apiKey"]["name"] == "x-api-key"
    messages = spec["paths"]["/v1/messages"]["post"]["responses"]["200"]["content"]
    assert set(messages) == {"application/json", "text/event-stream"}
    request = spec["components"]["schemas"]["MessagesRequest"]
    assert {"model", "messages", "max_tokens"} <= set(request["required"])
    max_tokens = request["properties"]["max_tokens"]
    assert max_tokens["maximum"] == server.server.state.ctx.max_model_len - 1
    # The OpenAI routes keep OpenAI's envelope.
    chat = spec["paths"]["/v1/chat/completions"]["post"]["responses"]["400"]
    assert chat["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
