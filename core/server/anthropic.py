"""The Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A Messages request is translated into the chat path's own request (``ChatCompletionRequest``)
and served by it: the same chat template, tool parsers, forced tool use, sampling parameters
and engine request as ``/v1/chat/completions``; only the response is written the Anthropic
way. The translation:

- ``system`` (a string or text blocks) is a first ``system`` message;
- a user message's ``text`` and ``image`` blocks are its content parts (an image becomes an
  ``image_url`` part: a base64 source as a ``data:`` URL, a URL source as the URL), and each
  ``tool_result`` block is a ``tool`` message answering ``tool_use_id``;
- an assistant message's ``text`` blocks are its content and its ``tool_use`` blocks its
  ``tool_calls``; a last assistant message is a prefill that the response continues;
- ``tools`` become function tools (``input_schema`` is the parameters' schema) and
  ``tool_choice`` auto/any/tool/none becomes "auto"/"required"/named/"none"
  (``disable_parallel_tool_use``: ``parallel_tool_calls: false``);
- ``stop_sequences`` are ``stop``; ``temperature``, ``top_p``, ``top_k`` and ``max_tokens``
  pass as they are.

The response's ``stop_reason``: ``tool_use`` when calls were parsed, ``max_tokens`` at the
length limit, ``stop_sequence`` (with ``stop_sequence``) when a stop string ended it, else
``end_turn``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from engine.server.anthropic_protocol import (
    AnthropicMessage,
    AnthropicTool,
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
    MessagesResponse,
)
from engine.server.chat import (
    ChatRun,
    final_outputs,
    reasoning_parser_for,
    render_chat_request,
    start_chat,
)
from engine.server.deltas import stream_deltas
from engine.server.errors import APIError, bad_request, from_engine_error
from engine.server.protocol import ChatCompletionRequest
from engine.server.reasoning import ReasoningParser
from engine.server.serving import ServingContext
from engine.server.streaming import (
    ClientDisconnected,
    EventStreamResponse,
    to_json,
)
from engine.server.tools.output import feed_stream
from engine.server.tools.parser import ToolCall
from engine.server.tools.request import normalize_tool_choice, validate_tools


def chat_request_of(body: CountTokensRequest, *, stream: bool = False) -> ChatCompletionRequest:
    """The chat path's request for a Messages (or count_tokens) request."""
    messages = []
    if body.system:
        system = body.system
        if not isinstance(system, str):
            system = [{"type": "text", "text": b.text} for b in system]
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        messages.extend(_chat_messages(message, i))
    prefill = body.messages[-1].role == "assistant"
    data: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "stream": stream,
        "add_generation_prompt": not prefill,
        "continue_final_message": prefill,
    }
    if body.tools:  # an empty list is no tools, as Anthropic reads it (the chat path's
        data["tools"] = _function_tools(body.tools)  # tools take at least one)
    if body.tool_choice is not None:
        choice = body.tool_choice
        data["tool_choice"] = {
            "auto": "auto",
            "any": "required",
            "none": "none",
            "tool": {"type": "function", "function": {"name": getattr(choice, "name", None)}},
        }[choice.type]
        data["parallel_tool_calls"] = not getattr(choice, "disable_parallel_tool_use", False)
    if isinstance(body, MessagesRequest):
        data["max_tokens"] = body.max_tokens
        if body.stop_sequences:
            data["stop"] = body.stop_sequences
        for name in ("temperature", "top_p", "top_k"):
            if getattr(body, name) is not None:
                data[name] = getattr(body, name)
        if body.metadata is not None and body.metadata.user_id is not None:
            data["user"] = body.metadata.user_id
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as e:  # a translation this module got wrong, said plainly
        raise APIError(500, f"internal error translating the request: {e}") from None


def _chat_messages(message: AnthropicMessage, index: int) -> list[dict[str, Any]]:
    """The chat messages of one Anthropic turn (a user turn with tool results is several)."""
    where = f"messages.{index}.content"
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    if message.role == "assistant":
        texts, calls = [], []
        for j, block in enumerate(message.content):
            if block.type == "text":
                texts.append({"type": "text", "text": block.text})
            elif block.type in ("thinking", "redacted_thinking"):
                continue  # earlier reasoning stays out of the prompt (module docstring)
            elif block.type == "tool_use":
                arguments = json.dumps(block.input, ensure_ascii=False)
                calls.append(
                    {
                        "id": block.id,
                        "type": "function",
                        "function": {"name": block.name, "arguments": arguments},
                    }
                )
            else:
                raise bad_request(
                    f"{where}.{j}: an assistant message takes text, tool_use and thinking "
                    f"blocks, got {block.type!r}",
                    f"{where}.{j}.type",
                )
        out: dict[str, Any] = {"role": "assistant", "content": texts or None}
        if calls:
            out["tool_calls"] = calls
        return [out]
    out_messages: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        if block.type == "text":
            parts.append({"type": "text", "text": block.text})
        elif block.type == "image":
            source = block.source
            url = (
                f"data:{source.media_type};base64,{source.data}"
                if source.type == "base64"
                else source.url
            )
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif block.type == "tool_result":
            if parts:  # keep the order of the blocks: what came before, then the result
                out_messages.append({"role": "user", "content": parts})
                parts = []
            content = block.content
            if isinstance(content, list):
                content = "\n".join(b.text for b in content)
            out_messages.append(
                {"role": "tool", "tool_call_id": block.tool_use_id, "content": content or ""}
            )
        else:
            raise bad_request(
                f"{where}.{j}: a user message takes text, image and tool_result blocks, "
                f"got {block.type!r}",
                f"{where}.{j}.type",
            )
    if parts:
        out_messages.append({"role": "user", "content": parts})
    return out_messages


def _function_tools(tools: list[AnthropicTool]) -> list[dict[str, Any]]:
    """Anthropic tools as the chat path's function tools (duplicate names checked here, so
    that the 400 names the Anthropic field)."""
    out = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise bad_request(f"tools.{i}.name: duplicate tool name {tool.name!r}", "tools")
        seen.add(tool.name)
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        out.append({"type": "function", "function": function})
    return out


# ---------------------------------------------------------------- count_tokens


async def count_message_tokens(
    ctx: ServingContext, body: CountTokensRequest
) -> CountTokensResponse:
    """The prompt tokens a Messages request with this conversation and these tools gives the
    engine (its response's ``usage.input_tokens``)."""
    await ctx.check_model(body.model)
    req = chat_request_of(body)
    tools = validate_tools(req.tools) if req.tools is not None else None
    choice = normalize_tool_choice(req.tool_choice, tools)
    if choice == "none" and ctx.options.exclude_tools_when_tool_choice_none:
        tools = None
    _, ids, _ = await render_chat_request(ctx, req, tools)
    return CountTokensResponse(input_tokens=len(ids))


# ---------------------------------------------------------------- messages


async def create_message(ctx: ServingContext, body: MessagesRequest, raw: Request):
    """Serve one Messages request through the chat path."""
    req = chat_request_of(body, stream=body.stream)
    run = await start_chat(ctx, req, request_id=f"msg_{uuid.uuid4().hex}", route="/v1/messages")
    reasoning = reasoning_parser_for(ctx, req, run.tool_plan)
    if body.stream:
        return EventStreamResponse(_stream(run, reasoning), run.channel)
    try:
        finals = await final_outputs(run.channel, raw)
    except ClientDisconnected:
        return JSONResponse({}, status_code=499)  # nobody reads it
    comp = finals[run.rid].outputs[0]
    content: list[dict[str, Any]] = []
    calls: list[ToolCall] = []
    text = comp.text
    if reasoning is not None:
        thinking, rest = reasoning.split(comp.text)
        if thinking:
            content.append({"type": "thinking", "thinking": thinking, "signature": ""})
        text = rest or ""
    if run.tool_plan.parser is not None:
        parsed = run.tool_plan.parser.parse(text)
        calls = run.tool_plan.limit(parsed.calls)
        text = parsed.content or ""
    if text:
        content.append({"type": "text", "text": text})
    content.extend(_tool_use_block(call) for call in calls)
    stop_reason, stop_sequence = _stop_reason(comp.finish_reason, comp.stop_reason, bool(calls))
    return MessagesResponse(
        id=run.request_id,
        model=run.model,
        content=content,
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage={"input_tokens": len(run.prompt_ids), "output_tokens": len(comp.token_ids)},
    )


def _tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": "toolu_" + call.id.removeprefix("call_"),
        "name": call.name,
        "input": _call_input(call),
    }


def _call_input(call: ToolCall) -> dict[str, Any]:
    """A call's arguments as the ``input`` object (parsers return objects, but a harmony call
    finished by <|call|> carries whatever body the model wrote)."""
    try:
        value = json.loads(call.arguments) if call.arguments.strip() else {}
    except ValueError:
        return {"value": call.arguments}
    return value if isinstance(value, dict) else {"value": value}


def _stop_reason(finish: str | None, stop: Any, called: bool) -> tuple[str, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` for an engine finish."""
    if called:
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if finish == "stop" and isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None  # end of sequence, a stop token id, or an abort


def _event(name: str, data: dict[str, Any]) -> bytes:
    """One server-sent event the way Anthropic writes them: a name and its JSON data."""
    return f"event: {name}\ndata: {to_json(data)}\n\n".encode()


async def _stream(run: ChatRun, reasoning: ReasoningParser | None) -> AsyncIterator[bytes]:
    """Anthropic's event sequence: ``message_start``, per content block
    ``content_block_start``, its deltas and ``content_block_stop`` (a ``ping`` after the first
    block starts), then ``message_delta`` with the stop reason and usage, and
    ``message_stop``. An error after the start is an ``error`` event. With a reasoning parser
    the thinking comes first, as a ``thinking`` block of ``thinking_delta``s."""
    plan = run.tool_plan
    thinking_stream = reasoning.stream() if reasoning is not None else None
    thinking_open = False
    calls_stream = plan.parser.stream() if plan.parser is not None else None
    max_calls = None if plan.parallel_tool_calls else 1
    index = 0  # of the next content block
    text_open = pinged = False
    num_calls = output_tokens = 0
    finish: str | None = None
    stop: Any = None

    def start_block(block: dict[str, Any]) -> list[bytes]:
        nonlocal pinged
        events = [
            _event("content_block_start", {"type": "content_block_start", "index": index,
                                           "content_block": block})
        ]  # fmt: skip
        if not pinged:
            events.append(_event("ping", {"type": "ping"}))
            pinged = True
        return events

    def stop_block() -> bytes:
        nonlocal index
        index += 1
        return _event("content_block_stop", {"type": "content_block_stop", "index": index - 1})

    try:
        yield _event(
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": run.request_id,
                    "type": "message",
                    "role": "assistant",
                    "model": run.model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": len(run.prompt_ids), "output_tokens": 0},
                },
            },
        )
        async for deltas in stream_deltas(run.channel, {run.rid: 0}, 1):
            for d in deltas:
                output_tokens += len(d.token_ids)
                finished = d.finish_reason is not None
                piece = d.text
                if thinking_stream is not None:
                    said, piece = thinking_stream.step(d.text, finished)
                    if said:
                        if not thinking_open:
                            block = {"type": "thinking", "thinking": "", "signature": ""}
                            for e in start_block(block):
                                yield e
                            thinking_open = True
                        delta = {"type": "thinking_delta", "thinking": said}
                        yield _event(
                            "content_block_delta",
                            {"type": "content_block_delta", "index": index, "delta": delta},
                        )
                    if thinking_open and (piece or finished):
                        yield stop_block()
                        thinking_open = False
                update = feed_stream(calls_stream, piece, finished)
                if update.content:
                    if not text_open:
                        for e in start_block({"type": "text", "text": ""}):
                            yield e
                        text_open = True
                    delta = {"type": "text_delta", "text": update.content}
                    yield _event(
                        "content_block_delta",
                        {"type": "content_block_delta", "index": index, "delta": delta},
                    )
                for call in update.calls:
                    if max_calls is not None and num_calls >= max_calls:
                        break
                    if text_open:
                        yield stop_block()
                        text_open = False
                    block = {**_tool_use_block(call), "input": {}}
                    for e in start_block(block):
                        yield e
                    delta = {"type": "input_json_delta", "partial_json": call.arguments}
                    yield _event(
                        "content_block_delta",
                        {"type": "content_block_delta", "index": index, "delta": delta},
                    )
                    yield stop_block()
                    num_calls += 1
                if finished:
                    finish, stop = d.finish_reason, d.stop_reason
        if text_open:
            yield stop_block()
        if not pinged:
            yield _event("ping", {"type": "ping"})
        stop_reason, stop_sequence = _stop_reason(finish, stop, num_calls > 0)
        yield _event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": {"output_tokens": output_tokens},
            },
        )
        yield _event("message_stop", {"type": "message_stop"})
    except Exception as e:  # noqa: BLE001 - the status is sent already: report in-band
        err = e if isinstance(e, APIError) else from_engine_error(e)
        yield _event("error", err.anthropic_body())
    finally:
        run.channel.abort()
