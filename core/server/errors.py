"""The OpenAI error envelope and the exception handlers that produce it.

Every error the server returns has the body
``{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}``.
Validation failures are 400 (never FastAPI's default 422), so OpenAI clients raise their usual
``BadRequestError``.

The Anthropic Messages routes (``/v1/messages...``) answer the same errors in Anthropic's
envelope instead, ``{"type": "error", "error": {"type": str, "message": str}}``, with
Anthropic's type names (``not_found_error``, ``api_error``, ``overloaded_error``...), so that
Anthropic clients raise their own typed errors. Which envelope is a question of the path only
(``error_body_for``), so the middleware that answers before any route runs gets it right too.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}

# Anthropic's error types by status. Its own overload status is 529; this server says 503
# (starting, draining) and keeps that status, with Anthropic's type for it.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
ANTHROPIC_PATH = "/v1/messages"


def route_path(scope: Any) -> str:
    """The request's path as the routes see it: without the ``--root-path`` prefix, which
    uvicorn puts in front of ``scope["path"]`` (the ASGI rule). Every check by path (API keys,
    admission, the error envelope) uses this, so a prefix can neither bypass nor confuse it."""
    path = scope["path"]
    root = scope.get("root_path") or ""
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root) :] or "/"
    return path


def uses_anthropic_envelope(path: str) -> bool:
    """Whether errors on ``path`` take Anthropic's envelope (the Messages API routes)."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


class APIError(Exception):
    """An error answered to the client with ``status_code`` and the OpenAI envelope."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,  # noqa: A002 - the envelope's field name
    ) -> None:
        message = _encodable(message)
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = _encodable(param) if param is not None else None
        self.code = code
        self.type = type or _TYPES.get(status_code, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's envelope: its type for the status, and the message."""
        status = self.status_code
        kind = _ANTHROPIC_TYPES.get(
            status, "api_error" if status >= 500 else "invalid_request_error"
        )
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def body_for(self, path: str) -> dict[str, Any]:
        """The envelope the route at ``path`` answers errors in."""
        return self.anthropic_body() if uses_anthropic_envelope(path) else self.body()


def _encodable(text: str) -> str:
    """``text`` with lone surrogates written as ``\\udXXX`` escapes, so that an error quoting
    what the client sent can always be encoded as UTF-8 JSON."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, param=param, code=code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The OpenAI error envelope."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: APIError, path: str = "") -> JSONResponse:
    """A JSON response carrying ``err``, in the envelope of the route at ``path``."""
    headers = {"WWW-Authenticate": "Bearer"} if err.status_code == 401 else None
    return JSONResponse(err.body_for(path), status_code=err.status_code, headers=headers)


def from_engine_error(exc: BaseException) -> APIError:
    """Map an exception raised while adding or running a request to an ``APIError``.

    The engine raises ``ValueError`` subclasses with a ``param`` attribute for bad input
    (``InvalidRequestError``, ``SamplingParamsError``); a prompt too long carries
    ``max_model_len`` and ``num_tokens``. Duck typing keeps the server independent of where
    those classes live.
    """
    from engine.server.async_engine import EngineDeadError, EngineStoppedError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(500, str(exc), code="engine_dead")
    if isinstance(exc, EngineStoppedError):
        return APIError(503, str(exc), code="server_shutting_down")
    max_len = getattr(exc, "max_model_len", None)
    num_tokens = getattr(exc, "num_tokens", None)
    if max_len is not None and num_tokens is not None:
        return context_length_error(int(max_len), int(num_tokens))
    if isinstance(exc, ValueError) and getattr(exc, "code", None) == "model_not_found":
        # A LoRA adapter unloaded (through any front end) before its request reached a core.
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, ValueError):
        return bad_request(str(exc), param=getattr(exc, "param", None))
    logger.error("request failed: %r", exc, exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}")


def unexpected_error(exc: BaseException) -> APIError:
    """The answer to an exception no route handled: a 400 for the engine's bad-input errors
    (``ValueError`` subclasses carrying ``param``), else a logged 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError) and hasattr(exc, "param"):
        return from_engine_error(exc)
    logger.error("request failed: %r", exc, exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}")


def context_length_error(
    max_model_len: int,
    num_tokens: int,
    prompt_tokens: int | None = None,
    param: str = "prompt",
) -> APIError:
    """The 400 for a request that does not fit the model's context (OpenAI's wording)."""
    if prompt_tokens is None or prompt_tokens == num_tokens:
        detail = f"However, your prompt has {num_tokens} tokens."
    else:
        detail = (
            f"However, you requested {num_tokens} tokens ({prompt_tokens} in the prompt, "
            f"{num_tokens - prompt_tokens} in the completion)."
        )
    return bad_request(
        f"This model's maximum context length is {max_model_len} tokens. {detail} "
        "Please reduce the length of the prompt or of max_tokens.",
        param=param,
        code="context_length_exceeded",
    )


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """The 400 for pydantic's ``errors`` (a readable message naming the field), as a request
    body that fails validation gets."""
    message, param = _validation_message(errors)
    return bad_request(message, param)


def _validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """A readable message and the offending field for pydantic's errors."""
    parts = []
    param = None
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            parts.append(f"Malformed JSON body: {ctx.get('error', err.get('msg'))}")
            continue
        # Union members add their type name to the location; keep what the user wrote.
        field_path = ".".join(p for p in loc if not _is_type_tag(p))
        ctx = err.get("ctx") or {}
        if "param" in ctx:  # a model-level check that names the field itself (lone_surrogate)
            param = param or ctx["param"]
            parts.append(err.get("msg", "invalid value"))
            continue
        if not field_path and err.get("type") in ("model_attributes_type", "dict_type"):
            parts.append(
                "The request body must be a JSON object, sent with Content-Type: application/json."
            )
            continue
        if param is None and field_path:
            param = field_path
        msg = _error_text(err)
        parts.append(f"{field_path}: {msg}" if field_path else msg)
    # Unions report one error per member; the first few say enough.
    unique = list(dict.fromkeys(parts))
    message = "; ".join(unique[:3]) or "invalid request"
    return message, param


_BOUNDS = {
    "greater_than": ("gt", "greater than"),
    "greater_than_equal": ("ge", "at least"),
    "less_than": ("lt", "less than"),
    "less_than_equal": ("le", "at most"),
}
_EXPECTED = {
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "string_type": "a string",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}


def _json_type(value: Any) -> str:
    """What a parsed JSON value is, in the words of the JSON spec."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _number(value: Any) -> str:
    return f"{value:.7g}" if isinstance(value, float) else str(value)


def _error_text(err: dict[str, Any]) -> str:
    """One pydantic error in the words of the API: the expected type and what came instead,
    or the bound that was crossed and the value."""
    kind = err.get("type", "")
    ctx = err.get("ctx") or {}
    if kind in _BOUNDS:
        key, words = _BOUNDS[kind]
        return f"must be {words} {_number(ctx.get(key))}, got {_number(err.get('input'))}"
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {_json_type(err.get('input'))}"
    if kind == "string_unicode":  # a constrained string with a lone surrogate
        return (
            "contains a lone UTF-16 surrogate; text must be valid Unicode, where surrogates "
            "only come in pairs"
        )
    if kind == "finite_number":
        return f"must be a finite number, got {err.get('input')!r}"
    if kind == "missing":
        return "this field is required"
    if kind == "none_required":  # a field only null may take: not supported
        return "not supported (only null is accepted)"
    if kind in ("too_short", "too_long"):
        limit = ctx.get("min_length" if kind == "too_short" else "max_length")
        words = "at least" if kind == "too_short" else "at most"
        return f"must have {words} {limit} item{'s' if limit != 1 else ''}"
    return err.get("msg", "invalid value")


def _name_missing_body(request: Request, errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An empty body is FastAPI's one error "Field required" at ``body``; validate ``{}``
    instead, so that the errors name the fields the route requires (``prompt``...)."""
    if (
        len(errors) != 1
        or errors[0].get("type") != "missing"
        or tuple(errors[0]["loc"]) != ("body",)
    ):
        return errors
    body_field = getattr(request.scope.get("route"), "body_field", None)
    if body_field is None:
        return errors
    from pydantic import TypeAdapter, ValidationError

    try:
        TypeAdapter(body_field.field_info.annotation).validate_python({})
    except ValidationError as e:
        return [{**err, "loc": ("body", *err["loc"])} for err in e.errors()]
    return errors


def _is_type_tag(part: str) -> bool:
    """Whether a location part is pydantic's name for a union member rather than a field:
    ``list[int]``, ``str``..., or a model's class name (``TokenizeChatRequest``); request
    fields are snake_case."""
    if part[:1].isupper() and part.isidentifier() and "_" not in part:
        return True
    return part.startswith(("list[", "dict[", "function-", "literal[", "constrained-")) or part in (
        "str",
        "int",
        "float",
        "bool",
        "list",
        "dict",
        "none",
    )


def install_error_handlers(app: FastAPI) -> None:
    """Make every error (validation, HTTP, engine, unexpected) answer the OpenAI envelope, or
    Anthropic's on the Messages routes."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, route_path(request.scope))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(_name_missing_body(request, exc.errors()))
        return error_response(bad_request(message, param=param), route_path(request.scope))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {route_path(request.scope)!r}"
            if route_path(request.scope) == "/tokenizer_info":
                message += " (start the server with --enable-tokenizer-info-endpoint)"
        elif exc.status_code == 405:
            message = f"method {request.method} not allowed on {route_path(request.scope)!r}"
        response = error_response(APIError(exc.status_code, message), route_path(request.scope))
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        if exc.status_code == 405:  # RFC 9110: every method this path serves
            response.headers["Allow"] = _allowed_methods(request)
        return response

    # No handler for ``Exception`` here: Starlette runs that one inside its outermost
    # ServerErrorMiddleware, which re-raises after replying, and uvicorn then drops the
    # keep-alive connection. ``UnexpectedErrorMiddleware`` (engine.server.middleware) answers
    # unexpected exceptions instead, inside the app.


def _allowed_methods(request: Request) -> str:
    """Every method some route serves at this path (Starlette's 405 names only the first
    matching route's, so GET and DELETE on one path, two routes, would allow GET alone)."""
    path = request.scope.get("path", "")
    methods: set[str] = set()
    for route in request.app.routes:
        regex = getattr(route, "path_regex", None)
        if regex is not None and regex.match(path):
            methods |= set(getattr(route, "methods", None) or ())
    return ", ".join(sorted(methods))
