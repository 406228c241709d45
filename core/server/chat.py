"""``POST /v1/chat/completions``: chat-templated generation, streamed or not."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from engine.server.async_engine import OutputChannel
from engine.server.deltas import ChoiceDelta, stream_deltas
from engine.server.errors import APIError, bad_request, from_engine_error
from engine.server.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatTokenLogprob,
    TopLogprob,
    UsageInfo,
)
from engine.server.reasoning import ReasoningParser
from engine.server.serving import ServingContext, random_id
from engine.server.streaming import (
    DONE,
    ChunkWriter,
    ClientDisconnected,
    EventStreamResponse,
    sse,
    to_json,
    unless_disconnected,
    usage_dict,
)
from engine.server.structured import rename_param, structured_outputs_field
from engine.server.tools.output import ToolCallDeltas, parse_choice
from engine.server.tools.request import ToolPlan, plan_tool_use


def chat_logprobs(
    ctx: ServingContext,
    token_ids: list[int],
    entries: list[dict[int, Any] | None] | None,
    top_n: int,
    as_ids: bool = False,
) -> list[ChatTokenLogprob]:
    """The chat ``logprobs.content`` list for ``token_ids`` (``top_n`` alternatives each)."""
    content = []
    for i, token in enumerate(token_ids):
        entry = (entries[i] if entries is not None and i < len(entries) else None) or {}
        chosen = entry.get(token)
        text = ctx.logprob_token(token, chosen, as_ids)
        top = []
        if top_n:
            ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:top_n]
            for t, lp in ranked:
                t_text = ctx.logprob_token(t, lp, as_ids)
                top.append(
                    TopLogprob(
                        token=t_text,
                        logprob=_finite(lp.logprob),
                        bytes=list(t_text.encode("utf-8")),
                    )
                )
        content.append(
            ChatTokenLogprob(
                token=text,
                logprob=_finite(chosen.logprob) if chosen is not None else -9999.0,
                bytes=list(text.encode("utf-8")),
                top_logprobs=top,
            )
        )
    return content


def _finite(x: float) -> float:
    return max(float(x), -9999.0)


def _max_tokens(req: ChatCompletionRequest) -> tuple[int | None, str]:
    if req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


@dataclass
class ChatRun:
    """A chat request added to the engine: what its response is built from.

    ``prompt_ids`` are the tokens the engine sees (the usage's prompt tokens); ``channel``
    delivers the outputs of engine request ``rid``.
    """

    request_id: str
    rid: str
    model: str
    prompt_ids: list[int]
    tool_plan: ToolPlan
    channel: OutputChannel


def plan_chat_tools(ctx: ServingContext, req: ChatCompletionRequest) -> ToolPlan:
    """The request's tool plan (``plan_tool_use`` with the server's parser flags)."""
    tool_plan = plan_tool_use(
        req.tools,
        req.tool_choice,
        parser=ctx.options.tool_parser,
        parallel_tool_calls=req.parallel_tool_calls,
        exclude_tools_when_tool_choice_none=ctx.options.exclude_tools_when_tool_choice_none,
    )
    reasoning = reasoning_parser_for(ctx, req, tool_plan)
    if "skip_special_tokens" not in req.model_fields_set and (
        (tool_plan.parser is not None and tool_plan.parser.needs_special_tokens)
        or (reasoning is not None and reasoning.needs_special_tokens)
    ):
        # Keep markers that are special tokens (call tags, harmony's channels) for the parsers,
        # which take them out of the content.
        req.skip_special_tokens = False
    return tool_plan


async def render_chat_request(
    ctx: ServingContext, req: ChatCompletionRequest, template_tools: list[dict] | None
) -> tuple[str | None, list[int], list[Any]]:
    """The prompt text (None once truncated), token ids and images the engine gets."""
    prompt, ids, images = await ctx.render_chat_prompt(
        req.messages,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        tools=template_tools,
        chat_template=req.chat_template,
        chat_template_kwargs=req.chat_template_kwargs,
    )
    if not ids:
        raise bad_request("the rendered chat prompt is empty", "messages")
    truncated = ctx.truncate_prompt(ids, req)
    if truncated is not ids:
        if images:
            raise bad_request(
                "truncate_prompt_tokens cannot be used with image inputs (it would cut images)",
                "truncate_prompt_tokens",
            )
        return None, truncated, images  # the text no longer matches the ids
    return prompt, ids, images


@dataclass
class PreparedChat:
    """A validated chat request, rendered: what the engine is asked to continue."""

    model: str
    lora: Any
    max_tokens: int
    tool_plan: ToolPlan
    prompt: str | None
    prompt_ids: list[int]
    images: list[Any]


async def prepare_chat(
    ctx: ServingContext, req: ChatCompletionRequest, route: str = "/v1/chat/completions"
) -> PreparedChat:
    """Validate a chat request and render its prompt (a 400/404 naming the field when it
    cannot be served; ``route`` names the endpoint in the error for a pooling model)."""
    model = await ctx.check_model(req.model)
    ctx.require_runner("generate", route)
    lora = ctx.lora_request(model)
    max_tokens, max_tokens_param = _max_tokens(req)
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{max_tokens_param} must be >= 1, got {max_tokens}", max_tokens_param)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
    tool_plan = plan_chat_tools(ctx, req)
    if req.stream and req.prompt_logprobs is not None:
        raise bad_request(
            "prompt_logprobs are not available when stream is true", "prompt_logprobs"
        )
    prompt, ids, images = await render_chat_request(ctx, req, tool_plan.template_tools)
    if max_tokens is None:
        max_tokens = max(1, ctx.max_model_len - len(ids))
    ctx.check_prompt_fits(len(ids), max_tokens, param="messages")
    return PreparedChat(model, lora, max_tokens, tool_plan, prompt, ids, images)


async def start_chat(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    request_id: str | None = None,
    prepared: PreparedChat | None = None,
    route: str = "/v1/chat/completions",
) -> ChatRun:
    """Validate a chat request, render its prompt and add it to the engine (a 400/404 naming
    the field when it cannot be served). The OpenAI and Anthropic routes both start here."""
    p = prepared or await prepare_chat(ctx, req, route)
    model, lora, max_tokens, tool_plan = p.model, p.lora, p.max_tokens, p.tool_plan
    prompt, ids, images = p.prompt, p.prompt_ids, p.images
    top_n = req.top_logprobs or 0
    params = ctx.sampling_params(
        req,
        max_tokens=max_tokens,
        logprobs=top_n if req.logprobs else None,
        prompt_logprobs=req.prompt_logprobs,
    )
    if tool_plan.json_schema is not None:
        _force_tool_schema(req, params, tool_plan.json_schema)

    request_id = request_id or random_id("chatcmpl")
    engine = ctx.async_engine
    channel = engine.open_channel(stream=req.stream)
    rid = f"{request_id}-0"
    ctx.log_request(rid, prompt, ids, params)
    try:
        await engine.add_request(
            channel,
            rid,
            prompt,
            params,
            ids,
            req.priority,
            mm_features=images or None,
            lora_request=lora,
        )
    except BaseException as e:
        channel.abort()
        if not isinstance(e, Exception):
            raise
        # A schema/regex/grammar the engine cannot compile: name the field the client used.
        field = structured_outputs_field(req) or ("tool_choice" if tool_plan.json_schema else None)
        raise rename_param(from_engine_error(e), field) from None
    return ChatRun(request_id, rid, model, ids, tool_plan, channel)


async def final_outputs(channel: OutputChannel, raw: Request) -> dict[str, Any]:
    """The finished outputs of the requests on ``channel`` by request id; the channel is
    aborted afterwards (a no-op once they finished; else it frees their KV blocks). Raises
    ``ClientDisconnected`` when the client left first, an ``APIError`` when the engine
    failed."""
    try:
        return await unless_disconnected(channel.collect_final(), raw)
    except ClientDisconnected:
        raise
    except Exception as e:
        raise from_engine_error(e) from e
    finally:
        channel.abort()


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request):
    """Serve one chat completions request."""
    prepared = await prepare_chat(ctx, req)
    if req.use_beam_search:
        return await _beam_search(
            ctx, req, raw, prepared.model, prepared.lora, prepared.prompt_ids,
            prepared.images, prepared.max_tokens,
        )  # fmt: skip
    run = await start_chat(ctx, req, prepared=prepared)
    request_id, rid, model, channel, tool_plan = (
        run.request_id, run.rid, run.model, run.channel, run.tool_plan
    )  # fmt: skip
    ids, top_n = run.prompt_ids, req.top_logprobs or 0

    created = int(time.time())
    role = _response_role(req)
    echo_text = _echo_text(req, role) if req.echo else ""
    if req.stream:
        body = _stream(
            ctx, req, channel, request_id, rid, model, created, len(ids), role, echo_text,
            tool_plan,
        )  # fmt: skip
        return EventStreamResponse(body, channel)

    try:
        finals = await final_outputs(channel, raw)
    except ClientDisconnected:
        return JSONResponse({}, status_code=499)  # nobody reads it

    out = finals[rid]
    thinking = reasoning_parser_for(ctx, req, tool_plan)
    choices = []
    completion_tokens = 0
    for comp in sorted(out.outputs, key=lambda c: c.index):
        completion_tokens += len(comp.token_ids)
        logprobs = None
        if req.logprobs:
            logprobs = ChatChoiceLogprobs(
                content=chat_logprobs(
                    ctx, comp.token_ids, comp.logprobs, top_n, req.return_tokens_as_token_ids
                )
            )
        reasoning, text = None, comp.text
        if thinking is not None:
            reasoning, text = thinking.split(comp.text)
            reasoning = reasoning if req.include_reasoning else None
        content, tool_calls, finish_reason = parse_choice(tool_plan, text or "", comp.finish_reason)
        if text is None and not tool_calls:
            content = None  # all reasoning: no content, as vLLM answers
        if echo_text:
            content = echo_text + (content or "")
        choices.append(
            ChatCompletionChoice(
                index=comp.index,
                message=ChatResponseMessage(
                    role=role,
                    content=content,
                    reasoning=reasoning,
                    reasoning_content=reasoning,
                    tool_calls=tool_calls,
                ),
                logprobs=logprobs,
                finish_reason=finish_reason,
                stop_reason=comp.stop_reason,
            )
        )
    usage = UsageInfo(
        prompt_tokens=len(ids),
        completion_tokens=completion_tokens,
        total_tokens=len(ids) + completion_tokens,
        prompt_tokens_details=(
            {"cached_tokens": out.num_cached_tokens}
            if ctx.options.enable_prompt_tokens_details
            else None
        ),
    )
    prompt_logprobs = None
    if req.prompt_logprobs is not None:
        prompt_logprobs = ctx.prompt_logprobs(out.prompt_logprobs, req.return_tokens_as_token_ids)
    return ChatCompletionResponse(
        id=request_id,
        created=created,
        model=model,
        choices=choices,
        usage=usage,
        prompt_logprobs=prompt_logprobs,
    )


async def _beam_search(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    raw: Request,
    model: str,
    lora: Any,
    ids: list[int],
    images: list[Any],
    max_tokens: int,
):
    """``use_beam_search``: ``n`` replies, best first (``engine.server.beam``); their text is
    plain content (tool calls are not parsed)."""
    from engine.server.beam import beam_search_params, serve_beam_search

    if images:
        raise bad_request("use_beam_search takes no image inputs", "messages")
    params = beam_search_params(ctx, req, max_tokens)
    request_id = random_id("chatcmpl")
    results = await serve_beam_search(ctx, request_id, [ids], params, raw, lora, req.priority)
    if results is None:
        return JSONResponse({}, status_code=499)  # nobody reads it
    [result] = results
    role = _response_role(req)
    echo_text = _echo_text(req, role) if req.echo else ""
    choices = []
    completion_tokens = 0
    for j, seq in enumerate(result.sequences):
        completion_tokens += len(seq.output_tokens)
        choices.append(
            ChatCompletionChoice(
                index=j,
                message=ChatResponseMessage(role=role, content=echo_text + (seq.text or "")),
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
        )
    usage = UsageInfo(
        prompt_tokens=len(ids),
        completion_tokens=completion_tokens,
        total_tokens=len(ids) + completion_tokens,
    )
    return ChatCompletionResponse(
        id=request_id, created=int(time.time()), model=model, choices=choices, usage=usage
    )


def _response_role(req: ChatCompletionRequest) -> str:
    """Who speaks in the response, as in vLLM: the assistant after a generation prompt, else
    the author of the last message, whose turn the model continues."""
    return "assistant" if req.add_generation_prompt else req.messages[-1].role


def _echo_text(req: ChatCompletionRequest, role: str) -> str:
    """vLLM's chat ``echo``: the last message's content, when that message has the
    response's role (the response then reads as that whole message)."""
    last = req.messages[-1]
    if last.role != role or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(p.text if hasattr(p, "text") else str(p.get("text", "")) for p in last.content)


async def _stream(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    channel: OutputChannel,
    request_id: str,
    rid: str,
    model: str,
    created: int,
    prompt_tokens: int,
    role: str,
    echo_text: str,
    tool_plan: ToolPlan,
) -> AsyncIterator[bytes]:
    """The SSE body: a role chunk per choice, content deltas, finish, usage, ``[DONE]``."""
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts and opts.continuous_usage_stats)
    completion_tokens = 0
    top_n = req.top_logprobs or 0
    # Prompt tokens the prefix cache served (with --enable-prompt-tokens-details).
    cached: int | None = 0 if ctx.options.enable_prompt_tokens_details else None

    writer = ChunkWriter(request_id, "chat.completion.chunk", created, model, include_usage)
    # One tool-call parser state per choice when the output is read for tool calls, and one
    # reasoning split per choice with --reasoning-parser (the tool parser reads the content).
    tool_deltas = [ToolCallDeltas(tool_plan) for _ in range(req.n)] if tool_plan.parser else None
    parser = reasoning_parser_for(ctx, req, tool_plan)
    thinking = [parser.stream() for _ in range(req.n)] if parser is not None else None

    def chunk(index: int, delta: str, logprobs: Any, finish: Any, stop: Any) -> bytes:
        choice = (
            f'{{"index":{index},"delta":{delta},'
            f'"logprobs":{"null" if logprobs is None else to_json(logprobs)},'
            f'"finish_reason":{"null" if finish is None else to_json(finish)},'
            f'"stop_reason":{"null" if stop is None else to_json(stop)}}}'
        )
        return writer.chunk(
            choice, usage_dict(prompt_tokens, completion_tokens, cached) if continuous else None
        )

    try:
        # The role chunk goes first, before the engine produced anything (OpenAI does this).
        first = to_json({"role": role, "content": echo_text})
        for i in range(req.n):
            yield chunk(i, first, None, None, None)
        async for deltas in stream_deltas(channel, {rid: 0}, req.n):
            for d in deltas:
                completion_tokens += len(d.token_ids)
                if cached is not None:
                    cached = d.output.num_cached_tokens
                if not d.text and not d.token_ids and d.finish_reason is None:
                    continue
                logprobs = None
                if req.logprobs and d.token_ids:
                    content = chat_logprobs(
                        ctx, d.token_ids, d.logprobs, top_n, req.return_tokens_as_token_ids
                    )
                    logprobs = {"content": [c.model_dump() for c in content]}
                if thinking is not None:
                    said, text = thinking[d.index].step(d.text, d.finish_reason is not None)
                    d = dataclasses.replace(d, text=text)
                    if said and req.include_reasoning:
                        delta = to_json({"reasoning": said, "reasoning_content": said})
                        yield chunk(d.index, delta, logprobs, None, None)
                        logprobs = None
                    if not text and d.finish_reason is None and logprobs is None:
                        continue
                if tool_deltas is not None:
                    for args in _tool_chunks(tool_deltas[d.index], d, logprobs):
                        yield chunk(*args)
                    continue
                delta = (
                    '{"content":' + to_json(d.text) + "}"
                    if d.text or d.finish_reason is None
                    else "{}"
                )
                yield chunk(d.index, delta, logprobs, d.finish_reason, d.stop_reason)
        if include_usage:
            yield writer.usage_chunk(usage_dict(prompt_tokens, completion_tokens, cached))
    except Exception as e:  # noqa: BLE001 - the status is sent already: report in-band
        err = e if isinstance(e, APIError) else from_engine_error(e)
        yield sse(err.body())
    finally:
        channel.abort()
    yield DONE


def reasoning_parser_for(
    ctx: ServingContext, req: ChatCompletionRequest, tool_plan: ToolPlan
) -> ReasoningParser | None:
    """The server's reasoning parser for this request (fitted to the tool parser that reads
    its content), or None: also None when the output is constrained (structured outputs,
    forced tool calls), since the grammar then decides it from the first token and there is no
    think block to take out."""
    parser = ctx.options.reasoning
    if parser is None:
        return None
    if tool_plan.json_schema is not None or structured_outputs_field(req) is not None:
        return None
    return parser.for_tool_parser(tool_plan.parser)


def _force_tool_schema(req: ChatCompletionRequest, params: Any, schema: dict) -> None:
    """Constrain the output to the forced tool calls' schema (structured outputs)."""
    from engine.sampling_params import StructuredOutputsParams

    field = structured_outputs_field(req)
    if field is not None:
        raise bad_request(
            f'tool_choice "required" or a named function already constrains the output to the '
            f"tool calls' JSON; it cannot be combined with {field}",
            field,
        )
    # Compact JSON: the arguments are re-serialized anyway, and a model free to pad with
    # whitespace can spend its whole budget on it.
    params.structured_outputs = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    try:
        params.validate()  # e.g. min_tokens cannot combine with a grammar that decides the end
    except ValueError as e:
        raise from_engine_error(e) from None


def _tool_chunks(stream: ToolCallDeltas, d: ChoiceDelta, logprobs: Any) -> list[tuple]:
    """The ``chunk`` arguments for one delta of a choice read for tool calls: held-back
    content and whole calls; the last one carries the finish (the plan's for calls, if any)."""
    finished = d.finish_reason is not None
    deltas = stream.step(d.text, finished)
    if not deltas and (logprobs is not None or finished):
        deltas = [{}]
    finish = (
        (stream.calls_finish_reason if stream.called else d.finish_reason) if finished else None
    )
    last = len(deltas) - 1
    return [
        (
            d.index,
            to_json(delta),
            logprobs if k == 0 else None,
            finish if k == last else None,
            d.stop_reason if k == last and finished else None,
        )
        for k, delta in enumerate(deltas)
    ]
