"""GPT-OSS's harmony output through the real HTTP server with ``--reasoning-parser
openai_gptoss --tool-call-parser openai``: the analysis in ``reasoning`` /
``reasoning_content``, the answer in ``content``, calls in ``tool_calls``, streamed and not,
with the official OpenAI client, and no harmony markup anywhere (chat completions, Responses,
Anthropic Messages). A scripted engine writes the outputs through a tokenizer that has the
harmony tokens as special tokens, so they reach the parsers only if the server detokenizes
with them kept."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from fake_engine import ScriptedEngine
from server_harness import RunningServer

from engine.server.app import ServerOptions
from engine.server.harmony import MARKUP
from engine.server.serving import ServingOptions

USER = [{"role": "user", "content": "What is 2+2?"}]
ANSWER = (
    "<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>The answer is 4.<|return|>"
)
CALL = (
    "<|channel|>analysis<|message|>Need weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"location":"Tokyo"}<|call|>'
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from engine.testing.tiny_models import build_tokenizer

    tok = build_tokenizer(tmp_path_factory.mktemp("tok"))
    # GPT-OSS's harmony tokens, special as in its vocabulary (<|end|> is one already).
    tok.add_special_tokens({"additional_special_tokens": [t for t in MARKUP if t != "<|end|>"]})
    return tok


@pytest.fixture(scope="module")
def harmony(tokenizer):
    engine = ScriptedEngine(tokenizer, max_model_len=512, step_delay=0.0)
    options = ServerOptions(
        serving=ServingOptions(
            reasoning_parser="openai_gptoss",
            enable_auto_tool_choice=True,
            tool_call_parser="openai",
            chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}<|start|>assistant",
        )
    )
    with RunningServer(lambda: engine, options) as server:
        yield server, engine


def _stream(client: openai.OpenAI, **kwargs) -> tuple[str, str, list[dict], str | None, str]:
    """(reasoning, content, tool calls, finish reason, every chunk as JSON) of a stream."""
    reasoning = content = ""
    calls: dict[int, dict] = {}
    finish, raw = None, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        raw.append(chunk.model_dump_json())
        choice = chunk.choices[0]
        delta = choice.delta
        extra = delta.model_extra or {}
        if "reasoning" in extra:
            assert extra["reasoning_content"] == extra["reasoning"]
            reasoning += extra["reasoning"]
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = tc.id or call["id"]
            call["name"] += (tc.function.name or "") if tc.function else ""
            call["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = choice.finish_reason or finish
    return reasoning, content, [calls[i] for i in sorted(calls)], finish, "\n".join(raw)


def _no_markup(text: str) -> None:
    for token in MARKUP:
        assert token not in text, (token, text)


def test_answer_streamed_and_not(harmony):
    server, engine = harmony
    engine.script = ANSWER
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    reply = client.chat.completions.create(model="fake-model", messages=USER)
    message = reply.choices[0].message
    assert message.content == "The answer is 4."
    assert message.model_extra["reasoning"] == "User asks 2+2. Easy."
    assert message.model_extra["reasoning_content"] == "User asks 2+2. Easy."
    assert message.tool_calls is None and reply.choices[0].finish_reason == "stop"
    # The markup reached the parsers: the engine detokenized with special tokens.
    assert engine.last_params.skip_special_tokens is False
    reasoning, content, calls, finish, raw = _stream(client, model="fake-model", messages=USER)
    assert (reasoning, content, calls, finish) == (
        "User asks 2+2. Easy.",
        "The answer is 4.",
        [],
        "stop",
    )
    _no_markup(raw)


def test_a_tool_call_after_the_analysis(harmony):
    server, engine = harmony
    engine.script = CALL
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    body = {"model": "fake-model", "messages": USER, "tools": TOOLS}
    reply = client.chat.completions.create(**body)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.model_extra["reasoning"] == "Need weather."
    [call] = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"location":"Tokyo"}')
    assert call.id.startswith("call_")
    reasoning, content, calls, finish, raw = _stream(client, **body)
    assert (reasoning, content, finish) == ("Need weather.", "", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"location":"Tokyo"}')]
    _no_markup(raw)


def test_the_recipient_after_the_role_and_a_preamble(harmony):
    server, engine = harmony
    engine.script = (
        "<|channel|>commentary<|message|>Checking the weather.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
        '<|message|>{"location":"Paris"}<|call|>'
    )
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    body = {"model": "fake-model", "messages": USER, "tools": TOOLS}
    message = client.chat.completions.create(**body).choices[0].message
    assert message.content == "Checking the weather."
    assert (
        "reasoning" not in (message.model_extra or {}) or message.model_extra["reasoning"] is None
    )
    [call] = message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"location":"Paris"}')
    reasoning, content, calls, finish, raw = _stream(client, **body)
    assert (reasoning, content, finish) == ("", "Checking the weather.", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"location":"Paris"}')]
    _no_markup(raw)


def test_responses_and_anthropic_routes_show_no_markup(harmony):
    import anthropic

    server, engine = harmony
    engine.script = ANSWER
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    response = client.responses.create(model="fake-model", input="What is 2+2?")
    assert response.output_text == "The answer is 4."
    [reasoning_item] = [item for item in response.output if item.type == "reasoning"]
    assert reasoning_item.content[0].text == "User asks 2+2. Easy."
    with httpx.stream(
        "POST",
        server.base_url + "/v1/responses",
        json={"model": "fake-model", "input": "What is 2+2?", "stream": True},
        timeout=60,
    ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    _no_markup(json.dumps(events))
    done = events[-1]["response"]
    texts = [c["text"] for item in done["output"] for c in item.get("content") or []]
    assert texts == ["User asks 2+2. Easy.", "The answer is 4."]

    claude = anthropic.Anthropic(base_url=server.base_url, api_key="x")
    reply = claude.messages.create(model="fake-model", max_tokens=400, messages=USER)
    assert [
        (b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in reply.content
    ] == [
        ("thinking", "User asks 2+2. Easy."),
        ("text", "The answer is 4."),
    ]
    engine.script = CALL
    with claude.messages.stream(
        model="fake-model",
        max_tokens=400,
        messages=USER,
        tools=[{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}],
    ) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[1].input == {"location": "Tokyo"} and final.stop_reason == "tool_use"
    _no_markup(final.model_dump_json())


def test_the_flags_are_accepted_and_listed():
    from engine.cli.serve import _reasoning_parser_names, _tool_parser_names

    assert "openai_gptoss" in _reasoning_parser_names()
    assert "openai" in _tool_parser_names()
    options = ServingOptions(
        reasoning_parser="openai_gptoss", enable_auto_tool_choice=True, tool_call_parser="openai"
    )
    assert options.reasoning.needs_special_tokens and options.tool_parser.reads_harmony
