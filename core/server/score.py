"""vLLM's scoring routes over an embedding model: ``POST /score`` (also ``/v1/score``) and
``POST /rerank`` (also ``/v1/rerank`` and ``/v2/rerank``, Jina's and Cohere's shape).

On an embedding model a pair's score is the cosine similarity of the two texts' embeddings
(the model's own pooling and normalisation, as ``/v1/embeddings`` returns them), computed in
float32, which is what vLLM answers for an embedding model and what sentence-transformers'
``util.cos_sim`` gives; each distinct text is embedded once per request. Cross-encoders
(``*ForSequenceClassification``, e.g. bge-reranker) score each pair as one prompt, the
way their tokenizer joins two texts: the sigmoid of the classification head's logit, what
sentence-transformers' ``CrossEncoder`` and vLLM answer.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from engine.pooling_params import PoolingParams
from engine.scoring import cosine, score_pairs
from engine.server.embeddings import embed_inputs
from engine.server.errors import bad_request, from_engine_error
from engine.server.protocol import (
    EmbeddingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from engine.server.serving import ServingContext, random_id
from engine.server.streaming import ClientDisconnected


async def _scores(
    ctx: ServingContext,
    route: str,
    pairs: list[tuple[str, str]],
    raw: Request,
    request_id: str,
    priority: int,
    param: str,
) -> tuple[list[float], int]:
    """Each pair's score, and the prompt tokens run: a cross-encoder's score of the pair as
    one prompt, or the cosine similarity of the two texts' embeddings."""
    ctx.require_runner("pooling", route)
    if len(pairs) > ctx.options.limits.max_prompts:
        raise bad_request(
            f"at most {ctx.options.limits.max_prompts} pairs per request, got {len(pairs)}",
            param,
        )
    if ctx.pooling_task == "classify":
        labels = ctx.model_config.pooler_config.labels or []
        if len(labels) != 1:
            raise bad_request(
                f"The model `{ctx.model_name}` is a classifier with {len(labels)} labels: "
                "scoring text pairs takes a cross-encoder (one label); it answers /classify",
                "model",
            )
        ctx.require_tokenizer("scoring text pairs", param)
        ids = [await ctx.run_tokenizer(_pair_ids, ctx.tokenizer, a, b) for a, b in pairs]
        vectors, num_tokens = await embed_inputs(
            ctx, ids, PoolingParams(), raw, request_id, priority, param
        )
        return [float(v[0]) for v in vectors], num_tokens
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # each text once
    if len(texts) > ctx.options.limits.max_prompts:
        raise bad_request(
            f"at most {ctx.options.limits.max_prompts} distinct texts per request, got "
            f"{len(texts)}",
            param,
        )
    vectors, num_tokens = await embed_inputs(
        ctx, list(texts), PoolingParams(), raw, request_id, priority, param
    )
    by_text = dict(zip(texts, vectors, strict=True))
    return [cosine(by_text[a], by_text[b]) for a, b in pairs], num_tokens


def _pair_ids(tokenizer: Any, a: str, b: str) -> list[int]:
    """A pair as one prompt, the way the cross-encoder's tokenizer joins two texts."""
    return list(tokenizer(a, b)["input_ids"])


async def create_score(ctx: ServingContext, req: ScoreRequest, raw: Request, route: str):
    """Serve one score request."""
    model = await ctx.check_model(req.model)
    try:
        pairs = score_pairs(req.text_1, req.text_2)
    except ValueError as e:
        raise from_engine_error(e) from None
    request_id = random_id("score")
    try:
        scores, num_tokens = await _scores(ctx, route, pairs, raw, request_id, req.priority,
                                           "text_2")  # fmt: skip
    except ClientDisconnected:
        return JSONResponse({}, status_code=499)
    return ScoreResponse(
        id=request_id,
        created=int(time.time()),
        model=model,
        data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
        usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
    )


def _document_text(doc: Any, index: int) -> str:
    if isinstance(doc, str):
        return doc
    text = doc.get("text")
    if not isinstance(text, str) or not text:
        raise bad_request(
            f"documents.{index}: a document is a non-empty string or an object with a "
            "non-empty 'text'",
            f"documents.{index}",
        )
    return text


async def create_rerank(ctx: ServingContext, req: RerankRequest, raw: Request, route: str):
    """Serve one rerank request."""
    model = await ctx.check_model(req.model)
    documents = [_document_text(d, i) for i, d in enumerate(req.documents)]
    request_id = random_id("rerank")
    try:
        scores, num_tokens = await _scores(
            ctx, route, [(req.query, d) for d in documents], raw, request_id, req.priority,
            "documents",
        )  # fmt: skip
    except ClientDisconnected:
        return JSONResponse({}, status_code=499)
    order = sorted(range(len(documents)), key=lambda i: (-scores[i], i))
    if req.top_n:
        order = order[: req.top_n]
    results = [
        RerankResult(
            index=i,
            document=RerankDocument(text=documents[i]) if req.return_documents else None,
            relevance_score=scores[i],
        )
        for i in order
    ]
    return RerankResponse(
        id=request_id, model=model, usage=RerankUsage(total_tokens=num_tokens), results=results
    )
