"""One exception hierarchy for the router, each mapped to an OpenAI-shaped JSON error response.

Handlers raise these; the error middleware in ``app.py`` turns any of them into
``{"error": {"message", "type", "code"}}`` with the right status.  Nothing else builds error bodies.
"""

from __future__ import annotations

import orjson

from smg_router import wire


class RouterError(Exception):
    status: int = 500
    type: str = "internal_error"

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.type
        if status is not None:
            self.status = status

    def response(self) -> wire.Response:
        return error_response(self.status, self.message, type=self.type, code=self.code)


class Overloaded(RouterError):
    """The router is at its admission limits; the answer says when to retry."""

    status, type = 503, "service_unavailable"

    def __init__(self, message: str, *, code: str, retry_after: int) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after

    def response(self) -> wire.Response:
        response = super().response()
        response.headers["Retry-After"] = str(self.retry_after)
        return response


def shed(e: wire.BodyOverBudget) -> Overloaded:
    """The 503 of a body shed as it arrived, over the router's body budget."""
    return Overloaded(f"{e}; retry shortly", code="overloaded", retry_after=1)


class BadRequest(RouterError):
    status, type = 400, "invalid_request_error"


class Unauthorized(RouterError):
    status, type = 401, "authentication_error"


class NotFound(RouterError):
    status, type = 404, "not_found_error"


class ModelNotFound(NotFound):
    def __init__(self, model: str) -> None:
        super().__init__(f"The model '{model}' does not exist or no worker serves it", code="model_not_found")


class Conflict(RouterError):
    status, type = 409, "conflict_error"


class PayloadTooLarge(RouterError):
    status, type = 413, "invalid_request_error"


class RequestTimeout(RouterError):
    """The client stopped sending its body (``--body-timeout``)."""

    status, type = 408, "invalid_request_error"

    reason = "body_timeout"
    """How ``smg_requests_rejected_total`` counts it: ``body_timeout`` (a gap), ``body_too_slow`` (the minimum rate)."""

    @classmethod
    def of_body(cls, e: wire.BodyTimeout) -> RequestTimeout:
        slow = e.reason == "body_too_slow"
        error = cls(str(e), code="request_body_too_slow" if slow else "request_body_timeout")
        error.reason = e.reason
        return error


class NotSupported(RouterError):
    """An endpoint the router has but cannot serve in its current mode (a generation endpoint in PD mode)."""

    status, type = 501, "not_implemented_error"


NO_WORKER_RETRY_AFTER = 5
"""The ``Retry-After`` (seconds) of every 503 for want of a routable worker: about the time a worker scaled from zero
to one (KEDA) needs to be seen by a scaler, while a client that comes back sooner waits in the hold again
(``--hold-when-empty``) rather than hammering."""


class NoWorkerAvailable(RouterError):
    """No routable worker for the request's model (none at all, none in time, or the hold is full): retry later."""

    status, type = 503, "service_unavailable"
    retry_after = NO_WORKER_RETRY_AFTER

    def response(self) -> wire.Response:
        response = super().response()
        response.headers["Retry-After"] = str(self.retry_after)
        return response


class UpstreamError(RouterError):
    status, type = 502, "upstream_error"


class UpstreamTimeout(RouterError):
    status, type = 504, "upstream_timeout"


def error_response(status: int, message: str, *, type: str, code: str | None = None) -> wire.Response:
    body = orjson.dumps({"error": {"message": message, "type": type, "code": code or type}})
    return wire.Response(status=status, body=body, content_type="application/json")
