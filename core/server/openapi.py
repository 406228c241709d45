"""The OpenAPI document of the server, true to what it answers.

FastAPI's generated document lists only ``200`` and ``422`` per route, while the server never
answers 422 and does answer 400/401/404/413/500/503 with the OpenAI error envelope. This
module builds the document from FastAPI's and then:

- replaces ``422`` by the statuses each route really answers, each with the ``ErrorResponse``
  schema, or ``AnthropicErrorResponse`` on the Anthropic Messages routes (``401`` and the
  security schemes, bearer or ``x-api-key``, only when ``--api-key`` is set);
- documents ``text/event-stream`` next to JSON for the generation routes (``stream: true``):
  OpenAI's ``data:`` chunks ending in ``[DONE]``, or Anthropic's named events;
- writes the served model's limits into the request schemas once the engine is loaded: the
  largest ``n``, ``logprobs``, ``top_logprobs`` and ``prompt_logprobs``, token ids below the
  vocabulary, ``logit_bias`` keys that are token ids, ``max_tokens`` and
  ``truncate_prompt_tokens`` within the context, at most ``max_prompts`` prompts, and
  ``chat_template`` only when the server trusts request templates. Before the engine is
  loaded (503 everywhere) the document has the static limits only, and it is rebuilt once.

What no JSON schema can say (a prompt's length in tokens against the context, fields that
constrain each other such as ``min_tokens <= max_tokens``, whether a regex or a template
compiles) stays in the descriptions and in the 400s that name the field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from engine.server.anthropic_protocol import AnthropicErrorResponse
from engine.server.chat_template import reserved_template_args
from engine.server.errors import uses_anthropic_envelope
from engine.server.protocol import INT64_MAX, INT64_MIN, ErrorResponse

_ENVELOPE = {"$ref": "#/components/schemas/ErrorResponse"}
_ANTHROPIC_ENVELOPE = {"$ref": "#/components/schemas/AnthropicErrorResponse"}
_DESCRIPTIONS = {
    400: "Invalid request: malformed JSON, a wrong type or value (`param` names the field), "
    "or a prompt too long for the context (`code: context_length_exceeded`).",
    401: "Missing or wrong API key (`Authorization: Bearer KEY` or `x-api-key: KEY`).",
    404: "Unknown model (`code: model_not_found`), or on the Responses API's routes an "
    "unknown or forgotten response id (`param` names the field).",
    413: "Request body over `--max-request-body-bytes`.",
    500: "The engine failed (`code: engine_dead`), or an unexpected server error.",
    503: "Starting, draining, or the request was aborted by shutdown.",
}
_SCORE_PATHS = (
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/classify",
    "/v1/classify",
)
# The error statuses of each route, besides 401 on /v1 routes when API keys are set.
_ROUTE_ERRORS = {
    ("post", "/v1/completions"): (400, 404, 413, 500, 503),
    ("post", "/v1/chat/completions"): (400, 404, 413, 500, 503),
    ("post", "/v1/messages"): (400, 404, 413, 500, 503),
    ("post", "/v1/responses"): (400, 404, 413, 500, 503),
    ("get", "/v1/responses/{response_id}"): (404, 500, 503),
    ("delete", "/v1/responses/{response_id}"): (404, 500, 503),
    ("get", "/v1/responses/{response_id}/input_items"): (404, 500, 503),
    ("post", "/v1/messages/count_tokens"): (400, 404, 413, 500, 503),
    ("post", "/v1/embeddings"): (400, 404, 413, 500, 503),
    **{("post", p): (400, 404, 413, 500, 503) for p in _SCORE_PATHS},
    ("post", "/tokenize"): (400, 404, 413, 500, 503),
    ("post", "/detokenize"): (400, 404, 413, 500, 503),
    ("get", "/v1/models"): (500, 503),
    ("get", "/tokenizer_info"): (500, 503),
    ("get", "/health"): (503,),
    ("get", "/metrics"): (),
    ("get", "/version"): (),
}
_STREAMING = ("/v1/completions", "/v1/chat/completions")
_ANTHROPIC_EVENTS = (
    "message_start",
    "content_block_start",
    "ping",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
    "error",
)


class ServedLimits:
    """The limits of the loaded model and server, as the request schemas state them."""

    def __init__(
        self,
        *,
        max_n: int,
        max_logprobs: int,
        max_model_len: int,
        max_prompts: int,
        token_id_limit: int,
        model_vocab: int,
        trust_request_chat_template: bool,
        pooler: Any = None,
        runner: str = "generate",
    ) -> None:
        self.max_n = max_n
        self.max_logprobs = max_logprobs
        self.max_model_len = max_model_len
        self.max_prompts = max_prompts
        self.token_id_limit = token_id_limit  # stop_token_ids, /detokenize
        self.row_limit = min(token_id_limit, model_vocab)  # prompt ids, logit_bias keys
        self.trust_request_chat_template = trust_request_chat_template
        self.pooler = pooler  # a pooling model's PoolerConfig (its embedding dimensions)
        self.runner = runner  # "generate" or "pooling": which of the model routes it serves

    @classmethod
    def of(cls, ctx: Any) -> ServedLimits:
        """The limits of a ``ServingContext``."""
        return cls(
            max_n=ctx.options.limits.max_n,
            max_logprobs=ctx.max_logprobs,
            max_model_len=ctx.max_model_len,
            max_prompts=ctx.options.limits.max_prompts,
            token_id_limit=ctx.token_ids.limit,
            model_vocab=ctx.token_ids.model_vocab,
            trust_request_chat_template=ctx.options.trust_request_chat_template,
            pooler=_pooler_of(ctx),
            runner=_runner_of(ctx),
        )


def install_openapi(
    app: FastAPI, limits: Callable[[], ServedLimits | None], api_keys: bool
) -> None:
    """Make ``app.openapi()`` (and ``/openapi.json``) return the server's true document.
    ``limits()`` gives the served model's limits once it is loaded (None before)."""
    cache: dict[bool, dict[str, Any]] = {}

    def openapi() -> dict[str, Any]:
        served = limits()
        key = served is not None
        if key not in cache:
            cache[key] = build_document(app, served, api_keys)
        app.openapi_schema = cache[key]
        return cache[key]

    app.openapi = openapi  # type: ignore[method-assign]


def build_document(app: FastAPI, limits: ServedLimits | None, api_keys: bool) -> dict[str, Any]:
    """The OpenAPI document of ``app``, with the served limits when known."""
    doc = get_openapi(
        title=app.title,
        version=app.version,
        description=app.description,
        routes=app.routes,
    )
    _exact_integer_bounds(doc)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas.update(_error_schemas())
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            _document_responses(method, path, operation, api_keys)
    if api_keys:
        doc["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer", "description": "--api-key"},
            "apiKey": {
                "type": "apiKey",
                "in": "header",
                "name": "x-api-key",
                "description": "--api-key, as Anthropic clients send it",
            },
        }
    if limits is not None:
        for path in _unserved(limits):
            doc["paths"].pop(path, None)
        _served_limits(schemas, limits)
    return doc


# The model routes a runner does not serve (they answer 400 naming what the model supports), left
# out of the document once the model is known, as vLLM registers only its model's tasks' routes.
_UNSERVED: dict[str, tuple[str, ...]] = {
    "generate": ("/v1/embeddings", *_SCORE_PATHS),
    "pooling": ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"),
}


def _unserved(limits: ServedLimits) -> tuple[str, ...]:
    """The routes the loaded model answers only with a 400: the other runner's, and among
    the pooling routes those of the other task (an embedding model does not classify; a
    classifier does not embed, and scores pairs only with one label)."""
    paths = _UNSERVED[limits.runner]
    pooler = limits.pooler
    if limits.runner != "pooling" or pooler is None:
        return paths
    if getattr(pooler, "task", "embed") != "classify":
        return (*paths, "/classify", "/v1/classify")
    paths = (*paths, "/v1/embeddings")
    if len(getattr(pooler, "labels", None) or []) != 1:
        paths = (*paths, *(p for p in _SCORE_PATHS if "classify" not in p))
    return paths


def _error_schemas() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model in (ErrorResponse, AnthropicErrorResponse):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        out.update(schema.pop("$defs", {}))
        out[model.__name__] = schema
    return out


def _document_responses(method: str, path: str, operation: dict, api_keys: bool) -> None:
    responses = operation.setdefault("responses", {})
    responses.pop("422", None)
    errors = list(_ROUTE_ERRORS.get((method, path), (400, 500, 503)))
    if api_keys and path.startswith("/v1"):
        errors.append(401)
        operation["security"] = [{"bearer": []}, {"apiKey": []}]  # either one
    envelope = _ANTHROPIC_ENVELOPE if uses_anthropic_envelope(path) else _ENVELOPE
    for status in sorted(errors):
        responses[str(status)] = {
            "description": _DESCRIPTIONS[status],
            "content": {"application/json": {"schema": envelope}},
        }
    if path == "/health":
        responses["200"] = {"description": "Serving requests (an empty body)."}
    elif path == "/metrics":
        responses["200"] = {
            "description": "Prometheus text exposition format.",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    if path in _STREAMING and "200" in responses:
        content = responses["200"].setdefault("content", {})
        # OpenAPI 3.1: the schema of an event stream describes one event.
        content["text/event-stream"] = {
            "schema": {
                "type": "object",
                "description": "With `stream: true`, one event per chunk: `data` is a JSON "
                "chunk (or an error envelope), and the last event's `data` is `[DONE]`.",
                "required": ["data"],
                "properties": {
                    "data": {
                        "anyOf": [
                            {"const": "[DONE]"},
                            {
                                "type": "string",
                                "contentMediaType": "application/json",
                                "contentSchema": {"type": "object"},
                            },
                        ]
                    }
                },
            }
        }

    if path == "/v1/responses" and "200" in responses:
        content = responses["200"].setdefault("content", {})
        content["text/event-stream"] = {
            "schema": {
                "type": "object",
                "description": "With `stream: true`, OpenAI's Responses events: "
                "`response.created`, `response.in_progress`, per output item "
                "`response.output_item.added`, its parts and deltas, "
                "`response.output_item.done`, then `response.completed` or "
                "`response.incomplete` (an `error` event and `response.failed` on failure). "
                "`data` is the JSON event, whose `type` is the event's name.",
                "required": ["event", "data"],
                "properties": {
                    "event": {"type": "string"},
                    "data": {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {
                            "type": "object",
                            "required": ["type", "sequence_number"],
                        },
                    },
                },
            }
        }
    if path == "/v1/messages" and "200" in responses:
        content = responses["200"].setdefault("content", {})
        content["text/event-stream"] = {
            "schema": {
                "type": "object",
                "description": "With `stream: true`, Anthropic's events: `message_start`, per "
                "content block `content_block_start`, its `content_block_delta`s and "
                "`content_block_stop` (a `ping` after the first block starts), `message_delta` "
                "(stop reason, usage), `message_stop`; an `error` event on failure. `data` is "
                "the JSON event, whose `type` is the event's name.",
                "required": ["event", "data"],
                "properties": {
                    "event": {"enum": list(_ANTHROPIC_EVENTS)},
                    "data": {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {"type": "object", "required": ["type"]},
                    },
                },
            }
        }


def _exact_integer_bounds(node: Any) -> None:
    """FastAPI's document model holds bounds as floats: 0 becomes 0.0 and 2**63 - 1 becomes
    9.223372036854776e18, which is 2**63. Put the exact integers back."""
    if isinstance(node, dict):
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            value = node.get(key)
            if isinstance(value, float) and value.is_integer() and node.get("type") == "integer":
                number = int(value)
                if number == 2**63:
                    number = INT64_MAX
                elif number == -(2**63):
                    number = INT64_MIN
                node[key] = number
        for value in node.values():
            _exact_integer_bounds(value)
    elif isinstance(node, list):
        for value in node:
            _exact_integer_bounds(value)


# ------------------------------------------------------------------ the served limits


def _served_limits(schemas: dict[str, Any], limits: ServedLimits) -> None:
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[name]["properties"]
        _integers(props["n"], maximum=limits.max_n)
        _integers(props["prompt_logprobs"], maximum=limits.max_logprobs)
        _integers(props["stop_token_ids"], items=True, maximum=limits.token_id_limit - 1)
        _integers(props["truncate_prompt_tokens"], minimum=1, maximum=limits.max_model_len)
        # A prompt has at least one token, so at most max_model_len - 1 can be generated.
        _integers(props["max_tokens"], maximum=limits.max_model_len - 1)
        _integers(props["min_tokens"], maximum=limits.max_model_len - 1)
        _logit_bias_keys(props["logit_bias"], limits.row_limit)
    # A prompt has at least one token, so at most max_model_len - 1 can be generated.
    _integers(schemas["MessagesRequest"]["properties"]["max_tokens"],
              maximum=limits.max_model_len - 1)  # fmt: skip
    if "ResponsesRequest" in schemas:
        responses = schemas["ResponsesRequest"]["properties"]
        _integers(responses["max_output_tokens"], maximum=limits.max_model_len - 1)
        _integers(responses["min_tokens"], maximum=limits.max_model_len - 1)
        _integers(responses["top_logprobs"], maximum=limits.max_logprobs)
        _logit_bias_keys(responses["logit_bias"], limits.row_limit)
    completion = schemas["CompletionRequest"]["properties"]
    _integers(completion["logprobs"], maximum=limits.max_logprobs)
    _prompt(completion["prompt"], limits)
    if "EmbeddingRequest" in schemas:
        embedding = schemas["EmbeddingRequest"]["properties"]
        _prompt(embedding["input"], limits)
        if limits.pooler is not None:
            _dimensions(embedding, limits.pooler)
    chat = schemas["ChatCompletionRequest"]["properties"]
    _integers(chat["top_logprobs"], maximum=limits.max_logprobs)
    _integers(chat["max_completion_tokens"], maximum=limits.max_model_len - 1)
    detokenize = schemas["DetokenizeRequest"]["properties"]
    _integers(detokenize["tokens"], items=True, maximum=limits.token_id_limit - 1)
    reserved = list(reserved_template_args())
    if not limits.trust_request_chat_template:
        reserved.append("chat_template")
    for name in ("ChatCompletionRequest", "TokenizeChatRequest"):
        for alt in _alternatives(schemas[name]["properties"]["chat_template_kwargs"]):
            if alt.get("type") == "object":
                alt["propertyNames"] = {"not": {"enum": reserved}}
    if not limits.trust_request_chat_template:
        for name in ("ChatCompletionRequest", "TokenizeChatRequest"):
            schemas[name]["properties"]["chat_template"] = {
                "type": "null",
                "title": "Chat Template",
                "description": "Refused: the server runs without --trust-request-chat-template.",
            }


def _runner_of(ctx: Any) -> str:
    """ "pooling" for an embedding model, else "generate"."""
    model = getattr(getattr(ctx.async_engine, "config", None), "model", None)
    return "pooling" if getattr(model, "runner_type", None) == "pooling" else "generate"


def _pooler_of(ctx: Any) -> Any:
    """The served model's ``PoolerConfig`` when it is a pooling model, else None."""
    if _runner_of(ctx) != "pooling":
        return None
    return getattr(ctx.async_engine.config.model, "pooler_config", None)


def _dimensions(props: dict[str, Any], pooler: Any) -> None:
    """``dimensions`` as the pooling model takes it (``PoolerConfig.check``): refused unless
    it is a matryoshka model, then one of its declared dimensions, or any up to its size."""
    if not pooler.is_matryoshka:
        props["dimensions"] = {
            "type": "null",
            "title": "Dimensions",
            "description": "Refused: this model declares no matryoshka dimensions.",
        }
    elif pooler.matryoshka_dimensions:
        allowed = [d for d in pooler.matryoshka_dimensions if d <= pooler.hidden_size]
        _integers(props["dimensions"], enum=allowed)
    else:
        _integers(props["dimensions"], maximum=pooler.hidden_size)


def _integers(schema: dict[str, Any], items: bool = False, **bounds: int) -> None:
    """Set ``bounds`` on every integer alternative of ``schema`` (or of its array items),
    leaving the ``-1`` constant of ``truncate_prompt_tokens`` alone."""
    for alt in _alternatives(schema):
        if items and alt.get("type") == "array":
            _integers(alt["items"], **bounds)
        elif not items and alt.get("type") == "integer" and "const" not in alt:
            alt.update(bounds)


def _alternatives(schema: dict[str, Any]) -> list[dict[str, Any]]:
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return [alt for option in schema[key] for alt in _alternatives(option)]
    return [schema]


def _prompt(schema: dict[str, Any], limits: ServedLimits) -> None:
    for alt in _alternatives(schema):
        if alt.get("type") != "array":
            continue
        alt["maxItems"] = limits.max_prompts
        inner = alt["items"]
        if inner.get("type") == "integer":
            inner["maximum"] = limits.row_limit - 1
            alt.pop("maxItems")  # one prompt of token ids: the context bounds its length
        elif inner.get("type") == "array":
            inner["items"]["maximum"] = limits.row_limit - 1


def _logit_bias_keys(schema: dict[str, Any], row_limit: int) -> None:
    for alt in _alternatives(schema):
        if alt.get("type") == "object":
            alt["propertyNames"] = {"pattern": f"^{decimal_below(row_limit)}$"}


def decimal_below(limit: int) -> str:
    """A regular expression matching the canonical decimal numerals of 0..limit-1 (no sign,
    no leading zero): how ``logit_bias`` keys are written."""
    if limit <= 0:
        raise ValueError("limit must be positive")
    top = str(limit - 1)
    options = ["0"] if limit - 1 >= 0 else []
    # Every length shorter than the top's: any numeral of that length.
    for length in range(1, len(top)):
        options.append("[1-9]" + "[0-9]" * (length - 1) if length > 1 else "[1-9]")
    # The top's length: numerals up to it, digit by digit.
    if len(top) == 1:
        if top != "0":
            options.append(f"[1-{top}]" if top != "1" else "1")
    else:
        for i, digit in enumerate(top):
            d = int(digit)
            low = 1 if i == 0 else 0
            rest = len(top) - i - 1
            if i == len(top) - 1:
                if d >= low:
                    options.append(top[:i] + _digit_range(low, d))
            elif d > low:
                options.append(top[:i] + _digit_range(low, d - 1) + "[0-9]" * rest)
    unique = list(dict.fromkeys(options))
    return "(" + "|".join(unique) + ")"


def _digit_range(low: int, high: int) -> str:
    return str(low) if low == high else f"[{low}-{high}]"
