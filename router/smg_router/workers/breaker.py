"""Per-worker circuit breaker: closed → open after repeated failures → half-open trial → closed.

What counts as a failure is decided once, in ``attempt.AttemptGuard``; the breaker only counts.  The clock is
injected so the state machine is unit-tested without sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Counts consecutive failures of real requests; an open breaker makes the worker unroutable.

    After ``cooldown`` seconds an open breaker reads as half-open: the worker is routable again, and the
    next outcome closes it (success) or opens it for another cooldown (failure).
    """

    __slots__ = ("_clock", "_failures", "_opened_at", "cooldown", "failure_threshold")

    def __init__(self, *, failure_threshold: int, cooldown: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.failure_threshold = failure_threshold
        self.cooldown = cooldown
        self._clock = clock
        self._failures = 0
        self._opened_at: float | None = None

    @property
    def state(self) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        if self._clock() - self._opened_at >= self.cooldown:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def allows(self) -> bool:
        return self._opened_at is None or self._clock() - self._opened_at >= self.cooldown

    def record_success(self) -> None:
        self._failures = 0
        self._opened_at = None

    def record_failure(self) -> None:
        self._failures += 1
        half_open = self._opened_at is not None
        if half_open or self._failures >= self.failure_threshold:
            self._opened_at = self._clock()
