"""Server-sent events and client-disconnect handling shared by the generation endpoints."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response that aborts its engine requests however it ends.

    The body generator aborts in its ``finally``, but a client that leaves before the first
    chunk can cancel the response before the generator ever starts; this covers that case.
    """

    def __init__(self, body: Any, channel: Any) -> None:
        super().__init__(body, media_type="text/event-stream", headers=SSE_HEADERS)
        self._channel = channel

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._channel.abort()


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


# Compact JSON, UTF-8 kept as is; a bound method skips json.dumps' per-call setup.
to_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse(data: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``data`` as compact JSON."""
    return b"data: " + to_json(data).encode() + b"\n\n"


class ChunkWriter:
    """Renders the stream chunks of one response from a pre-rendered head.

    A chunk is ``{"id", "object", "created", "model", "choices": [choice], "usage"?}``; only
    the choice (and usage) change from one to the next, so the rest is rendered once.
    """

    def __init__(
        self, request_id: str, obj: str, created: int, model: str, usage_field: bool
    ) -> None:
        self._head = (
            f'data: {{"id":{to_json(request_id)},"object":"{obj}","created":{created},'
            f'"model":{to_json(model)},"choices":['
        )
        self._usage_field = usage_field

    def chunk(self, choice_json: str, usage: dict[str, int] | None = None) -> bytes:
        """One event with one choice (already JSON) and, if the client asked, ``usage``."""
        if not self._usage_field:
            return (self._head + choice_json + "]}\n\n").encode()
        tail = "null" if usage is None else to_json(usage)
        return (self._head + choice_json + '],"usage":' + tail + "}\n\n").encode()

    def usage_chunk(self, usage: dict[str, Any]) -> bytes:
        """The final ``choices: []`` event with the request's usage."""
        return (self._head + '],"usage":' + to_json(usage) + "}\n\n").encode()


def usage_dict(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> dict[str, Any]:
    """A usage object for a stream's usage chunks; ``cached_tokens`` (None: left out) becomes
    ``prompt_tokens_details``."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client disconnects (after the body was read).

    This is ``Request.is_disconnected`` without polling: once the body is consumed, the ASGI
    server answers ``receive()`` only with ``http.disconnect``.
    """
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(awaitable: Awaitable[T], request: Request) -> T:
    """Await ``awaitable``; raise ``ClientDisconnected`` (cancelling it) if the client leaves."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        watcher.cancel()
        raise
    if work in done:
        watcher.cancel()
        return work.result()
    work.cancel()
    raise ClientDisconnected()
