"""The one retry loop, for every path that may try another worker: ``proxy``'s requests, ``pd.vllm``'s prefill leg.

The rule: at most 1 + ``--max-retries`` attempts, each on a worker this request has not tried yet, each retry
after a backoff (``RetrySettings.backoff``) and counted in ``smg_retries_total{endpoint}``.  While nothing reached
the client, an attempt is retried when its worker cannot be reached or times out, answers a 5xx or a 429 (a 429
only while another worker is left: with none, the client's own back-off is the remedy, so the 429 is passed on),
or broke its answer off before the path used any of it (``TryElsewhere``).  A multipart upload that went partly
to a worker cannot be sent again, so its first failure is the last.  The last attempt's answer is passed on
whatever its status; when the attempts or the workers run out after failures, the path's ``gave_up`` error says
why.

A path gives only what differs: what one attempt sends (``send``), what it makes of the answer it keeps (``use``)
and the wording of its errors.  Choosing the worker, waiting behind a burst's first prefill (``coordination.Holds``)
and the guard's outcome are done here, once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection
from typing import TypeVar

from smg_router.attempt import AttemptGuard, Attempts, is_retryable
from smg_router.errors import NoWorkerAvailable, UpstreamError, UpstreamTimeout
from smg_router.metrics import Metrics
from smg_router.request import ProxyRequest
from smg_router.settings import RetrySettings
from smg_router.upstream import UpstreamConnectError, UpstreamResponse

log = logging.getLogger(__name__)

T = TypeVar("T")


class TryElsewhere(Exception):
    """Raised by a path's ``use``: the worker broke its answer off before any of it reached the client."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error
        """What the client is told if no other attempt gets through."""


def describe(e: BaseException) -> str:
    """An exception for a message: a TimeoutError's text is empty."""
    return str(e) or type(e).__name__


def as_raised(guard: AttemptGuard, error: Exception) -> Exception:
    """The regular path's record of a worker it could not reach: the error itself (a timeout stays a 504)."""
    return error


async def released(guard: AttemptGuard, resp: UpstreamResponse) -> Exception:
    """The regular path's retried answer: dropped unread, its connection freed."""
    resp.release()
    return UpstreamError(f"worker answered {resp.status}")


def unavailable(last: Exception, tried: int) -> Exception:
    """The regular path's error once every attempt failed: a 504 when the last one timed out, else a 502."""
    if isinstance(last, TimeoutError):
        return UpstreamTimeout(f"no worker answered in time after {tried} attempt(s)")
    return UpstreamError(
        f"no worker could serve the request after {tried} attempt(s): {last}", code="upstream_unavailable"
    )


class RetryLoop:
    """Attempts at one worker after another, by the rule of this module; one per router, shared by its paths."""

    def __init__(
        self,
        *,
        attempts: Attempts,
        settings: RetrySettings,
        metrics: Metrics,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._attempts = attempts
        self._settings = settings
        self._metrics = metrics
        self._sleep = sleep
        """The backoff's wait (a test's fake clock can stand in)."""

    async def run(
        self,
        role: str,
        req: ProxyRequest,
        *,
        send: Callable[[AttemptGuard], Awaitable[UpstreamResponse]],
        use: Callable[[AttemptGuard, UpstreamResponse], Awaitable[T]],
        first: AttemptGuard | None = None,
        by_load: bool = False,
        streamed: bool | None = None,
        unreachable: Callable[[AttemptGuard, Exception], Exception] = as_raised,
        set_aside: Callable[[AttemptGuard, UpstreamResponse], Awaitable[Exception]] = released,
        gave_up: Callable[[Exception, int], Exception] = unavailable,
    ) -> T:
        """What ``use`` makes of the answer kept.  ``send`` raises ``UpstreamConnectError`` or ``TimeoutError``
        when the worker cannot be reached; ``unreachable`` and ``set_aside`` (which frees a retried answer) turn a
        failure into the error the client would get; ``gave_up(last error, attempts)`` is the error raised when
        they run out.  ``first``: the first attempt, opened by the caller (the vLLM path opens it before its
        decode attempt); ``by_load`` and ``streamed`` go to ``Attempts.open``; no worker at all is its 503."""
        retries = self._settings.max_retries
        tried: set[str] = set()
        last: Exception | None = None
        for n in range(retries + 1):
            if n:
                self._metrics.retries.labels(req.endpoint).inc()
                await self._sleep(self._settings.backoff(n))
            try:
                if first is not None and not n:
                    guard = first
                else:
                    guard = self._attempts.open(role, req, tried, by_load=by_load, streamed=streamed)
            except NoWorkerAvailable:
                if last is None:
                    raise
                break  # no other worker: the failure so far is the answer
            tried.add(guard.worker.id)
            with guard:
                if guard.behind is not None:  # behind a burst's first prefill
                    await self._attempts.holds.wait(guard, req.model, role)
                try:
                    resp = await send(guard)
                except (UpstreamConnectError, TimeoutError) as e:
                    guard.failed()
                    last = unreachable(guard, e)
                else:
                    if self._passes_on(resp.status, role, req, tried, last_try=n == retries):
                        try:
                            return await use(guard, resp)
                        except TryElsewhere as e:
                            guard.failed()
                            last = e.error
                    else:
                        guard.answered(resp.status)
                        last = await set_aside(guard, resp)
                log.warning("attempt %d of %d at %s failed: %s", n + 1, retries + 1, guard.worker.url, describe(last))
            if not _replayable(req):
                break  # the upload went partly to that worker: it cannot be sent again
        assert last is not None  # the loop ends early only after a failure
        raise gave_up(last, len(tried))

    def _passes_on(self, status: int, role: str, req: ProxyRequest, tried: Collection[str], *, last_try: bool) -> bool:
        """Whether an answer goes to the path rather than to another worker: not a 5xx or 429, the last attempt's,
        an upload's that cannot be replayed, or a 429 when no other worker is left."""
        if not is_retryable(status) or last_try or not _replayable(req):
            return True
        return status == 429 and not self._attempts.any_left(role, req, tried)


def _replayable(req: ProxyRequest) -> bool:
    return req.upload is None or req.upload.replayable
