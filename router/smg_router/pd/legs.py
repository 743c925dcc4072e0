"""One leg of a PD request: send the body to the chosen worker and get its answer's head, or a 502 naming it.

Shared by both PD modes (``bootstrap``, ``vllm``): a connect error, a timeout or an answer of 5xx, 408 or 429 is
an ``UpstreamError`` whose code says which leg failed (``prefill_failed``, ``decode_failed``), with the
worker's URL and the head of its error body in the message.  Any other 4xx is the engine refusing the request
itself (a bad parameter, a prompt too long): ``Refused``, whose answer the dispatcher passes to the client as the
engine wrote it, as the regular path does.  The attempt's guard learns the outcome here.
"""

from __future__ import annotations

from collections.abc import Mapping

from smg_router.attempt import AttemptGuard
from smg_router.errors import UpstreamError
from smg_router.retry import describe
from smg_router.upstream import Upstream, UpstreamConnectError, UpstreamResponse

ERROR_DETAIL_BYTES = 300
"""How much of a worker's error body the 502 quotes."""


BUSY = frozenset({408, 429})
"""Answers of 400 and above that say the worker could not take the request now, not that the request is wrong."""


class Refused(Exception):
    """A leg's engine refused the request itself (a 4xx other than ``BUSY``): its answer goes to the client."""

    def __init__(self, guard: AttemptGuard, resp: UpstreamResponse) -> None:
        super().__init__(f"worker {guard.worker.id} answered {resp.status}")
        self.guard = guard
        self.resp = resp


def refused(status: int) -> bool:
    return 400 <= status < 500 and status not in BUSY


async def send(
    upstream: Upstream, guard: AttemptGuard, role: str, path: str, body: bytes, headers: Mapping[str, str]
) -> UpstreamResponse:
    """POST ``body`` to the guard's worker; its response when the status is below 400, ``Refused`` for the engine's
    own 4xx (the response unread), else UpstreamError."""
    resp = await post(upstream, guard, role, path, body, headers)
    if refused(resp.status):
        raise Refused(guard, resp)
    if resp.status >= 400:
        raise await failed_answer(guard, role, resp)
    return resp


async def post(
    upstream: Upstream, guard: AttemptGuard, role: str, path: str, body: bytes, headers: Mapping[str, str]
) -> UpstreamResponse:
    """POST ``body`` to the guard's worker, whatever its status; UpstreamError when it cannot be reached."""
    try:
        return await upstream.post(guard.worker.url + path, body, headers)
    except (UpstreamConnectError, TimeoutError) as e:
        guard.failed()
        raise unreachable(guard, role, e) from None


def unreachable(guard: AttemptGuard, role: str, e: Exception) -> UpstreamError:
    """The 502 for a worker that could not be reached or timed out, naming it."""
    return UpstreamError(f"{role} worker {guard.worker.id} failed: {describe(e)}", code=f"{role}_failed")


async def failed_answer(guard: AttemptGuard, role: str, resp: UpstreamResponse) -> UpstreamError:
    """The 502 for an answer of 400 and above (read and closed here), naming the worker and quoting it."""
    guard.answered(resp.status)
    try:
        detail = (await resp.read())[:ERROR_DETAIL_BYTES].decode(errors="replace")
    except (OSError, TimeoutError) as e:
        detail = f"(its body broke off: {e})"
    finally:
        resp.abort()
    return UpstreamError(f"{role} worker {guard.worker.id} answered {resp.status}: {detail}", code=f"{role}_failed")
