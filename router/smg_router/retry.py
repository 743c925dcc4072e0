"""The one retry loop, for every path that may try another worker: ``proxy``'s requests, ``pd.vllm``'s prefill leg.

The rule: at most 1 + ``--max-retries`` attempts, each on a worker this request has not tried yet, each retry
after a backoff (``RetrySettings.backoff``) and counted in ``smg_retries_total{endpoint,outcome="retried"}``.  While
nothing reached the client, an attempt is retried when its worker cannot be reached, answers a 5xx or a 429 (a 429
only while another worker is left: with none, the client's own back-off is the remedy, so the 429 is passed on),
or broke its answer off before the path used any of it (``TryElsewhere``).  Three things stop a retry:

- A timeout once the request was written to the worker (``send`` raised ``TimeoutError``: the first-byte or the
  total bound): the worker may still be generating it, and running it again elsewhere would double its cost and
  its effects.  The answer is a 504, unless the client said a second run is harmless (an ``Idempotency-Key``
  header, ``IDEMPOTENCY_HEADER``).
- The retry budget (``RetryBudget``): retries may be at most ``--retry-budget-ratio`` of the requests of the last
  ten seconds (or ``--retry-budget-min``, whichever is more), so a fleet that answers every request with a 429 or
  a 5xx sees about 1.2 attempts per request, not three.  A retry refused is counted in
  ``smg_retries_total{outcome="budget_exhausted"}`` and the failure so far is the answer (a 429 or 5xx passed on).
- A multipart upload that went partly to a worker cannot be sent again, so its first failure is the last.

The last attempt's answer is passed on whatever its status; when the attempts or the workers run out after
failures, the path's ``gave_up`` error says why.

A path gives only what differs: what one attempt sends (``send``), what it makes of the answer it keeps (``use``)
and the wording of its errors.  Choosing the worker, waiting behind a burst's first prefill (``coordination.Holds``)
and the guard's outcome are done here, once.
"""

from __future__ import annotations

import asyncio
import logging
import time
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

IDEMPOTENCY_HEADER = "idempotency-key"
"""The client header that makes a timed-out request retryable on another worker (the IETF's ``Idempotency-Key``,
which OpenAI's and Stripe's clients send): the client says running it twice is harmless."""
BUDGET_SLOTS = 10
"""The retry budget's window, in one-second slots."""


class RetryBudget:
    """Retries may be at most ``ratio`` of the requests of the last ``BUDGET_SLOTS`` seconds, or ``minimum``,
    whichever is more (Envoy's retry budget, counted over a window rather than over the requests in flight, so
    that a fleet answering at once is bounded too).  Two counters a request: one slot index, one increment."""

    __slots__ = ("_clock", "_requests", "_retries", "_slot", "minimum", "ratio")

    def __init__(self, *, ratio: float, minimum: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ratio = ratio
        self.minimum = minimum
        self._clock = clock
        self._requests = [0] * BUDGET_SLOTS
        self._retries = [0] * BUDGET_SLOTS
        self._slot = int(clock())

    def _advance(self, now: int) -> None:
        """Empty the slots that aged out of the window by second ``now``."""
        for s in range(max(self._slot + 1, now - BUDGET_SLOTS + 1), now + 1):
            self._requests[s % BUDGET_SLOTS] = self._retries[s % BUDGET_SLOTS] = 0
        self._slot = now

    def request(self) -> None:
        """A request starts its first attempt (on every request: one clock read, one increment)."""
        now = int(self._clock())
        if now != self._slot:
            self._advance(now)
        self._requests[now % BUDGET_SLOTS] += 1

    def take(self) -> bool:
        """Whether one more retry fits in the budget (it is then counted in)."""
        now = int(self._clock())
        if now != self._slot:
            self._advance(now)
        slot = now % BUDGET_SLOTS
        if sum(self._retries) >= max(self.minimum, self.ratio * sum(self._requests)):
            return False
        self._retries[slot] += 1
        return True


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
        self.budget = RetryBudget(ratio=settings.budget_ratio, minimum=settings.budget_min)

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
        self.budget.request()
        for n in range(retries + 1):
            if n:
                self._metrics.retries.labels(req.endpoint, "retried").inc()
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
            paid = False  # a retry of this attempt was already taken from the budget
            with guard:
                if guard.behind is not None:  # behind a burst's first prefill
                    await self._attempts.holds.wait(guard, req.model, role)
                try:
                    resp = await send(guard)
                except (UpstreamConnectError, TimeoutError) as e:
                    guard.failed()
                    last = unreachable(guard, e)
                    if isinstance(e, TimeoutError) and IDEMPOTENCY_HEADER not in req.headers:
                        log.warning(
                            "attempt %d at %s timed out after the request was written: not retried (no %s header)",
                            n + 1,
                            guard.worker.url,
                            IDEMPOTENCY_HEADER,
                        )
                        break  # the worker may still be running it: never run it twice unasked
                else:
                    passes = self._passes_on(resp.status, role, req, tried, last_try=n == retries)
                    if not passes and not (paid := self._take(req)):
                        passes = True  # over the budget: the worker's answer is the client's
                    if passes:
                        try:
                            return await use(guard, resp)
                        except TryElsewhere as e:
                            guard.failed()
                            last = e.error
                            paid = False
                    else:
                        guard.answered(resp.status)
                        last = await set_aside(guard, resp)
                log.warning("attempt %d of %d at %s failed: %s", n + 1, retries + 1, guard.worker.url, describe(last))
            if not _replayable(req):
                break  # the upload went partly to that worker: it cannot be sent again
            if n < retries and not paid and not self._take(req):
                break  # over the budget: the failure so far is the answer
        assert last is not None  # the loop ends early only after a failure
        raise gave_up(last, len(tried))

    def _take(self, req: ProxyRequest) -> bool:
        """A retry from the budget, or False (counted as ``budget_exhausted``)."""
        if self.budget.take():
            return True
        self._metrics.retries.labels(req.endpoint, "budget_exhausted").inc()
        return False

    def _passes_on(self, status: int, role: str, req: ProxyRequest, tried: Collection[str], *, last_try: bool) -> bool:
        """Whether an answer goes to the path rather than to another worker: not a 5xx or 429, the last attempt's,
        an upload's that cannot be replayed, or a 429 when no other worker is left."""
        if not is_retryable(status) or last_try or not _replayable(req):
            return True
        return status == 429 and not self._attempts.any_left(role, req, tried)


def _replayable(req: ProxyRequest) -> bool:
    return req.upload is None or req.upload.replayable
