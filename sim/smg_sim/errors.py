"""OpenAI-shaped error responses and the middleware that produces them.

Every error the sim returns, from any route (including unknown routes and unexpected exceptions), has
the body `{"error": {"message", "type", "param", "code"}}`, which is what OpenAI clients and the
router's error handling expect.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiError(Exception):
    """Raised anywhere below a handler to answer with an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code or _default_code(status)


def _default_code(status: int) -> str:
    return {400: "bad_request", 404: "not_found", 405: "method_not_allowed"}.get(status, "internal_error")


def json_response(data: Any, *, status: int = 200) -> web.Response:
    """A JSON response serialised with orjson (fast, and strict about non-JSON values)."""
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def error_body(message: str, *, type: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": None, "code": code}}


def error_response(err: ApiError) -> web.Response:
    return json_response(error_body(err.message, type=err.type, code=err.code), status=err.status)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn ApiError, aiohttp HTTP errors and crashes into OpenAI-shaped JSON errors."""
    try:
        return await handler(request)
    except ApiError as err:
        return error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        message = f"{exc.reason}: {request.method} {request.path}"
        return error_response(ApiError(exc.status, message, type=kind))
    except Exception as exc:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(ApiError(500, f"internal error: {exc!r}", type="server_error"))
