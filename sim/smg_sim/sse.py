"""Server-sent events output shared by the streaming variants of all generation endpoints.

Chunks are written as they are produced, awaiting each write so a slow client applies backpressure to
its own request. A client that goes away ends the stream quietly; the caller's engine request is then
aborted by its context manager.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

import orjson
from aiohttp import web

from .errors import ApiError, error_body

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


def encode_event(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def respond_sse(request: web.Request, payloads: AsyncGenerator[dict[str, Any], None]) -> web.StreamResponse:
    """Stream `payloads` as SSE `data:` events, then `data: [DONE]`.

    An ApiError raised after the headers were sent becomes an `{"error": ...}` event, since the status
    code can no longer change.
    """
    resp = web.StreamResponse(
        status=200,
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
    )
    await resp.prepare(request)
    try:
        try:
            # aclosing: a disconnect during write() must abort the engine requests right away.
            async with contextlib.aclosing(payloads) as events:
                async for payload in events:
                    await resp.write(encode_event(payload))
        except ApiError as err:
            await resp.write(encode_event(error_body(err.message, type=err.type, code=err.code)))
        await resp.write(DONE)
        await resp.write_eof()
    except ConnectionResetError:
        log.debug("client went away during stream on %s", request.path)
    return resp


def encode_named_event(name: str, payload: Any) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


async def respond_named_sse(
    request: web.Request,
    events: AsyncGenerator[tuple[str, dict[str, Any]], None],
    *,
    on_error: Callable[[ApiError], tuple[str, dict[str, Any]]],
) -> web.StreamResponse:
    """Stream ``(event name, payload)`` pairs as named SSE events (Anthropic Messages, OpenAI Responses), with
    no ``[DONE]``: those protocols end with their own last event.  An ApiError after the headers becomes the
    event ``on_error`` makes of it."""
    resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    try:
        try:
            async with contextlib.aclosing(events) as stream:
                async for name, payload in stream:
                    await resp.write(encode_named_event(name, payload))
        except ApiError as err:
            await resp.write(encode_named_event(*on_error(err)))
        await resp.write_eof()
    except ConnectionResetError:
        log.debug("client went away during stream on %s", request.path)
    return resp
