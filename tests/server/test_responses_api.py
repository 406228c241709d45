"""OpenAI's Responses API (``/v1/responses``) through the official ``openai`` client.

On the real engine: the same prompt and greedy tokens as the chat route for the same
conversation (instructions, input items, earlier answers, tool calls and their outputs),
OpenAI's event sequence when streamed, ``incomplete`` at the length limit, kept responses
(``previous_response_id``, retrieve, input items, delete), forced tool use and structured
outputs, and errors in OpenAI's envelope naming the request's field. With a scripted engine
(a random model never thinks nor calls tools): reasoning items and function calls, streamed
and not.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from fake_engine import ScriptedEngine
from server_harness import RunningServer

from engine.server.app import ServerOptions
from engine.server.serving import ServingOptions

SYSTEM = "You are terse."
# One conversation as Responses input items and as chat messages.
ITEMS = [
    {"role": "user", "content": "Hello world"},
    {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "Hi.", "annotations": []}],
    },
    {"role": "user", "content": [{"type": "input_text", "text": "The quick brown fox"}]},
]
CHAT = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Hello world"},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "The quick brown fox"},
]
CITY = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def no_blocks_used(server) -> None:
    assert server.engine.num_used_blocks == 0


def chat_text(client, messages, max_tokens):
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=max_tokens, temperature=0
    )
    return reply.choices[0].message.content, reply.usage, reply.choices[0].finish_reason


def events_of(stream) -> list:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# ------------------------------------------------------------ generation


@pytest.mark.parametrize("max_tokens", [16, 3])
def test_greedy_text_equals_the_chat_route(client, server, max_tokens):
    """The same conversation gives the same prompt tokens and the same greedy text on both
    routes; the length limit makes the response ``incomplete``."""
    want, usage, finish = chat_text(client, CHAT, max_tokens)
    r = client.responses.create(
        model="tiny",
        instructions=SYSTEM,
        input=ITEMS,
        max_output_tokens=max_tokens,
        temperature=0,
    )
    assert r.output_text == want
    [message] = r.output
    assert message.type == "message" and message.role == "assistant"
    assert r.usage.input_tokens == usage.prompt_tokens
    assert r.usage.output_tokens == usage.completion_tokens
    assert r.usage.total_tokens == usage.total_tokens
    if finish == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert message.status == "incomplete"
    else:
        assert r.status == "completed" and r.incomplete_details is None
    assert (r.instructions, r.max_output_tokens, r.temperature) == (SYSTEM, max_tokens, 0)
    no_blocks_used(server)


def test_a_string_input_is_one_user_message(client, server):
    want, usage, _ = chat_text(client, [{"role": "user", "content": "Hello world"}], 8)
    r = client.responses.create(
        model="tiny", input="Hello world", max_output_tokens=8, temperature=0
    )
    assert r.output_text == want and r.usage.input_tokens == usage.prompt_tokens
    # developer messages read as system ones
    dev = [{"role": "developer", "content": SYSTEM}, *ITEMS]
    r = client.responses.create(model="tiny", input=dev, max_output_tokens=8, temperature=0)
    assert r.output_text == chat_text(client, CHAT, 8)[0]


def test_streamed_events_add_up_to_the_response(client, server):
    """OpenAI's event order, deltas that add up to the plain response's text, and a
    ``response.completed`` carrying the same output and usage."""
    plain = client.responses.create(
        model="tiny", input=ITEMS, max_output_tokens=12, temperature=0, store=False
    )
    events = events_of(
        client.responses.create(
            model="tiny", input=ITEMS, max_output_tokens=12, temperature=0, store=False, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete" if plain.status == "incomplete" else "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == plain.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == plain.output_text
    # (cached_tokens differ: the second request finds the first one's prompt cached)
    for name in ("input_tokens", "output_tokens", "total_tokens"):
        assert getattr(final.usage, name) == getattr(plain.usage, name)
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    no_blocks_used(server)


def test_logprobs_are_the_chat_routes(client, server):
    r = client.responses.create(
        model="tiny",
        input=ITEMS,
        max_output_tokens=5,
        temperature=0,
        top_logprobs=2,
        include=["message.output_text.logprobs"],
    )
    reply = client.chat.completions.create(
        model="tiny",
        messages=CHAT[1:],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    got = r.output[0].content[0].logprobs
    want = reply.choices[0].logprobs.content
    assert [(g.token, g.logprob) for g in got] == [(w.token, w.logprob) for w in want]
    assert [len(g.top_logprobs) for g in got] == [2] * len(want)


# ------------------------------------------------------------ kept responses


def test_previous_response_id_continues_the_conversation(client, server):
    """The kept conversation (input and answer, not the instructions) comes before the new
    input; a kept response can be retrieved, its input items listed, and deleted."""
    first = client.responses.create(
        model="tiny", instructions=SYSTEM, input="Hello world", max_output_tokens=6, temperature=0
    )
    assert first.store is True
    second = client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        input="The quick brown fox",
        max_output_tokens=6,
        temperature=0,
    )
    conversation = [
        {"role": "user", "content": "Hello world"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "The quick brown fox"},
    ]
    want, usage, _ = chat_text(client, conversation, 6)
    assert second.output_text == want and second.usage.input_tokens == usage.prompt_tokens
    assert second.previous_response_id == first.id

    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    items = client.responses.input_items.list(first.id).data
    assert [(i.type, i.role, i.content[0].text) for i in items] == [
        ("message", "user", "Hello world")
    ]
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(first.id)
    assert e.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="tiny", previous_response_id=first.id, input="again")
    assert e.value.body["param"] == "previous_response_id"
    no_blocks_used(server)


def test_store_false_keeps_nothing(client, server):
    r = client.responses.create(model="tiny", input="Hello", max_output_tokens=2, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


# ------------------------------------------------------------ tools and structured outputs


def test_tool_calls_and_outputs_in_the_input_equal_the_chat_route(client, server):
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"},
    ]
    chat = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    tool = {
        "type": "function",
        "function": {k: CITY[k] for k in ("name", "description", "parameters")},
    }
    reply = client.chat.completions.create(
        model="tiny", messages=chat, tools=[tool], tool_choice="none", max_tokens=6, temperature=0
    )
    r = client.responses.create(
        model="tiny",
        input=items,
        tools=[CITY],
        tool_choice="none",
        max_output_tokens=6,
        temperature=0,
    )
    assert r.output_text == reply.choices[0].message.content
    assert r.usage.input_tokens == reply.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_use_answers_a_function_call(client, server, stream):
    kw = dict(
        model="tiny",
        input="Weather in Paris?",
        tools=[CITY],
        max_output_tokens=40,
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
    )
    if stream:
        events = events_of(client.responses.create(**kw, stream=True))
        assert "response.function_call_arguments.done" in [e.type for e in events]
        r = events[-1].response
    else:
        r = client.responses.create(**kw)
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Rome")
    assert calls[0].call_id and calls[0].status == "completed"
    no_blocks_used(server)


def test_json_schema_text_format_constrains_the_output(client, server):
    schema = {"type": "string", "enum": ["yes", "no"]}
    r = client.responses.create(
        model="tiny",
        input="Yes or no?",
        max_output_tokens=10,
        temperature=0,
        text={
            "format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}
        },
    )
    assert json.loads(r.output_text) in ("yes", "no")
    assert r.text.format.type == "json_schema"


# ------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {"input": "x", "tools": [{"type": "web_search_preview"}]},
            "tools.0.type",
            "function tools only",
        ),
        ({"input": "x", "background": True}, "background", "background"),
        ({"input": "x", "truncation": "auto"}, "truncation", "truncation 'auto'"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "input.0.content.0.file_id",
            "image_url",
        ),
        (
            {"input": [{"type": "computer_call_output", "id": "c_1"}]},
            "input.0",
            "type 'computer_call_output' are not taken",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
            "input.0.content.0",
            "input_file",
        ),
        (
            {
                "input": [
                    {"role": "user", "content": "hi"},
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"},
                ]
            },
            "input.1",
            "not valid JSON",
        ),
        (
            {"input": "x", "tool_choice": {"type": "allowed_tools"}},
            "tool_choice.type",
            "allowed_tools",
        ),
        ({"input": "x", "top_k": "many"}, "top_k", "top_k"),
        ({"input": "x", "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}},
            "text.format.schema",
            "schema",
        ),
        ({"input": []}, "input", "at least 1 item"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", "no message"),
        ({"input": [{"type": {}}]}, "input.0.type", "'message'"),
    ],
)
def test_bad_requests_name_the_field(http, server, body, param, words):
    err = error_of(http.post("/v1/responses", json={"model": "tiny", **body}), 400)
    assert err["param"].startswith(param), err
    assert words in err["message"], err
    no_blocks_used(server)


def test_unknown_ids_are_404s(http):
    for method, path in [
        ("GET", "/v1/responses/resp_nope"),
        ("DELETE", "/v1/responses/resp_nope"),
        ("GET", "/v1/responses/resp_nope/input_items"),
    ]:
        err = error_of(http.request(method, path), 404)
        assert "resp_nope" in err["message"] and err["param"] == "response_id"


# ------------------------------------------------------------ reasoning and parsed calls


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    from engine.testing.tiny_models import build_tokenizer

    tokenizer = build_tokenizer(tmp_path_factory.mktemp("tok"))
    engine = ScriptedEngine(tokenizer, max_model_len=512, step_delay=0.0)
    options = ServerOptions(
        serving=ServingOptions(
            reasoning_parser="deepseek_r1",
            enable_auto_tool_choice=True,
            tool_call_parser="hermes",
            chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}",
        )
    )
    with RunningServer(lambda: engine, options) as server:
        yield server, engine, openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")


SCRIPT = (
    "<think>I need the weather tool.</think>\nLet me check.<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_text_and_calls_are_output_items(scripted, stream):
    server, engine, client = scripted
    engine.script = SCRIPT
    kw = dict(model="fake-model", input="Weather?", tools=[CITY])
    if stream:
        events = events_of(client.responses.create(**kw, stream=True))
        r = events[-1].response
        said = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert said == "I need the weather tool."
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == "\nLet me check."
        added = [e.item.type for e in events if e.type == "response.output_item.added"]
        assert added == ["reasoning", "message", "function_call"]
    else:
        r = client.responses.create(**kw)
    assert [item.type for item in r.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = r.output
    assert reasoning.content[0].text == "I need the weather tool."
    assert message.content[0].text == "\nLet me check."
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert r.status == "completed"
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    assert "think>" not in json.dumps(r.model_dump())


def test_a_call_only_answer_has_no_message_and_parallel_calls_can_be_cut(scripted):
    server, engine, client = scripted
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'
    # (deepseek_r1 reads text before </think> as reasoning: an empty think block here)
    engine.script = "</think>" + call % "Paris" + call % "Rome"
    r = client.responses.create(model="fake-model", input="Weather?", tools=[CITY])
    assert [item.type for item in r.output] == ["function_call", "function_call"]
    r = client.responses.create(
        model="fake-model", input="Weather?", tools=[CITY], parallel_tool_calls=False
    )
    assert [json.loads(i.arguments)["city"] for i in r.output] == ["Paris"]
    r = client.responses.create(
        model="fake-model", input="Weather?", tools=[CITY], max_tool_calls=1, stream=True
    )
    final = list(r)[-1].response
    assert [json.loads(i.arguments)["city"] for i in final.output] == ["Paris"]
    # The kept answer continues with its calls: the next turn's prompt holds them.
    first = client.responses.create(model="fake-model", input="Weather?", tools=[CITY])
    engine.script = "</think>Done."
    nxt = client.responses.create(
        model="fake-model",
        previous_response_id=first.id,
        tools=[CITY],
        input=[
            {"type": "function_call_output", "call_id": first.output[0].call_id, "output": "Sunny"}
        ],
    )
    assert nxt.output_text == "Done."


def test_a_kept_function_call_is_in_the_next_turns_prompt(client, server):
    """A forced call, then its output sent with ``previous_response_id``: the prompt is the
    chat route's for the conversation with the call and its result (same tokens)."""
    tool_choice = {"type": "function", "name": "get_weather"}
    first = client.responses.create(
        model="tiny",
        input="Weather in Paris?",
        tools=[CITY],
        tool_choice=tool_choice,
        max_output_tokens=40,
        temperature=0,
    )
    [call] = [item for item in first.output if item.type == "function_call"]
    nxt = client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        tools=[CITY],
        tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}],
        max_output_tokens=6,
        temperature=0,
    )
    tool = {
        "type": "function",
        "function": {k: CITY[k] for k in ("name", "description", "parameters")},
    }
    chat = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny"},
    ]
    reply = client.chat.completions.create(
        model="tiny", messages=chat, tools=[tool], tool_choice="none", max_tokens=6, temperature=0
    )
    assert nxt.usage.input_tokens == reply.usage.prompt_tokens
    assert nxt.output_text == reply.choices[0].message.content
    no_blocks_used(server)


def test_the_sdks_stream_helper_and_parse(scripted):
    """The client's own helpers: ``responses.stream`` checks and accumulates the event
    sequence into its final response; ``responses.parse`` sends a strict json_schema from a
    pydantic model and reads the output back into it."""
    from pydantic import BaseModel

    server, engine, client = scripted
    engine.script = SCRIPT
    with client.responses.stream(model="fake-model", input="Weather?", tools=[CITY]) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "".join(deltas) == "\nLet me check."

    class Answer(BaseModel):
        city: str

    engine.script = '{"city": "Rome"}'  # (the scripted engine ignores the grammar)
    parsed = client.responses.parse(model="fake-model", input="City?", text_format=Answer)
    assert parsed.output_parsed == Answer(city="Rome")
    assert engine.last_params.structured_outputs is not None  # the schema reached the engine


def test_item_references_resolve_to_kept_items(client, server, http):
    """``item_reference`` items name an input or output item of a kept response: the same
    prompt as sending those items; an unknown id is a 404 naming the item."""
    first = client.responses.create(
        model="tiny", input="Hello world", max_output_tokens=6, temperature=0
    )
    [user_item] = client.responses.input_items.list(first.id).data
    answer = first.output[0]
    refs = [
        {"type": "item_reference", "id": user_item.id},
        {"type": "item_reference", "id": answer.id},
        {"role": "user", "content": "The quick brown fox"},
    ]
    got = client.responses.create(model="tiny", input=refs, max_output_tokens=6, temperature=0)
    conversation = [
        {"role": "user", "content": "Hello world"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "The quick brown fox"},
    ]
    want, usage, _ = chat_text(client, conversation, 6)
    assert got.output_text == want and got.usage.input_tokens == usage.prompt_tokens
    client.responses.delete(first.id)  # its items go with it
    body = {"model": "tiny", "input": refs}
    err = error_of(http.post("/v1/responses", json=body), 404)
    assert err["param"] == "input.0.id" and user_item.id in err["message"]
    no_blocks_used(server)


def test_a_405_allows_every_method_of_the_path(http):
    """GET and DELETE are two routes on one path: the 405's Allow names both (Starlette's
    names only the first route's), and the OpenAPI document keeps unique operation ids."""
    r = http.request("OPTIONS", "/v1/responses/resp_x")
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET"
    doc = http.get("/openapi.json").json()
    ids = [op["operationId"] for item in doc["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids))
