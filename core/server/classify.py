"""``POST /classify`` (also ``/v1/classify``): vLLM's classification API over a
sequence-classification model (``*ForSequenceClassification``).

Every input becomes one engine request, as on ``/v1/embeddings``; the engine core runs the
classification head on the pooled first token and sends back the class probabilities (the
softmax of the logits; with one label the sigmoid of the logit). ``label`` is the most probable
class's name from config.json's ``id2label``.
"""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse

from engine.pooling_params import PoolingParams
from engine.server.embeddings import embed_inputs, embedding_inputs
from engine.server.errors import bad_request
from engine.server.protocol import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingUsage,
)
from engine.server.serving import ServingContext, random_id
from engine.server.streaming import ClientDisconnected


async def create_classification(
    ctx: ServingContext, req: ClassificationRequest, raw: Request, route: str
):
    """Serve one classification request."""
    model = await ctx.check_model(req.model)
    ctx.require_runner("pooling", route)
    if ctx.pooling_task != "classify":
        raise bad_request(
            f"The model `{ctx.model_name}` is an embedding model: it answers /v1/embeddings, "
            f"/score and /rerank, not classification ({route}); serve a "
            "*ForSequenceClassification model.",
            "model",
        )
    inputs = embedding_inputs(req.input)
    request_id = random_id("classify")
    try:
        probs, num_tokens = await embed_inputs(
            ctx, inputs, PoolingParams(), raw, request_id, req.priority, "input"
        )
    except ClientDisconnected:
        return JSONResponse({}, status_code=499)
    labels = ctx.model_config.pooler_config.labels or []
    data = []
    for i, p in enumerate(probs):
        best = max(range(len(p)), key=p.__getitem__)
        label = labels[best] if best < len(labels) else f"LABEL_{best}"
        data.append(ClassificationData(index=i, label=label, probs=p, num_classes=len(p)))
    return ClassificationResponse(
        id=request_id,
        created=int(time.time()),
        model=model,
        data=data,
        usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
    )
