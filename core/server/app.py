"""The FastAPI application: routes, middleware and the server's lifecycle state.

``build_app`` returns an app whose engine arrives later (``ServerState.set_ready``): the HTTP
port answers ``/health`` with 503 while the model loads, 200 once it is served, and 503 again
while draining on shutdown or after the engine died.
"""

from __future__ import annotations

import enum
import inspect
import logging
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from engine.server.anthropic import count_message_tokens, create_message
from engine.server.anthropic_protocol import (
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
    MessagesResponse,
)
from engine.server.async_engine import AsyncEngine
from engine.server.chat import create_chat_completion
from engine.server.classify import create_classification
from engine.server.completions import create_completion
from engine.server.embeddings import create_embedding
from engine.server.errors import APIError, bad_request, error_response, install_error_handlers
from engine.server.metrics import ServerMetrics
from engine.server.middleware import (
    AdmissionMiddleware,
    APIKeyMiddleware,
    BodyLimitMiddleware,
    RequestIdMiddleware,
    UnexpectedErrorMiddleware,
)
from engine.server.models import (
    RUNTIME_LORA_ENV,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    runtime_lora_updating_allowed,
)
from engine.server.openapi import ServedLimits, install_openapi
from engine.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ClassificationRequest,
    ClassificationResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ModelList,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
    VersionResponse,
)
from engine.server.responses import (
    create_response,
    delete_response,
    get_response,
    list_input_items,
)
from engine.server.responses_protocol import ResponsesRequest
from engine.server.score import create_rerank, create_score
from engine.server.serving import ServingContext, ServingOptions
from engine.server.tools.request import validate_tools

logger = logging.getLogger(__name__)


class Phase(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"


@dataclass
class ServerOptions:
    """HTTP-level options (the rest is in ``ServingOptions``)."""

    api_keys: list[str] = field(default_factory=list)
    max_request_body_bytes: int = 16 * 1024 * 1024
    # vLLM's --enable-tokenizer-info-endpoint: GET /tokenizer_info exposes the tokenizer's
    # configuration and chat template, so it is off unless asked for.
    enable_tokenizer_info_endpoint: bool = False
    # Cross-origin requests from browsers (vLLM's --allowed-origins, --allowed-methods,
    # --allowed-headers, --allow-credentials). No origins: no CORS headers at all (vLLM allows
    # every origin by default; here a browser page on another origin is refused unless asked).
    allowed_origins: list[str] = field(default_factory=list)
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    # vLLM's --enable-request-id-headers: an X-Request-Id header on every response.
    enable_request_id_headers: bool = False
    serving: ServingOptions = field(default_factory=ServingOptions)


class ServerState:
    """Where the server is in its life, and the engine once it is loaded."""

    def __init__(self) -> None:
        self.phase = Phase.STARTING
        self.ctx: ServingContext | None = None
        self.metrics: ServerMetrics | None = None
        self.startup_error: BaseException | None = None

    def set_ready(self, ctx: ServingContext, metrics: ServerMetrics) -> None:
        self.ctx, self.metrics = ctx, metrics
        self.phase = Phase.READY

    @property
    def engine(self) -> AsyncEngine | None:
        return self.ctx.async_engine if self.ctx is not None else None

    def refusal(self) -> APIError | None:
        """Why new work is refused now, or None when it is welcome."""
        if self.phase is Phase.STARTING:
            return APIError(503, "The server is starting: the model is loading.", code="starting")
        if self.phase in (Phase.DRAINING, Phase.STOPPED):
            return APIError(
                503, "The server is shutting down and accepts no new requests.", code="draining"
            )
        engine = self.engine
        if engine is not None and engine.dead is not None:
            return APIError(500, f"The engine failed: {engine.dead}", code="engine_dead")
        return None

    def require_ctx(self) -> ServingContext:
        err = self.refusal()
        if err is not None:
            raise err
        assert self.ctx is not None
        return self.ctx


def build_app(options: ServerOptions, state: ServerState | None = None) -> FastAPI:
    """The ASGI app serving the OpenAI-compatible API and the operational endpoints."""
    from engine.version import __version__

    state = state or ServerState()
    kwargs = {}
    if "strict_content_type" in inspect.signature(FastAPI).parameters:
        # Parse JSON bodies sent without a Content-Type too (curl -d), as older FastAPI did.
        kwargs["strict_content_type"] = False
    app = FastAPI(
        title="engine OpenAI-compatible server",
        version=__version__,
        description="OpenAI-compatible completions and chat completions served by `engine`.",
        **kwargs,
    )
    app.state.server = state
    install_error_handlers(app)
    install_openapi(
        app,
        lambda: ServedLimits.of(state.ctx) if state.ctx is not None else None,
        api_keys=bool(options.api_keys),
    )

    @app.get("/health", tags=["operations"])
    async def health() -> Response:
        """200 when the engine serves requests; 503 while starting, draining or dead."""
        err = state.refusal()
        if err is not None:
            err.status_code = 503
            return error_response(err)
        return Response(status_code=200)

    @app.get("/metrics", tags=["operations"])
    async def metrics() -> Response:
        """Prometheus metrics (``engine:`` prefix, ``model_name`` label)."""
        body = state.metrics.render() if state.metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/version", response_model=VersionResponse, tags=["operations"])
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/v1/models", response_model=ModelList, tags=["openai"])
    async def models() -> ModelList:
        """The served model names, then the LoRA adapters (``parent``: their base model)."""
        ctx = state.require_ctx()
        await ctx.models.refresh(ctx.async_engine)  # adapters loaded through other front ends
        return ModelList(data=ctx.models.cards())

    if runtime_lora_updating_allowed():
        logger.warning(
            "%s is set: LoRA adapters may be loaded and unloaded at run time "
            "(/v1/load_lora_adapter, /v1/unload_lora_adapter)",
            RUNTIME_LORA_ENV,
        )

        @app.post("/v1/load_lora_adapter", tags=["lora"], response_class=PlainTextResponse)
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
            """Load a LoRA adapter (PEFT format) under ``lora_name``; 400 with the reason when
            it cannot be served."""
            ctx = state.require_ctx()
            return PlainTextResponse(await ctx.models.load(ctx.async_engine, body))

        @app.post("/v1/unload_lora_adapter", tags=["lora"], response_class=PlainTextResponse)
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
            """Stop serving an adapter; its requests in flight finish first."""
            ctx = state.require_ctx()
            return PlainTextResponse(await ctx.models.unload(ctx.async_engine, body))

    @app.post("/v1/completions", response_model=CompletionResponse, tags=["openai"])
    async def completions(body: CompletionRequest, request: Request):
        """Text completions (``stream=true`` answers server-sent events)."""
        ctx = state.require_ctx()
        _warn_extra(body)
        return await create_completion(ctx, body, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, tags=["openai"])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        """Chat completions through the model's chat template."""
        ctx = state.require_ctx()
        _warn_extra(body)
        return await create_chat_completion(ctx, body, request)

    @app.post("/v1/messages", response_model=MessagesResponse, tags=["anthropic"])
    async def messages(body: MessagesRequest, request: Request):
        """Anthropic's Messages API through the chat template (``stream=true`` answers
        Anthropic's server-sent events); errors in Anthropic's envelope."""
        ctx = state.require_ctx()
        _warn_extra(body)
        return await create_message(ctx, body, request)

    @app.post("/v1/messages/count_tokens", response_model=CountTokensResponse, tags=["anthropic"])
    async def count_tokens(body: CountTokensRequest) -> CountTokensResponse:
        """The ``input_tokens`` a Messages request with these messages, system prompt and tools
        would have."""
        ctx = state.require_ctx()
        _warn_extra(body)
        return await count_message_tokens(ctx, body)

    @app.post("/v1/responses", tags=["openai"])
    async def responses(body: ResponsesRequest, request: Request):
        """OpenAI's Responses API through the chat template (``stream=true`` answers its
        semantic server-sent events); function tools, structured outputs, reasoning items,
        ``previous_response_id``."""
        ctx = state.require_ctx()
        _warn_extra(body)
        return await create_response(ctx, body, request)

    @app.get("/v1/responses/{response_id}", tags=["openai"])
    async def retrieve_response(response_id: str):
        """A response this front end keeps (``store``, the default)."""
        return get_response(state.require_ctx(), response_id)

    @app.delete("/v1/responses/{response_id}", tags=["openai"])
    async def remove_response(response_id: str):
        """Forget a kept response."""
        return delete_response(state.require_ctx(), response_id)

    @app.get("/v1/responses/{response_id}/input_items", tags=["openai"])
    async def response_input_items(response_id: str):
        """The input items of a kept response."""
        return list_input_items(state.require_ctx(), response_id)

    def score_route(path: str):
        async def score(body: ScoreRequest, request: Request) -> ScoreResponse:
            ctx = state.require_ctx()
            _warn_extra(body)
            return await create_score(ctx, body, request, path)

        score.__doc__ = """vLLM's score API on an embedding model: the cosine similarity of
        ``text_1`` and each ``text_2`` (1:N) or of two lists pairwise (N:N)."""
        return score

    def rerank_route(path: str):
        async def rerank(body: RerankRequest, request: Request) -> RerankResponse:
            ctx = state.require_ctx()
            _warn_extra(body)
            return await create_rerank(ctx, body, request, path)

        rerank.__doc__ = """Jina's and Cohere's rerank API (as vLLM serves it) on an
        embedding model: ``documents`` ordered by their cosine similarity to ``query``."""
        return rerank

    def classify_route(path: str):
        async def classify(body: ClassificationRequest, request: Request):
            ctx = state.require_ctx()
            _warn_extra(body)
            return await create_classification(ctx, body, request, path)

        classify.__doc__ = """vLLM's classification API on a sequence classifier: each
        input's class probabilities and most probable label."""
        return classify

    for path in ("/classify", "/v1/classify"):
        app.add_api_route(path, classify_route(path), methods=["POST"],
                          response_model=ClassificationResponse, tags=["vllm"])  # fmt: skip
    for path in ("/score", "/v1/score"):
        app.add_api_route(path, score_route(path), methods=["POST"],
                          response_model=ScoreResponse, tags=["vllm"])  # fmt: skip
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank_route(path), methods=["POST"],
                          response_model=RerankResponse, tags=["vllm"])  # fmt: skip

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, tags=["openai"])
    async def embeddings(body: EmbeddingRequest, request: Request):
        """Embeddings of one or more inputs (a pooling model: ``engine serve --runner
        pooling``, or an embedding checkpoint)."""
        ctx = state.require_ctx()
        _warn_extra(body)
        return await create_embedding(ctx, body, request)

    @app.post("/tokenize", response_model=TokenizeResponse, tags=["tokenizer"])
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        """Token ids of a prompt, or of chat messages rendered with the chat template."""
        ctx = state.require_ctx()
        await ctx.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            text = await ctx.render_chat(
                body.messages,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                tools=validate_tools(body.tools) if body.tools is not None else None,
                chat_template=body.chat_template,
                chat_template_kwargs=body.chat_template_kwargs,
            )
            ids = await ctx.encode(text, add_special_tokens=False)
        else:
            ids = await ctx.encode(body.prompt, body.add_special_tokens)
        strs = [ctx.token_text(t) for t in ids] if body.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs
        )

    @app.post("/detokenize", response_model=DetokenizeResponse, tags=["tokenizer"])
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        """The text of token ids."""
        ctx = state.require_ctx()
        await ctx.check_model(body.model)
        ctx.require_tokenizer("/detokenize", "tokens")
        ctx.check_token_ids(body.tokens, "tokens", needs_row=False)
        return DetokenizeResponse(prompt=ctx.decode(body.tokens))

    if options.enable_tokenizer_info_endpoint:

        @app.get("/tokenizer_info", response_model=TokenizerInfoResponse, tags=["tokenizer"])
        async def tokenizer_info() -> JSONResponse:
            """The tokenizer's configuration (vLLM's route, read by lm-evaluation-harness's
            remote tokenizer): special tokens, chat template, ``tokenizer_class``."""
            return JSONResponse(state.require_ctx().tokenizer_info())

    @app.get("/", include_in_schema=False)
    async def root() -> JSONResponse:
        return JSONResponse({"message": "engine OpenAI-compatible server", "docs": "/docs"})

    # Outermost first: answer unexpected errors, authenticate, admit, bound the body.
    app.add_middleware(BodyLimitMiddleware, max_bytes=options.max_request_body_bytes)
    app.add_middleware(AdmissionMiddleware, refusal=state.refusal)
    if options.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=options.api_keys)
    app.add_middleware(UnexpectedErrorMiddleware)
    if options.enable_request_id_headers:
        app.add_middleware(RequestIdMiddleware)
    if options.allowed_origins:
        # Outermost: preflights are answered before authentication, and every answer (401,
        # 413, 503 included) carries the headers a browser needs to read it.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=options.allowed_origins,
            allow_methods=options.allowed_methods,
            allow_headers=options.allowed_headers,
            allow_credentials=options.allow_credentials,
        )
    return app


def _warn_extra(body) -> None:
    extra = body.model_extra
    if extra:
        # repr: a name may hold anything, lone surrogates included, and must stay loggable.
        names = ", ".join(repr(name) for name in sorted(extra))
        logger.warning("ignoring unsupported request fields: %s", names)


__all__ = ["Phase", "ServerOptions", "ServerState", "build_app", "bad_request"]
