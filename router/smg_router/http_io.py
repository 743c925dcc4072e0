"""Reading request bodies and writing JSON answers: the helpers both HTTP modules (handlers, admin) share."""

from __future__ import annotations

import hmac
from typing import Any

import orjson

from smg_router import wire
from smg_router.errors import BadRequest, PayloadTooLarge, RequestTimeout, Unauthorized, shed


def check_bearer(request: wire.Request, key: str | None, *, what: str, key_header: str | None = None) -> None:
    """401 unless the request carries ``Authorization: Bearer <key>`` (compared in constant time; never logged),
    or, where ``key_header`` is given (Anthropic's ``x-api-key``), the bare key in that header."""
    if not key:
        return
    if key_header is not None and (given := request.headers.get(key_header)) is not None:
        if hmac.compare_digest(given.strip().encode(), key.encode()):
            return
        raise Unauthorized(f"this call needs {what} as '{key_header}: <key>'", code="invalid_api_key")
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise Unauthorized(f"this call needs {what} as 'Authorization: Bearer <key>'", code="invalid_api_key")


async def read_body(request: wire.Request, limit: int) -> bytes:
    """The whole body, or 413 when it is (or announces itself) larger than ``limit`` bytes, 408 when it stops
    arriving (``--body-timeout``) or arrives too slowly (``--body-min-rate``), 503 when it was shed because the
    router holds too many body bytes (``--max-inflight-bytes``)."""
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(
            f"request body of {request.content_length} bytes exceeds the limit of {limit} bytes",
            code="payload_too_large",
        )
    try:
        return await request.read()
    except wire.BodyTooLarge:
        raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes", code="payload_too_large") from None
    except wire.BodyTimeout as e:
        raise RequestTimeout.of_body(e) from None
    except wire.BodyOverBudget as e:
        raise shed(e) from None


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 saying what is wrong with it."""
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    return body


def json_response(data: object, status: int = 200) -> wire.Response:
    return wire.Response(status=status, body=orjson.dumps(data), content_type="application/json")
