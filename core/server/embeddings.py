"""``POST /v1/embeddings``: OpenAI's embeddings API over a pooling model.

Every input becomes one engine request (``PoolingParams``) on one output channel; the engine
core pools each prompt's hidden states and sends back only the float32 vector. A generative
model answers 400 (the core names what it supports), as a pooling model does to
``/v1/completions`` and ``/v1/chat/completions``.
"""

from __future__ import annotations

import base64
import time
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse

from engine.pooling_params import PoolingParams
from engine.server.errors import bad_request, from_engine_error
from engine.server.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from engine.server.serving import ServingContext, random_id
from engine.server.streaming import ClientDisconnected, unless_disconnected


def embedding_inputs(value: Any) -> list[str | list[int]]:
    """The inputs of an ``input`` field in ``/v1/embeddings``' forms (a text, texts, token
    ids, lists of token ids)."""
    if isinstance(value, str):
        return [value]
    if value and isinstance(value[0], int):
        return [list(value)]  # one input of token ids
    return list(value)


async def create_embedding(ctx: ServingContext, req: EmbeddingRequest, raw: Request):
    """Serve one embeddings request."""
    model = await ctx.check_model(req.model)
    ctx.require_runner("pooling", "/v1/embeddings")
    if ctx.pooling_task == "classify":
        raise bad_request(
            f"The model `{ctx.model_name}` is a sequence classifier: it answers /classify "
            "(and, with one label, scores text pairs on /score and /rerank); it does not "
            "embed (/v1/embeddings).",
            "model",
        )
    inputs = embedding_inputs(req.input)
    try:
        params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
    except ValueError as e:
        raise from_engine_error(e) from None
    request_id = random_id("embd")
    try:
        vectors, num_tokens = await embed_inputs(
            ctx, inputs, params, raw, request_id, req.priority, "input"
        )
    except ClientDisconnected:
        return JSONResponse({}, status_code=499)
    data = []
    for i, vector in enumerate(vectors):
        if req.encoding_format == "base64":
            encoded = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
            data.append(EmbeddingData(index=i, embedding=encoded))
        else:
            data.append(EmbeddingData(index=i, embedding=vector))
    return EmbeddingResponse(
        id=request_id,
        created=int(time.time()),
        model=model,
        data=data,
        usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
    )


async def embed_inputs(
    ctx: ServingContext,
    inputs: list[str | list[int]],
    params: PoolingParams,
    raw: Request,
    request_id: str,
    priority: int = 0,
    param: str = "input",
) -> tuple[list[list[float]], int]:
    """The embedding of each input (a text or token ids), in order, and the prompt tokens
    they took: one engine request each, on one channel. Raises ``ClientDisconnected`` when
    the client goes away (the requests are aborted), 400s naming ``param`` for empty input or
    more inputs than the server's ``limits.max_prompts``."""
    if len(inputs) > ctx.options.limits.max_prompts:
        raise bad_request(
            f"at most {ctx.options.limits.max_prompts} inputs per request, got {len(inputs)}",
            param,
        )
    texts: list[str | None] = []
    token_ids: list[list[int]] = []
    for item in inputs:
        if isinstance(item, str):
            if not item:  # OpenAI refuses it too (a tokenizer may still add special tokens)
                raise bad_request(f"{param} must not contain empty strings", param)
            ids = await ctx.encode(item)
            texts.append(item)
        else:
            ids = list(item)
            ctx.check_token_ids(ids, param)
            texts.append(None)
        if not ids:
            raise bad_request(f"{param} must not be empty", param)
        token_ids.append(ids)

    engine = ctx.async_engine
    channel = engine.open_channel(stream=False)
    rids = []
    try:
        for i, (text, ids) in enumerate(zip(texts, token_ids, strict=True)):
            rid = f"{request_id}-{i}"
            ctx.log_request(rid, text if text is not None else ids, ids, params)
            await engine.add_request(channel, rid, text, params, ids, priority)
            rids.append(rid)
        finals = await unless_disconnected(channel.collect_final(), raw)
    except ClientDisconnected:
        raise
    except Exception as e:
        raise from_engine_error(e) from None
    finally:
        channel.abort()  # a no-op once every request finished; else frees their KV blocks
    vectors = [finals[rid].outputs.embedding for rid in rids]
    return vectors, sum(len(ids) for ids in token_ids)
