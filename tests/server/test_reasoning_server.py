"""``--reasoning-parser`` through the real HTTP server: the reasoning in ``reasoning`` and
``reasoning_content``, the rest in ``content`` (or in tool calls), streamed and not, with the
official OpenAI client. A scripted engine writes the outputs (a random model never thinks)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from fake_engine import ScriptedEngine
from server_harness import RunningServer

from engine.config import ConfigError
from engine.server.app import ServerOptions
from engine.server.serving import ServingOptions

USER = [{"role": "user", "content": "Say hello."}]
THINKING = "<think>\nThe user wants a greeting.\n</think>\n\nHello there!"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from engine.testing.tiny_models import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def _server(tokenizer, parser: str, tool_parser: str | None = None):
    engine = ScriptedEngine(tokenizer, max_model_len=512, step_delay=0.0)
    options = ServerOptions(
        serving=ServingOptions(
            reasoning_parser=parser,
            enable_auto_tool_choice=tool_parser is not None,
            tool_call_parser=tool_parser,
            chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}",
        )
    )
    return RunningServer(lambda: engine, options), engine


@pytest.fixture(scope="module")
def r1(tokenizer):
    server, engine = _server(tokenizer, "deepseek_r1", tool_parser="hermes")
    with server:
        yield server, engine


def _stream(base: str, body: dict) -> tuple[str, str, str | None, list[dict]]:
    """(reasoning, content, finish reason, raw chunks) of a streamed chat completion."""
    reasoning = content = ""
    finish, chunks = None, []
    with httpx.stream(
        "POST", base + "/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            chunks.append(chunk)
            delta = chunk["choices"][0]["delta"]
            if "reasoning" in delta:
                assert delta["reasoning_content"] == delta["reasoning"]
                reasoning += delta["reasoning"]
            content += delta.get("content") or ""
            finish = chunk["choices"][0]["finish_reason"] or finish
    return reasoning, content, finish, chunks


def test_reasoning_and_content_with_the_openai_client(r1):
    server, engine = r1
    engine.script = THINKING
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    reply = client.chat.completions.create(model="fake-model", messages=USER)
    message = reply.choices[0].message
    assert message.content == "\n\nHello there!"
    assert message.model_extra["reasoning"] == "\nThe user wants a greeting.\n"
    assert message.model_extra["reasoning_content"] == "\nThe user wants a greeting.\n"
    # Streamed: the same split, the tags never sent, every chunk a valid delta.
    reasoning, content, finish, chunks = _stream(
        server.base_url, {"model": "fake-model", "messages": USER}
    )
    assert (reasoning, content, finish) == (
        "\nThe user wants a greeting.\n",
        "\n\nHello there!",
        "stop",
    )
    assert not any("think>" in json.dumps(c) for c in chunks)


def test_include_reasoning_false_and_an_output_cut_while_thinking(r1):
    server, engine = r1
    engine.script = THINKING
    body = {"model": "fake-model", "messages": USER, "include_reasoning": False}
    message = httpx.post(server.base_url + "/v1/chat/completions", json=body).json()
    message = message["choices"][0]["message"]
    assert message["content"] == "\n\nHello there!" and "reasoning" not in message
    assert _stream(server.base_url, body)[:2] == ("", "\n\nHello there!")
    # max_tokens ends it inside the think block: all reasoning, no content.
    body = {"model": "fake-model", "messages": USER, "max_tokens": 4}
    reply = httpx.post(server.base_url + "/v1/chat/completions", json=body).json()["choices"][0]
    assert reply["finish_reason"] == "length"
    assert reply["message"]["content"] is None and reply["message"]["reasoning"]


def test_tool_calls_after_the_reasoning(r1):
    server, engine = r1
    engine.script = (
        "<think>I need the weather tool.</think>\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    body = {"model": "fake-model", "messages": USER, "tools": tools}
    reply = httpx.post(server.base_url + "/v1/chat/completions", json=body).json()["choices"][0]
    assert reply["finish_reason"] == "tool_calls"
    assert reply["message"]["reasoning"] == "I need the weather tool."
    [call] = reply["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    reasoning, _, finish, chunks = _stream(server.base_url, body)
    assert (reasoning, finish) == ("I need the weather tool.", "tool_calls")
    calls = [c for ch in chunks for c in ch["choices"][0]["delta"].get("tool_calls") or []]
    assert calls and calls[0]["function"]["name"] == "get_weather"


def test_qwen3_reasons_only_when_the_output_opens_a_think_block(tokenizer):
    server, engine = _server(tokenizer, "qwen3")
    with server:
        engine.script = "Hello there!"  # thinking off: no think block at all
        body = {"model": "fake-model", "messages": USER}
        message = httpx.post(server.base_url + "/v1/chat/completions", json=body).json()
        message = message["choices"][0]["message"]
        assert message["content"] == "Hello there!" and "reasoning" not in message
        engine.script = THINKING
        assert _stream(server.base_url, body)[:2] == (
            "\nThe user wants a greeting.\n",
            "\n\nHello there!",
        )


def test_an_unknown_parser_fails_at_start():
    with pytest.raises(ConfigError, match="--reasoning-parser: unknown reasoning parser 'o1'"):
        ServingOptions(reasoning_parser="o1")


def test_a_constrained_output_is_all_content(r1):
    """Structured outputs decide the output from its first token: no think block to take out,
    so deepseek_r1 does not file the JSON as reasoning."""
    server, engine = r1
    engine.script = '{"greeting": "hello"}'
    body = {"model": "fake-model", "messages": USER, "response_format": {"type": "json_object"}}
    message = httpx.post(server.base_url + "/v1/chat/completions", json=body).json()
    message = message["choices"][0]["message"]
    assert message["content"] == '{"greeting": "hello"}' and "reasoning" not in message
    assert _stream(server.base_url, body)[:2] == ("", '{"greeting": "hello"}')


def test_anthropic_messages_return_a_thinking_block(r1):
    """The Messages route: the reasoning as a ``thinking`` block before the text (streamed as
    ``thinking_delta``s), and a client's next turn, which sends the block back, is taken."""
    import anthropic

    server, engine = r1
    engine.script = THINKING
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x")
    reply = client.messages.create(model="fake-model", max_tokens=64, messages=USER)
    assert [b.type for b in reply.content] == ["thinking", "text"]
    assert reply.content[0].thinking == "\nThe user wants a greeting.\n"
    assert reply.content[1].text == "\n\nHello there!"
    with client.messages.stream(model="fake-model", max_tokens=64, messages=USER) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == reply.content[0].thinking
    assert final.content[1].text == reply.content[1].text
    assert "thinking_delta" in kinds and "text_delta" in kinds
    history = [*USER, {"role": "assistant", "content": [b.model_dump() for b in reply.content]},
               {"role": "user", "content": "Again."}]  # fmt: skip
    again = client.messages.create(model="fake-model", max_tokens=64, messages=history)
    assert again.content[-1].text == "\n\nHello there!"
