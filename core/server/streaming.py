"""Server-sent events and client-disconnect handling shared by the generation endpoints."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import Request

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


def sse(data: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``data`` as compact JSON."""
    return (
        b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
    )


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
