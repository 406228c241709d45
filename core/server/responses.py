"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``
and ``GET /v1/responses/{id}/input_items``.

A Responses request is translated into the chat path's own request (``ChatCompletionRequest``;
the translation is ``engine.server.responses_input``) and served by it, as the Anthropic Messages API is: the same chat template, tool parsers,
forced tool use, reasoning parser, structured outputs and sampling. The translation:

- ``instructions`` is a first ``system`` message; ``input`` as a string is one user message;
- a ``message`` item is a chat message (``developer`` reads as ``system``; ``input_text`` /
  ``output_text`` / ``refusal`` parts are text parts, ``input_image`` an ``image_url`` part);
- ``function_call`` items are the ``tool_calls`` of an assistant message (joined to the
  assistant message just before them), ``function_call_output`` a ``tool`` message answering
  ``call_id``; ``reasoning`` items are taken and left out of the prompt;
- ``previous_response_id`` puts the kept conversation of that response (its input and its
  answer, not its instructions) before ``input``; an ``item_reference`` stands for an input
  or output item of a kept response;
- ``tools`` (``{"type": "function", "name", "parameters"}``) become the chat path's function
  tools, ``tool_choice`` likewise; ``text.format`` is ``response_format``;
  ``max_output_tokens`` is ``max_completion_tokens``; ``reasoning.effort`` reaches the chat
  template as ``reasoning_effort``.

The answer's ``output``: a ``reasoning`` item when the server's ``--reasoning-parser`` found
reasoning, a ``message`` with one ``output_text`` part (left out when the answer is only tool
calls), and a ``function_call`` item per parsed call. ``status`` is ``incomplete`` (with
``incomplete_details.reason`` ``max_output_tokens``) when the length limit ended it.
``usage.output_tokens_details.reasoning_tokens`` is the reasoning text re-tokenized (the
engine does not mark where the reasoning's tokens end). Streaming answers OpenAI's semantic
events (``response.created`` ... ``response.completed``), each with its ``sequence_number``.
Errors use OpenAI's envelope; one after the stream started is an ``error`` event followed by
``response.failed``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from engine.server.chat import (
    ChatRun,
    chat_logprobs,
    final_outputs,
    reasoning_parser_for,
    start_chat,
)
from engine.server.deltas import stream_deltas
from engine.server.errors import APIError, bad_request, from_engine_error
from engine.server.protocol import ChatCompletionRequest
from engine.server.reasoning import ReasoningParser
from engine.server.response_store import StoredResponse
from engine.server.responses_input import (
    Conversation,
    add_input,
    chat_request_of,
    input_items,
    new_id,
)
from engine.server.responses_protocol import (
    ResponsesRequest,
)
from engine.server.serving import ServingContext
from engine.server.streaming import (
    ClientDisconnected,
    EventStreamResponse,
    to_json,
)
from engine.server.tools.output import feed_stream
from engine.server.tools.parser import ToolCall

ROUTE = "/v1/responses"


# ---------------------------------------------------------------- the answer


def _message_item(text: str, status: str, logprobs: list[Any] | None) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {"id": new_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [part]}  # fmt: skip


def _call_item(call: ToolCall) -> dict[str, Any]:
    return {"id": new_id("fc"), "type": "function_call", "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": "completed"}  # fmt: skip


def _reasoning_item(text: str) -> dict[str, Any]:
    return {"id": new_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}  # fmt: skip


def _status(finish: str | None) -> tuple[str, dict[str, Any] | None]:
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def _usage(ctx: ServingContext, prompt: int, cached: int, output: int, reasoning: str) -> dict:
    reasoning_tokens = 0
    if reasoning and ctx.tokenizer is not None:
        ids = ctx.tokenizer.encode(reasoning, add_special_tokens=False)
        reasoning_tokens = min(len(ids), output)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt + output,
    }


def _response(
    body: ResponsesRequest,
    response_id: str,
    model: str,
    created: int,
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    incomplete: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    stored: bool = False,
) -> dict[str, Any]:
    """The response object (what OpenAI's ``Response`` holds), echoing the request."""
    text = body.text.model_dump(mode="json", by_alias=True, exclude_none=True) if body.text else {}
    text.setdefault("format", {"type": "text"})
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "completed_at": int(time.time()) if status == "completed" else None,
        "status": status,
        "error": error,
        "incomplete_details": incomplete,
        "model": model,
        "output": output,
        "usage": usage,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": body.max_tool_calls,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": body.reasoning,
        "store": stored,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_logprobs": body.top_logprobs,
        "text": text,
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": body.tools or [],
        "truncation": body.truncation or "disabled",
        "user": body.user,
        "background": False,
    }


def _answer_message(text: str, calls: list[ToolCall]) -> dict[str, Any]:
    """The answer as a chat message, for the kept conversation."""
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    return message


def _keep(
    ctx: ServingContext,
    body: ResponsesRequest,
    response: dict[str, Any],
    conv: Conversation,
    answer: dict[str, Any],
) -> None:
    """Keep the response, with its conversation less the instructions (the earlier responses'
    part included) and the answer."""
    own = [m for m, o in zip(conv.messages, conv.origins, strict=True) if o != "instructions"]
    stored = StoredResponse(response, input_items(body), [*own, answer])
    ctx.response_store.put(response["id"], stored)


def _will_store(ctx: ServingContext, body: ResponsesRequest) -> bool:
    return body.store and ctx.response_store.capacity > 0


# ---------------------------------------------------------------- the routes


async def create_response(ctx: ServingContext, body: ResponsesRequest, raw: Request):
    """Serve one Responses request through the chat path."""
    if body.top_logprobs is not None and body.top_logprobs > ctx.max_logprobs:
        raise bad_request(
            f"top_logprobs must be in [0, {ctx.max_logprobs}], got {body.top_logprobs}",
            "top_logprobs",
        )
    conv = Conversation()
    if body.instructions:
        conv.add({"role": "system", "content": body.instructions}, "instructions")
    if body.previous_response_id is not None:
        previous = ctx.response_store.get(body.previous_response_id)
        if previous is None:
            raise APIError(
                404,
                f"Previous response with id {body.previous_response_id!r} not found (this "
                "server keeps responses in memory, per front-end process, up to "
                f"{ctx.response_store.capacity})",
                param="previous_response_id",
            )
        for m in json.loads(json.dumps(previous.messages)):  # a copy: merging edits it
            conv.add(m, "previous_response_id")
    add_input(conv, body, ctx.response_store.item)
    req = chat_request_of(body, conv)
    response_id = new_id("resp")
    try:
        run = await start_chat(ctx, req, request_id=response_id, route=ROUTE)
    except APIError as e:
        raise conv.rename(e) from None
    reasoning = reasoning_parser_for(ctx, req, run.tool_plan)
    created = int(time.time())
    if body.stream:
        events = _stream(ctx, body, req, run, reasoning, created, conv)
        return EventStreamResponse(events, run.channel)
    try:
        finals = await final_outputs(run.channel, raw)
    except ClientDisconnected:
        return JSONResponse({}, status_code=499)  # nobody reads it
    final = finals[run.rid]
    comp = final.outputs[0]
    thinking, text = "", comp.text
    if reasoning is not None:
        said, rest = reasoning.split(comp.text)
        thinking, text = said or "", rest or ""
    calls: list[ToolCall] = []
    if run.tool_plan.parser is not None:
        parsed = run.tool_plan.parser.parse(text)
        calls = _limit(run, body, parsed.calls)
        text = parsed.content or ""
    status, incomplete = _status(comp.finish_reason)
    logprobs = None
    if req.logprobs:
        logprobs = [
            lp.model_dump()
            for lp in chat_logprobs(ctx, comp.token_ids, comp.logprobs, req.top_logprobs or 0)
        ]
    output: list[dict[str, Any]] = []
    if thinking:
        output.append(_reasoning_item(thinking))
    if text or not calls:
        output.append(_message_item(text, status, logprobs))
    output.extend(_call_item(c) for c in calls)
    usage = _usage(ctx, len(run.prompt_ids), final.num_cached_tokens or 0, len(comp.token_ids),
                   thinking)  # fmt: skip
    stored = _will_store(ctx, body)
    response = _response(body, response_id, run.model, created, status=status, output=output,
                         usage=usage, incomplete=incomplete, stored=stored)  # fmt: skip
    if stored:
        _keep(ctx, body, response, conv, _answer_message(text, calls))
    return JSONResponse(response)


def _limit(run: ChatRun, body: ResponsesRequest, calls: list[ToolCall]) -> list[ToolCall]:
    calls = run.tool_plan.limit(calls)
    return calls[: body.max_tool_calls] if body.max_tool_calls is not None else calls


def get_response(ctx: ServingContext, response_id: str) -> dict[str, Any]:
    return _stored(ctx, response_id).response


def delete_response(ctx: ServingContext, response_id: str) -> dict[str, Any]:
    if not ctx.response_store.delete(response_id):
        raise _not_found(ctx, response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def list_input_items(ctx: ServingContext, response_id: str) -> dict[str, Any]:
    items = _stored(ctx, response_id).input_items
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": False,
    }


def _stored(ctx: ServingContext, response_id: str) -> StoredResponse:
    stored = ctx.response_store.get(response_id)
    if stored is None:
        raise _not_found(ctx, response_id)
    return stored


def _not_found(ctx: ServingContext, response_id: str) -> APIError:
    return APIError(
        404,
        f"Response with id {response_id!r} not found (this server keeps responses in memory, "
        f"per front-end process, up to {ctx.response_store.capacity}; store=false keeps none)",
        param="response_id",
    )


# ---------------------------------------------------------------- streaming


class _Events:
    """Numbers and writes the stream's events (``event: <type>`` plus its JSON data)."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **data: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {to_json(payload)}\n\n".encode()


async def _stream(
    ctx: ServingContext,
    body: ResponsesRequest,
    req: ChatCompletionRequest,
    run: ChatRun,
    reasoning: ReasoningParser | None,
    created: int,
    conv: Conversation,
) -> AsyncIterator[bytes]:
    """OpenAI's event sequence: ``response.created``, ``response.in_progress``; per output
    item ``response.output_item.added``, its parts and deltas, ``response.output_item.done``;
    then ``response.completed`` (or ``response.incomplete``) with the whole response."""
    event = _Events()
    plan = run.tool_plan
    thinking_stream = reasoning.stream() if reasoning is not None else None
    calls_stream = plan.parser.stream() if plan.parser is not None else None
    max_calls = None if plan.parallel_tool_calls else 1
    if body.max_tool_calls is not None:
        max_calls = min(max_calls or body.max_tool_calls, body.max_tool_calls)
    top_n = req.top_logprobs or 0
    per_delta_logprobs = req.logprobs and thinking_stream is None and calls_stream is None
    output: list[dict[str, Any]] = []
    thinking_item: dict[str, Any] | None = None
    message_item: dict[str, Any] | None = None
    thinking = text = ""
    calls: list[ToolCall] = []
    token_ids: list[int] = []
    entries: list[Any] = []
    finish: str | None = None
    cached = 0

    def in_progress() -> dict[str, Any]:
        return _response(body, run.request_id, run.model, created, status="in_progress",
                         output=[])  # fmt: skip

    def close_thinking() -> list[bytes]:
        nonlocal thinking_item
        item, thinking_item = thinking_item, None
        index = output.index(item)
        part = {"type": "reasoning_text", "text": thinking}
        item.update(content=[part], status="completed")
        return [
            event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                  content_index=0, text=thinking),
            event("response.content_part.done", item_id=item["id"], output_index=index,
                  content_index=0, part=part),
            event("response.output_item.done", output_index=index, item=item),
        ]  # fmt: skip

    def open_message() -> list[bytes]:
        nonlocal message_item
        message_item = {"id": new_id("msg"), "type": "message", "role": "assistant",
                        "status": "in_progress", "content": []}  # fmt: skip
        output.append(message_item)
        index = len(output) - 1
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            event("response.output_item.added", output_index=index, item=message_item),
            event("response.content_part.added", item_id=message_item["id"], output_index=index,
                  content_index=0, part=part),
        ]  # fmt: skip

    def close_message(status: str) -> list[bytes]:
        nonlocal message_item
        item, message_item = message_item, None
        index = output.index(item)
        logprobs = []
        if req.logprobs:
            logprobs = [lp.model_dump() for lp in chat_logprobs(ctx, token_ids, entries, top_n)]
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
        item.update(content=[part], status=status)
        return [
            event("response.output_text.done", item_id=item["id"], output_index=index,
                  content_index=0, text=text, logprobs=logprobs),
            event("response.content_part.done", item_id=item["id"], output_index=index,
                  content_index=0, part=part),
            event("response.output_item.done", output_index=index, item=item),
        ]  # fmt: skip

    try:
        yield event("response.created", response=in_progress())
        yield event("response.in_progress", response=in_progress())
        async for deltas in stream_deltas(run.channel, {run.rid: 0}, 1):
            for d in deltas:
                token_ids.extend(d.token_ids)
                if d.logprobs is not None:
                    entries.extend(d.logprobs)
                finished = d.finish_reason is not None
                piece = d.text
                if thinking_stream is not None:
                    said, piece = thinking_stream.step(d.text, finished)
                    if said:
                        if thinking_item is None and not thinking:
                            thinking_item = {"id": new_id("rs"), "type": "reasoning", "summary": [],
                                             "content": [], "status": "in_progress"}  # fmt: skip
                            output.append(thinking_item)
                            index = len(output) - 1
                            yield event("response.output_item.added", output_index=index,
                                        item=thinking_item)  # fmt: skip
                            yield event("response.content_part.added",
                                        item_id=thinking_item["id"], output_index=index,
                                        content_index=0,
                                        part={"type": "reasoning_text", "text": ""})  # fmt: skip
                        if thinking_item is not None:
                            thinking += said
                            yield event("response.reasoning_text.delta",
                                        item_id=thinking_item["id"],
                                        output_index=output.index(thinking_item),
                                        content_index=0, delta=said)  # fmt: skip
                    if thinking_item is not None and (piece or finished):
                        for e in close_thinking():
                            yield e
                update = feed_stream(calls_stream, piece, finished)
                if update.content:
                    if message_item is None:
                        for e in open_message():
                            yield e
                    text += update.content
                    logprobs = []
                    if per_delta_logprobs:
                        logprobs = [lp.model_dump() for lp in
                                    chat_logprobs(ctx, d.token_ids, d.logprobs, top_n)]  # fmt: skip
                    yield event("response.output_text.delta", item_id=message_item["id"],
                                output_index=output.index(message_item), content_index=0,
                                delta=update.content, logprobs=logprobs)  # fmt: skip
                for call in update.calls:
                    if max_calls is not None and len(calls) >= max_calls:
                        break
                    if message_item is not None:
                        for e in close_message("completed"):
                            yield e
                    item = {**_call_item(call), "arguments": "", "status": "in_progress"}
                    output.append(item)
                    index = len(output) - 1
                    yield event("response.output_item.added", output_index=index, item=item)
                    yield event("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=index, delta=call.arguments)  # fmt: skip
                    yield event("response.function_call_arguments.done", item_id=item["id"],
                                output_index=index, name=call.name,
                                arguments=call.arguments)  # fmt: skip
                    item.update(arguments=call.arguments, status="completed")
                    yield event("response.output_item.done", output_index=index, item=item)
                    calls.append(call)
                if finished:
                    finish = d.finish_reason
                    cached = getattr(d.output, "num_cached_tokens", 0) or 0
        status, incomplete = _status(finish)
        if thinking_item is not None:
            for e in close_thinking():
                yield e
        if message_item is None and not calls:
            for e in open_message():
                yield e
        if message_item is not None:
            for e in close_message(status):
                yield e
        usage = _usage(ctx, len(run.prompt_ids), cached, len(token_ids), thinking)
        stored = _will_store(ctx, body)
        response = _response(body, run.request_id, run.model, created, status=status,
                             output=output, usage=usage, incomplete=incomplete,
                             stored=stored)  # fmt: skip
        if stored:
            _keep(ctx, body, response, conv, _answer_message(text, calls))
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        yield event(kind, response=response)
    except Exception as e:  # noqa: BLE001 - the status is sent already: report in-band
        err = e if isinstance(e, APIError) else from_engine_error(e)
        yield event("error", code=err.code or err.type, message=err.message, param=err.param)
        failed = _response(body, run.request_id, run.model, created, status="failed",
                           output=output,
                           error={"code": "server_error", "message": err.message})  # fmt: skip
        yield event("response.failed", response=failed)
    finally:
        run.channel.abort()
