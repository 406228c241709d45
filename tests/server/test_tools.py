"""Tool calling and several served model names through the real HTTP server.

Two kinds of server: the tiny random model (request validation, the tools reaching the prompt,
conversation history with tool messages, model names), and a ``ScriptedEngine`` that generates
a fixed text token by token (a random model never writes a tool call), so that the real
parser, response and SSE code run on outputs that hold calls.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from fake_engine import ScriptedEngine
from server_harness import RunningServer, engine_config

from engine.server.app import ServerOptions
from engine.server.serving import ServingOptions

# Renders the tools, assistant tool calls (their arguments as a mapping) and tool results.
TOOL_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t['function']['name'] }}="
    "{{ t['function']['description'] }}{% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}[call {{ c['function']['name'] }} "
    "city={{ c['function']['arguments']['city'] }}]{% endfor %}"
    "{% elif m['role'] == 'tool' %}[result {{ m['tool_call_id'] }}: {{ m['content'] }}]"
    "{% else %}{{ m['content'] }}{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Current time"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
TWO_CALLS = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)


def tool_options(parser: str | None = "hermes") -> ServerOptions:
    return ServerOptions(
        serving=ServingOptions(
            chat_template=TOOL_TEMPLATE,
            enable_auto_tool_choice=parser is not None,
            tool_call_parser=parser,
        )
    )


def chat(c: httpx.Client, **body) -> httpx.Response:
    body.setdefault("messages", USER)
    return c.post("/v1/chat/completions", json=body)


def sse_events(response: httpx.Response) -> list[dict]:
    lines = [ln for ln in response.text.split("\n") if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


# ------------------------------------------------------------ the tiny model


@pytest.fixture(scope="module")
def tool_server(tiny_model_dir):
    """The tiny model under two names, the tool template and the hermes parser."""
    from engine.engine_core.core import EngineCore

    def factory():
        config = engine_config(tiny_model_dir, served_model_name=["tiny", "tiny-alias"])
        return EngineCore.from_config(config)

    with RunningServer(factory, tool_options()) as running:
        yield running


@pytest.fixture()
def tc(tool_server):
    with httpx.Client(base_url=tool_server.base_url, timeout=60) as client:
        yield client


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"tools": "get_weather"}, "tools", "expected an array, got a string"),
        ({"tools": []}, "tools", "must have at least 1 item"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools.0.type", "must be 'function'"),
        ({"tools": [{"type": "function", "function": {"description": "x"}}]},
         "tools.0.function.name", "got None"),
        ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name", "duplicate tool name"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "must be one of"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
         "tool_choice.function.name", "not in tools"),
        ({"tool_choice": "auto"}, "tool_choice", "only allowed when tools are given"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "cannot be combined"),
        ({"tools": [WEATHER], "tool_choice": "required", "min_tokens": 2},
         "min_tokens", "cannot be combined with structured_outputs"),
        ({"messages": [*USER, {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{"}}]}]},
         "messages.1.tool_calls.0.function.arguments", "not valid JSON"),
        ({"messages": [*USER, {"role": "tool", "content": "20C"}]},
         "messages.1.tool_call_id", "needs tool_call_id"),
    ],
)  # fmt: skip
def test_invalid_tool_requests_are_400(tc, tool_server, body, param, message):
    r = chat(tc, max_tokens=2, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert message in err["message"]
    assert tool_server.engine.num_used_blocks == 0
    assert chat(tc, max_tokens=1).status_code == 200  # still serving


def test_auto_tool_choice_needs_the_server_flags(http):
    # The shared server runs without --enable-auto-tool-choice.
    r = http.post(
        "/v1/chat/completions", json={"messages": USER, "tools": [WEATHER], "max_tokens": 2}
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in err["message"] and "--tool-call-parser" in err["message"]
    r = http.post(
        "/v1/chat/completions",
        json={"messages": USER, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 2},
    )
    assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"]


def rendered(c: httpx.Client, messages, tools=None) -> tuple[str, int]:
    """The prompt text and token count the server renders for ``messages`` (+ ``tools``)."""
    body = {"messages": messages} | ({"tools": tools} if tools else {})
    tok = c.post("/tokenize", json=body)
    assert tok.status_code == 200, tok.text
    tokens = tok.json()["tokens"]
    return c.post("/detokenize", json={"tokens": tokens}).json()["prompt"], len(tokens)


def test_tools_reach_the_prompt(tc):
    text, count = rendered(tc, USER, [WEATHER, TIME])
    assert text.startswith(
        "<|system|>tools: get_weather=Weather of a city get_time=Current time<|end|>"
    )
    plain_text, plain_count = rendered(tc, USER)
    assert plain_text == "<|user|>Weather in Paris?<|end|><|assistant|>"
    assert count > plain_count
    for tool_choice in ("auto", "none", None):
        r = chat(tc, tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=1)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == count, tool_choice
    assert chat(tc, max_tokens=1).json()["usage"]["prompt_tokens"] == plain_count


def test_history_with_tool_calls_and_results(tc):
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": "18C, clear"},
    ]
    text, count = rendered(tc, messages, [WEATHER])
    assert text.endswith(
        "<|user|>Weather in Paris?<|end|><|assistant|>[call get_weather city=Paris]<|end|>"
        "<|tool|>[result call_abc: 18C, clear]<|end|><|assistant|>"
    )
    r = chat(tc, messages=messages, tools=[WEATHER], max_tokens=3, temperature=0)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == count


def test_plain_answers_pass_through_the_parser_unchanged(tc):
    """The random model writes no call: with parsing on, streamed or not, the content is the
    text generated with parsing off (tool_choice none, the same prompt)."""
    base = {"tools": [WEATHER], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    # hermes detokenizes with special tokens (its markers may be ones): so does "none" here.
    plain = chat(tc, tool_choice="none", skip_special_tokens=False, **base).json()["choices"][0]
    parsed = chat(tc, tool_choice="auto", **base).json()["choices"][0]
    assert parsed["message"] == plain["message"]
    assert parsed["message"]["content"] and "tool_calls" not in parsed["message"]
    assert parsed["finish_reason"] == plain["finish_reason"] == "length"
    r = chat(tc, tool_choice="auto", stream=True, **base)
    events = sse_events(r)
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert content == plain["message"]["content"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert not any("tool_calls" in e["choices"][0]["delta"] for e in events)


def test_several_served_model_names(tc, tool_server):
    models = tc.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny", "tiny-alias"]
    assert all(m["max_model_len"] for m in models)
    for name in ("tiny", "tiny-alias"):
        r = chat(tc, model=name, max_tokens=2)
        assert r.status_code == 200 and r.json()["model"] == name
        r = tc.post("/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == name
        events = sse_events(chat(tc, model=name, max_tokens=2, stream=True))
        assert {e["model"] for e in events} == {name}
    assert chat(tc, max_tokens=1).json()["model"] == "tiny"  # no model: the first name
    r = chat(tc, model="tiny-other", max_tokens=2)
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "tiny, tiny-alias" in err["message"]
    assert tool_server.engine.num_used_blocks == 0


# ------------------------------------------------------------ forced tool use (tiny model)

# Bounded arguments, so that even a random model's constrained output ends within max_tokens.
CITY = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"utc": {"type": "boolean"}},
            "required": ["utc"],
            "additionalProperties": False,
        },
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _streamed_calls(events: list[dict]) -> tuple[list[dict], str | None, str]:
    """The calls a client accumulates from tool-call deltas, the finish reason, the content."""
    calls: dict[int, dict] = {}
    content = ""
    for e in events:
        delta = e["choices"][0]["delta"]
        content += delta.get("content") or ""
        for part in delta.get("tool_calls") or []:
            call = calls.setdefault(part["index"], {"name": "", "arguments": ""})
            call["name"] += part.get("function", {}).get("name") or ""
            call["arguments"] += part.get("function", {}).get("arguments") or ""
    return [calls[i] for i in sorted(calls)], events[-1]["choices"][0]["finish_reason"], content


@pytest.mark.parametrize(
    "which", [("tool_server", "tc"), ("server", "http")], ids=["flags", "no-flags"]
)
@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_tool_choice_is_guided_into_calls(request, which, tool_choice):
    """Forced tool use needs no parser flags: guided decoding writes calls that match the tools'
    schemas; streamed and not, the same calls; a named function finishes with "stop"."""
    running, c = (request.getfixturevalue(name) for name in which)
    body = dict(tools=[CITY, CLOCK], tool_choice=tool_choice, parallel_tool_calls=False,
                temperature=0)  # fmt: skip
    r = chat(c, max_tokens=64, **body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    message = choice["message"]
    assert message["content"] is None and len(message["tool_calls"]) == 1
    call = message["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
    if tool_choice == "required":
        assert choice["finish_reason"] == "tool_calls"
        assert name in ("get_weather", "get_time")
    else:
        assert choice["finish_reason"] == "stop" and name == "get_weather"
    if name == "get_weather":
        assert args.keys() == {"city"} and args["city"] in ("Paris", "Rome")
    else:
        assert args.keys() == {"utc"} and isinstance(args["utc"], bool)

    calls, finish, content = _streamed_calls(sse_events(chat(c, max_tokens=64, stream=True,
                                                             **body)))  # fmt: skip
    assert calls == [{"name": name, "arguments": call["function"]["arguments"]}]
    assert finish == choice["finish_reason"] and content == ""
    assert running.engine.num_used_blocks == 0


def test_forced_call_cut_short_is_content(tc, tool_server):
    """Constrained JSON cut by max_tokens does not parse: it is returned as content."""
    r = chat(tc, max_tokens=3, tools=[CITY], tool_choice=NAMED)
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["finish_reason"] == "length"
    assert "tool_calls" not in choice["message"] and choice["message"]["content"].startswith("{")
    assert tool_server.engine.num_used_blocks == 0


# ------------------------------------------------------------ scripted outputs


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from engine.testing.tiny_models import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def scripted(tokenizer):
    engine = ScriptedEngine(tokenizer, max_model_len=512, step_delay=0.0)
    with RunningServer(lambda: engine, tool_options("hermes")) as running:
        yield running, engine


@pytest.fixture()
def sc(scripted):
    with httpx.Client(base_url=scripted[0].base_url, timeout=30) as client:
        yield client


def test_scripted_tokens_spell_the_script(tokenizer):
    ids = tokenizer(TWO_CALLS, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == TWO_CALLS and len(ids) > 20  # streamed in many pieces


def test_tool_calls_in_the_response(scripted, sc):
    _, engine = scripted
    engine.script = TWO_CALLS
    r = chat(sc, tools=[WEATHER, TIME])
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Let me check.\n"
    calls = message["tool_calls"]
    assert [(c["type"], c["function"]["name"]) for c in calls] == [
        ("function", "get_weather"),
        ("function", "get_time"),
    ]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "Paris"},
        {"tz": "CET"},
    ]
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    # parallel_tool_calls=false keeps the first call only.
    r = chat(sc, tools=[WEATHER, TIME], parallel_tool_calls=False)
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    # tool_choice none: no parsing, the text is the content.
    r = chat(sc, tools=[WEATHER, TIME], tool_choice="none")
    choice = r.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": TWO_CALLS}
    assert choice["finish_reason"] == "stop"


def test_tool_calls_through_the_openai_client(scripted):
    server, engine = scripted
    engine.script = TWO_CALLS
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER, TIME])
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    # Streamed: the client's accumulation gives the same calls.
    stream = client.chat.completions.create(
        model="fake-model", messages=USER, tools=[WEATHER, TIME], stream=True
    )
    content, acc, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            entry = acc.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = entry["id"] or tc.id
            entry["name"] += (tc.function.name or "") if tc.function else ""
            entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me check.\n" and finish == "tool_calls"
    assert [(e["name"], json.loads(e["arguments"])) for _, e in sorted(acc.items())] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"tz": "CET"}),
    ]
    assert all(e["id"].startswith("call_") for e in acc.values())


def test_streamed_tool_calls_never_leak_markers(scripted, sc):
    _, engine = scripted
    engine.script = TWO_CALLS
    r = chat(sc, tools=[WEATHER, TIME], stream=True, n=2, stream_options={"include_usage": True})
    assert r.status_code == 200
    events = sse_events(r)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 40
    for index in (0, 1):
        choices = [c for e in events for c in e["choices"] if c["index"] == index]
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        content = [c["delta"].get("content") or "" for c in choices]
        assert "".join(content) == "Let me check.\n"
        assert not any("<" in piece for piece in content)
        tool_deltas = [tc for c in choices for tc in c["delta"].get("tool_calls", ())]
        # Per call: the head (id, type, name, empty arguments), then the arguments.
        assert [(d["index"], "id" in d) for d in tool_deltas] == [
            (0, True), (0, False), (1, True), (1, False),
        ]  # fmt: skip
        assert tool_deltas[0]["type"] == "function"
        assert tool_deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
        assert json.loads(tool_deltas[3]["function"]["arguments"]) == {"tz": "CET"}
        finishes = [c["finish_reason"] for c in choices if c["finish_reason"]]
        assert finishes == ["tool_calls"]
        assert choices[-1]["finish_reason"] == "tool_calls"


def test_hermes_keeps_special_tokens_unless_told(scripted, sc):
    _, engine = scripted
    engine.script = "ok"
    for body, skip in (
        ({"tools": [WEATHER]}, False),  # auto: markers may be special tokens
        ({"tools": [WEATHER], "skip_special_tokens": True}, True),  # the client decides
        ({"tools": [WEATHER], "tool_choice": "none"}, True),  # no parsing
        ({}, True),
    ):
        assert chat(sc, **body).status_code == 200
        assert engine.last_params.skip_special_tokens is skip, body


@pytest.mark.parametrize("stream", [False, True])
def test_malformed_call_is_content(scripted, sc, stream):
    _, engine = scripted
    engine.script = 'Sure: <tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>'
    r = chat(sc, tools=[WEATHER], stream=stream)
    assert r.status_code == 200
    if stream:
        choices = [e["choices"][0] for e in sse_events(r)]
        content = "".join(c["delta"].get("content") or "" for c in choices)
        assert not any("tool_calls" in c["delta"] for c in choices)
        finish = choices[-1]["finish_reason"]
    else:
        choice = r.json()["choices"][0]
        assert "tool_calls" not in choice["message"]
        content, finish = choice["message"]["content"], choice["finish_reason"]
    assert content == engine.script and finish == "stop"


def test_call_cut_by_max_tokens(scripted, sc):
    _, engine = scripted
    engine.script = TWO_CALLS
    r = chat(sc, tools=[WEATHER, TIME], max_tokens=30)  # inside the first call
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert TWO_CALLS.startswith(choice["message"]["content"])


def test_llama3_json_parser_server(tokenizer):
    engine = ScriptedEngine(tokenizer, max_model_len=512, step_delay=0.0)
    engine.script = (
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "get_time", "parameters": {}}'
    )
    with (
        RunningServer(lambda: engine, tool_options("llama3_json")) as server,
        httpx.Client(base_url=server.base_url, timeout=30) as c,
    ):
        choice = chat(c, tools=[WEATHER, TIME]).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        calls = choice["message"]["tool_calls"]
        assert [(x["function"]["name"], json.loads(x["function"]["arguments"])) for x in calls] == [
            ("get_weather", {"city": "Oslo"}),
            ("get_time", {}),
        ]
        events = sse_events(chat(c, tools=[WEATHER, TIME], stream=True))
        heads = [
            tc["function"]["name"]
            for e in events
            for tc in e["choices"][0]["delta"].get("tool_calls", ())
            if "id" in tc
        ]
        assert heads == ["get_weather", "get_time"]
        assert not any(e["choices"][0]["delta"].get("content") for e in events)


def _streamed(events: list[dict]) -> tuple[str, list[dict], str | None]:
    """Content, tool-call deltas and finish reason of choice 0 of a stream."""
    choices = [e["choices"][0] for e in events if e["choices"]]
    content = "".join(c["delta"].get("content") or "" for c in choices)
    deltas = [tc for c in choices for tc in c["delta"].get("tool_calls", ())]
    return content, deltas, choices[-1]["finish_reason"]


def test_mistral_parser_server(tokenizer):
    engine = ScriptedEngine(tokenizer, max_model_len=512, step_delay=0.0)
    engine.script = (
        'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
        '[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}'
    )
    with (
        RunningServer(lambda: engine, tool_options("mistral")) as server,
        httpx.Client(base_url=server.base_url, timeout=30) as c,
    ):
        choice = chat(c, tools=[WEATHER, TIME]).json()["choices"][0]
        assert engine.last_params.skip_special_tokens is False  # [TOOL_CALLS] is special
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == "Checking."
        calls = choice["message"]["tool_calls"]
        assert [(x["function"]["name"], json.loads(x["function"]["arguments"])) for x in calls] == [
            ("get_weather", {"city": "Oslo"}),
            ("get_time", {"tz": "CET"}),
        ]
        # Mistral's chat templates accept only 9-character alphanumeric ids in the history.
        assert all(len(x["id"]) == 9 and x["id"].isalnum() for x in calls)
        content, deltas, finish = _streamed(sse_events(chat(c, tools=[WEATHER, TIME], stream=True)))
        assert content == "Checking." and finish == "tool_calls"
        heads = [d for d in deltas if "id" in d]
        assert [(d["index"], d["function"]["name"]) for d in heads] == [
            (0, "get_weather"),
            (1, "get_time"),
        ]
        assert all(len(d["id"]) == 9 and d["id"].isalnum() for d in heads)
        # The history with those ids goes back to the model.
        history = USER + [
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": calls[0]["id"], "content": "-3C"},
        ]
        engine.script = "It is -3C in Oslo."
        r = chat(c, tools=[WEATHER, TIME], messages=history)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"] == {
            "role": "assistant",
            "content": "It is -3C in Oslo.",
        }


def test_pythonic_parser_server(tokenizer):
    engine = ScriptedEngine(tokenizer, max_model_len=512, step_delay=0.0)
    engine.script = '[get_weather(city="Oslo"), get_time(tz=None)]'
    with (
        RunningServer(lambda: engine, tool_options("pythonic")) as server,
        httpx.Client(base_url=server.base_url, timeout=30) as c,
    ):
        choice = chat(c, tools=[WEATHER, TIME]).json()["choices"][0]
        assert engine.last_params.skip_special_tokens is True  # no special token needed
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        calls = choice["message"]["tool_calls"]
        assert [(x["function"]["name"], json.loads(x["function"]["arguments"])) for x in calls] == [
            ("get_weather", {"city": "Oslo"}),
            ("get_time", {"tz": None}),
        ]
        content, deltas, finish = _streamed(sse_events(chat(c, tools=[WEATHER, TIME], stream=True)))
        assert content == "" and finish == "tool_calls"
        assert [d["function"]["name"] for d in deltas if "id" in d] == ["get_weather", "get_time"]
        # A malformed call (positional argument) is content, streamed or not.
        engine.script = '[get_weather("Oslo")]'
        choice = chat(c, tools=[WEATHER, TIME]).json()["choices"][0]
        assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
        assert choice["message"]["content"] == engine.script
        content, deltas, finish = _streamed(sse_events(chat(c, tools=[WEATHER], stream=True)))
        assert (content, deltas, finish) == (engine.script, [], "stop")
