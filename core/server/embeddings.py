"""``POST /v1/embeddings``: OpenAI's embeddings API over a pooling model.

Every input becomes one engine request (``PoolingParams``) on one output channel; the engine
core pools each prompt's hidden states and sends back only the float32 vector. A generative
model answers 400 (the core names what it supports), as a pooling model does to
``/v1/completions`` and ``/v1/chat/completions``.
"""

from __future__ import annotations

import base64
import time

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


def _inputs(req: EmbeddingRequest) -> list[str | list[int]]:
    value = req.input
    if isinstance(value, str):
        return [value]
    if value and isinstance(value[0], int):
        return [list(value)]  # one input of token ids
    return list(value)


async def create_embedding(ctx: ServingContext, req: EmbeddingRequest, raw: Request):
    """Serve one embeddings request."""
    model = await ctx.check_model(req.model)
    ctx.require_runner("pooling", "/v1/embeddings")
    inputs = _inputs(req)
    if len(inputs) > ctx.options.limits.max_prompts:
        raise bad_request(
            f"at most {ctx.options.limits.max_prompts} inputs per request, got {len(inputs)}",
            "input",
        )
    try:
        params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
    except ValueError as e:
        raise from_engine_error(e) from None
    texts: list[str | None] = []
    token_ids: list[list[int]] = []
    for item in inputs:
        if isinstance(item, str):
            if not item:  # OpenAI refuses it too (a tokenizer may still add special tokens)
                raise bad_request("input must not contain empty strings", "input")
            ids = await ctx.encode(item)
            texts.append(item)
        else:
            ids = list(item)
            ctx.check_token_ids(ids, "input")
            texts.append(None)
        if not ids:
            raise bad_request("input must not be empty", "input")
        token_ids.append(ids)

    engine = ctx.async_engine
    channel = engine.open_channel(stream=False)
    request_id = random_id("embd")
    rids = []
    try:
        for i, (text, ids) in enumerate(zip(texts, token_ids, strict=True)):
            rid = f"{request_id}-{i}"
            ctx.log_request(rid, text if text is not None else ids, ids, params)
            await engine.add_request(channel, rid, text, params, ids, req.priority)
            rids.append(rid)
        finals = await unless_disconnected(channel.collect_final(), raw)
    except ClientDisconnected:
        return JSONResponse({}, status_code=499)
    except Exception as e:
        raise from_engine_error(e) from None
    finally:
        channel.abort()  # a no-op once every request finished; else frees their KV blocks

    data = []
    for i, rid in enumerate(rids):
        vector = finals[rid].outputs.embedding
        if req.encoding_format == "base64":
            encoded = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
            data.append(EmbeddingData(index=i, embedding=encoded))
        else:
            data.append(EmbeddingData(index=i, embedding=vector))
    num_tokens = sum(len(ids) for ids in token_ids)
    return EmbeddingResponse(
        id=request_id,
        created=int(time.time()),
        model=model,
        data=data,
        usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
    )
