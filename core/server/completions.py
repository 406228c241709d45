"""``POST /v1/completions``: legacy text completions, streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from engine.server.async_engine import OutputChannel
from engine.server.deltas import stream_deltas
from engine.server.errors import APIError, bad_request, from_engine_error
from engine.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
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


class LegacyLogprobs:
    """Accumulates OpenAI legacy ``logprobs`` (tokens, token_logprobs, top_logprobs,
    text_offset) for one choice; ``text_offset`` keeps counting across stream chunks."""

    def __init__(self, ctx: ServingContext, as_ids: bool = False, offset: int = 0) -> None:
        self.ctx = ctx
        self.as_ids = as_ids
        self.offset = offset

    def build(
        self, token_ids: list[int], entries: list[dict[int, Any] | None] | None
    ) -> CompletionLogprobs:
        """Logprobs of ``token_ids``; ``entries[i]`` maps token id -> Logprob (None: unknown)."""
        out = CompletionLogprobs()
        show = self.ctx.logprob_token
        as_ids = self.as_ids
        for i, token in enumerate(token_ids):
            entry = entries[i] if entries is not None and i < len(entries) else None
            chosen = entry.get(token) if entry else None
            text = show(token, chosen, as_ids)
            out.tokens.append(text)
            out.token_logprobs.append(_finite(chosen.logprob) if chosen is not None else None)
            out.top_logprobs.append(
                {show(t, lp, as_ids): _finite(lp.logprob) for t, lp in entry.items()}
                if entry
                else None
            )
            out.text_offset.append(self.offset)
            self.offset += len(text)
        return out


def _finite(x: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number.
    return max(float(x), -9999.0)


def _prompts(req: CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(p[0], int):
        return [p]  # one prompt of token ids
    return list(p)


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request):
    """Serve one completions request (all prompts share one output channel)."""
    model = await ctx.check_model(req.model)
    ctx.require_runner("generate", "/v1/completions")
    lora = ctx.lora_request(model)
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of must equal n (best-of sampling is not supported)", "best_of")
    echo_only = False
    if req.max_tokens is not None and req.max_tokens < 1:
        if req.max_tokens == 0 and req.echo:
            echo_only = True  # score the prompt only (lm-eval loglikelihood)
        else:
            raise bad_request(
                f"max_tokens must be >= 1 (0 is allowed only with echo=true), got {req.max_tokens}",
                "max_tokens",
            )
    if req.stream and req.prompt_logprobs is not None:
        raise bad_request(
            "prompt_logprobs are not available when stream is true", "prompt_logprobs"
        )
    prompts = _prompts(req)
    if len(prompts) > ctx.options.limits.max_prompts:
        raise bad_request(
            f"at most {ctx.options.limits.max_prompts} prompts per request, got {len(prompts)}",
            "prompt",
        )
    texts: list[str | None] = []
    token_ids: list[list[int]] = []
    for prompt in prompts:
        if isinstance(prompt, str):
            ids = await ctx.encode(prompt, req.add_special_tokens)
            texts.append(prompt)
        else:
            ids = list(prompt)
            ctx.check_token_ids(ids)
            texts.append(None)
        if not ids:
            raise bad_request("prompt must not be empty", "prompt")
        truncated = ctx.truncate_prompt(ids, req)
        if truncated is not ids:
            ids, texts[-1] = truncated, None  # echo shows the tokens kept
        token_ids.append(ids)

    if req.use_beam_search:
        if echo_only:
            raise bad_request("max_tokens must be >= 1 with use_beam_search", "max_tokens")
        return await _beam_search(ctx, req, raw, model, lora, texts, token_ids)

    # vLLM's rule: prompt_logprobs when asked, else echo's logprobs cover the prompt too.
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo:
        prompt_logprobs = req.logprobs
    request_id = random_id("cmpl")
    params_list = []
    for ids in token_ids:
        if echo_only:
            max_tokens = 1
            ctx.check_prompt_fits(len(ids), 0)
        else:
            max_tokens = req.max_tokens or ctx.max_model_len - len(ids)
            ctx.check_prompt_fits(len(ids), max_tokens)
        params_list.append(
            ctx.sampling_params(
                req, max_tokens=max_tokens, logprobs=req.logprobs, prompt_logprobs=prompt_logprobs
            )
        )

    engine = ctx.async_engine
    channel = engine.open_channel(stream=req.stream)
    prompt_index: dict[str, int] = {}
    try:
        for i, (text, ids, params) in enumerate(zip(texts, token_ids, params_list, strict=True)):
            rid = f"{request_id}-{i}"
            ctx.log_request(rid, text if text is not None else ids, ids, params)
            await engine.add_request(
                channel, rid, text, params, ids, req.priority, lora_request=lora
            )
            prompt_index[rid] = i
    except BaseException as e:
        channel.abort()
        if not isinstance(e, Exception):
            raise
        # A schema/regex/grammar the engine cannot compile: name the field the client used.
        raise rename_param(from_engine_error(e), structured_outputs_field(req)) from None

    prompt_texts = [
        t if t is not None else ctx.decode(ids) for t, ids in zip(texts, token_ids, strict=True)
    ]
    created = int(time.time())
    if req.stream:
        body = _stream(
            ctx, req, channel, request_id, model, created, prompt_index, prompt_texts, token_ids,
            echo_only,
        )  # fmt: skip
        return EventStreamResponse(body, channel)

    try:
        finals = await unless_disconnected(channel.collect_final(), raw)
    except ClientDisconnected:
        return JSONResponse({}, status_code=499)  # nobody reads it
    except Exception as e:
        raise from_engine_error(e) from e
    finally:
        channel.abort()  # a no-op once every request finished; else frees their KV blocks

    choices = []
    completion_tokens = 0
    for rid, p in prompt_index.items():
        out = finals[rid]
        for comp in sorted(out.outputs, key=lambda c: c.index):
            gen_ids = [] if echo_only else comp.token_ids
            gen_text = "" if echo_only else comp.text
            completion_tokens += len(gen_ids)
            logprobs = None
            if req.logprobs is not None:
                builder = LegacyLogprobs(ctx, req.return_tokens_as_token_ids)
                if req.echo:
                    logprobs = builder.build(token_ids[p], out.prompt_logprobs)
                    tail = builder.build(gen_ids, comp.logprobs)
                    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                        getattr(logprobs, name).extend(getattr(tail, name))
                else:
                    logprobs = builder.build(gen_ids, comp.logprobs)
            choices.append(
                CompletionChoice(
                    index=p * req.n + comp.index,
                    text=(prompt_texts[p] if req.echo else "") + gen_text,
                    logprobs=logprobs,
                    finish_reason="length" if echo_only else comp.finish_reason,
                    stop_reason=None if echo_only else comp.stop_reason,
                    prompt_logprobs=ctx.prompt_logprobs(
                        out.prompt_logprobs, req.return_tokens_as_token_ids
                    )
                    if req.prompt_logprobs is not None
                    else None,
                )
            )
    prompt_tokens = sum(len(ids) for ids in token_ids)
    usage = UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=(
            {"cached_tokens": sum(finals[rid].num_cached_tokens for rid in prompt_index)}
            if ctx.options.enable_prompt_tokens_details
            else None
        ),
    )
    return CompletionResponse(
        id=request_id, created=created, model=model, choices=choices, usage=usage
    )


async def _stream(
    ctx: ServingContext,
    req: CompletionRequest,
    channel: OutputChannel,
    request_id: str,
    model: str,
    created: int,
    prompt_index: dict[str, int],
    prompt_texts: list[str],
    token_ids: list[list[int]],
    echo_only: bool,
) -> AsyncIterator[bytes]:
    """The SSE body: one chunk per changed choice per read, then usage and ``[DONE]``."""
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts and opts.continuous_usage_stats)
    prompt_tokens = sum(len(ids) for ids in token_ids)
    completion_tokens = 0
    builders: dict[int, LegacyLogprobs] = {}
    want_logprobs = req.logprobs is not None
    # Per prompt, the tokens the prefix cache served (with --enable-prompt-tokens-details).
    cached: dict[int, int] | None = {} if ctx.options.enable_prompt_tokens_details else None
    writer = ChunkWriter(request_id, "text_completion", created, model, include_usage)
    try:
        async for deltas in stream_deltas(channel, prompt_index, req.n):
            for d in deltas:
                if cached is not None:
                    cached[d.prompt_index] = d.output.num_cached_tokens
                text = d.text
                ids = d.token_ids
                entries = d.logprobs
                if echo_only:
                    if d.finish_reason is None:
                        continue
                    text, ids, entries = "", [], None
                completion_tokens += len(ids)
                logprobs = None
                if want_logprobs:
                    builder = builders.setdefault(
                        d.index, LegacyLogprobs(ctx, req.return_tokens_as_token_ids)
                    )
                    if d.first and req.echo:
                        prompt_lp = builder.build(
                            token_ids[d.prompt_index], d.output.prompt_logprobs
                        )
                        gen_lp = builder.build(ids, entries)
                        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                            getattr(prompt_lp, name).extend(getattr(gen_lp, name))
                        logprobs = _as_dict(prompt_lp)
                    else:
                        logprobs = _as_dict(builder.build(ids, entries))
                if d.first and req.echo:
                    text = prompt_texts[d.prompt_index] + text
                if not text and not ids and d.finish_reason is None and not d.first:
                    continue
                finish = "length" if echo_only else d.finish_reason
                stop = None if echo_only else d.stop_reason
                choice = (
                    f'{{"index":{d.index},"text":{to_json(text)},'
                    f'"logprobs":{"null" if logprobs is None else to_json(logprobs)},'
                    f'"finish_reason":{"null" if finish is None else to_json(finish)},'
                    f'"stop_reason":{"null" if stop is None else to_json(stop)}}}'
                )
                usage = (
                    usage_dict(prompt_tokens, completion_tokens, _total(cached))
                    if continuous
                    else None
                )
                yield writer.chunk(choice, usage)
        if include_usage:
            yield writer.usage_chunk(usage_dict(prompt_tokens, completion_tokens, _total(cached)))
    except Exception as e:  # noqa: BLE001 - the status is sent already: report in-band
        err = e if isinstance(e, APIError) else from_engine_error(e)
        yield sse(err.body())
    finally:
        channel.abort()  # no-op when everything finished; frees KV blocks on disconnect
    yield DONE


async def _beam_search(
    ctx: ServingContext,
    req: CompletionRequest,
    raw: Request,
    model: str,
    lora: Any,
    texts: list[str | None],
    token_ids: list[list[int]],
):
    """``use_beam_search``: ``n`` sequences per prompt, best first (``engine.server.beam``)."""
    from engine.server.beam import beam_search_params, serve_beam_search

    longest = max(len(ids) for ids in token_ids)
    max_tokens = req.max_tokens or ctx.max_model_len - longest
    for ids in token_ids:
        ctx.check_prompt_fits(len(ids), max_tokens)
    params = beam_search_params(ctx, req, max_tokens)
    request_id = random_id("cmpl")
    results = await serve_beam_search(ctx, request_id, token_ids, params, raw, lora, req.priority)
    if results is None:
        return JSONResponse({}, status_code=499)  # nobody reads it
    choices = []
    completion_tokens = 0
    for p, (text, ids, result) in enumerate(zip(texts, token_ids, results, strict=True)):
        prefix = (text if text is not None else ctx.decode(ids)) if req.echo else ""
        for j, seq in enumerate(result.sequences):
            completion_tokens += len(seq.output_tokens)
            choices.append(
                CompletionChoice(
                    index=p * req.n + j,
                    text=prefix + (seq.text or ""),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
    prompt_tokens = sum(len(ids) for ids in token_ids)
    usage = UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
    return CompletionResponse(
        id=request_id, created=int(time.time()), model=model, choices=choices, usage=usage
    )


def _as_dict(lp: CompletionLogprobs) -> dict[str, Any]:
    return {
        "tokens": lp.tokens,
        "token_logprobs": lp.token_logprobs,
        "top_logprobs": lp.top_logprobs,
        "text_offset": lp.text_offset,
    }


def _total(cached: dict[int, int] | None) -> int | None:
    return None if cached is None else sum(cached.values())
