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

    After ``cooldown`` seconds an open breaker reads as half-open: it admits exactly one trial request (the
    attempt that ``acquire``s it; the worker is unroutable again while the trial runs), whose outcome closes
    it (success) or opens it for another cooldown (failure).  A trial that ends with no outcome (the client
    left, a 429) is ``release``d and the next request becomes the trial.
    """

    __slots__ = ("_clock", "_failures", "_opened_at", "_trial", "cooldown", "failure_threshold")

    def __init__(self, *, failure_threshold: int, cooldown: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.failure_threshold = failure_threshold
        self.cooldown = cooldown
        self._clock = clock
        self._failures = 0
        self._opened_at: float | None = None
        self._trial = False

    @property
    def state(self) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        if self._clock() - self._opened_at >= self.cooldown:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def allows(self) -> bool:
        """Closed, or half-open with no trial running."""
        if self._opened_at is None:
            return True
        return not self._trial and self._clock() - self._opened_at >= self.cooldown

    def acquire(self) -> bool:
        """An attempt starts; whether it is the half-open breaker's one trial."""
        if self._opened_at is None or self._trial:
            return False
        self._trial = True
        return True

    def release(self) -> None:
        """The trial ended without an outcome: a half-open breaker admits the next one."""
        self._trial = False

    def record_success(self) -> None:
        self._failures = 0
        self._opened_at = None
        self._trial = False

    def record_failure(self) -> None:
        self._failures += 1
        if self._opened_at is not None or self._failures >= self.failure_threshold:
            self._opened_at = self._clock()
        self._trial = False
