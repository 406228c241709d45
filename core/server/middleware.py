"""ASGI middleware: API-key check, request-body size limit, refusing work while draining, the
500 answer to unexpected exceptions, and ``X-Request-Id`` response headers.

Plain ASGI (not ``BaseHTTPMiddleware``) so that streamed responses pass through untouched and
each check costs a few dictionary look-ups.
"""

from __future__ import annotations

import hmac
import json
import uuid
from collections.abc import Callable

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.server.errors import APIError, route_path, unexpected_error


async def send_error(send: Send, err: APIError, path: str = "") -> None:
    """Answer ``err`` without involving the app, in the envelope of the route at ``path``
    (OpenAI's, or Anthropic's on the Messages routes)."""
    body = json.dumps(err.body_for(path)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if err.status_code == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": err.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


class APIKeyMiddleware:
    """Require an API key on ``/v1`` routes (constant-time compare): ``Authorization: Bearer
    <key>`` as OpenAI clients send it, or ``x-api-key: <key>`` as Anthropic clients do."""

    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        self.app = app
        self._keys = [k.encode() for k in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and self._keys
            and route_path(scope).startswith("/v1")
            and scope["method"] != "OPTIONS"
        ):
            auth = _header(scope, b"authorization") or b""
            x_api_key = _header(scope, b"x-api-key")
            scheme, _, token = auth.partition(b" ")
            offered = [token.strip()] if scheme.lower() == b"bearer" else []
            if x_api_key is not None:
                offered.append(x_api_key.strip())
            # Every offered key is compared with every key, so the time says nothing either.
            ok = False
            for candidate in offered:
                for key in self._keys:
                    ok |= hmac.compare_digest(candidate, key)
            if not ok:
                message = (
                    "Missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'."
                    if not auth and x_api_key is None
                    else "Incorrect API key provided."
                )
                err = APIError(401, message, code="invalid_api_key")
                await send_error(send, err, route_path(scope))
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Answer 413 to request bodies larger than ``max_bytes``.

    A declared ``Content-Length`` is checked up front; a chunked body is read (up to the
    limit) before the app sees it, then replayed.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"Request body too large: the limit is {self.max_bytes} bytes "
            "(--max-request-body-bytes).",
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.max_bytes <= 0:
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                err = APIError(400, "invalid Content-Length header")
                await send_error(send, err, route_path(scope))
                return
            if declared > self.max_bytes:
                await send_error(send, self._too_large(), route_path(scope))
                return
            await self.app(scope, receive, send)
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        # Chunked transfer: buffer up to the limit.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await send_error(send, self._too_large(), route_path(scope))
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        buffered: list[Message] = [{"type": "http.request", "body": b"".join(chunks)}]

        async def replay() -> Message:
            if buffered:
                return buffered.pop()
            return await receive()

        await self.app(scope, replay, send)


class AdmissionMiddleware:
    """Refuse work with 503 while the server starts or drains (``/health`` says why)."""

    GUARDED = ("/v1/", "/tokenize", "/detokenize")

    def __init__(self, app: ASGIApp, refusal: Callable[[], APIError | None]) -> None:
        self.app = app
        self._refusal = refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and route_path(scope).startswith(self.GUARDED):
            err = self._refusal()
            if err is not None:
                await send_error(send, err, route_path(scope))
                return
        await self.app(scope, receive, send)


class UnexpectedErrorMiddleware:
    """Answer an exception that escaped the routes with a complete 500 in the route's envelope.

    It sits inside the app, so the exception ends here: the response is whole (with its
    ``Content-Length``) and the keep-alive connection stays usable. (A handler registered for
    ``Exception`` would run in Starlette's ServerErrorMiddleware, which re-raises after
    replying; uvicorn then closes the connection under the client's next request.) When the
    response has already started there is nothing left to say in HTTP: the exception goes on,
    and the server ends that connection.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except ClientDisconnect:
            return  # the client left while its body was read: nobody to answer
        except Exception as exc:  # noqa: BLE001 - the catch-all is this class's purpose
            if started:
                raise
            await send_error(send, unexpected_error(exc), route_path(scope))


class RequestIdMiddleware:
    """``X-Request-Id`` on every response (vLLM's ``--enable-request-id-headers``): the one the
    client sent (so that a caller can follow its own id through proxies and logs), else a
    fresh one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _header(scope, b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
