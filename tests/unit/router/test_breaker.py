"""The circuit breaker's state machine on an injected clock: closed → open → half-open → closed or open."""

from __future__ import annotations

from smg_router.workers.breaker import BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _breaker(clock: Clock) -> CircuitBreaker:
    return CircuitBreaker(failure_threshold=3, cooldown=10.0, clock=clock)


def test_opens_after_the_threshold_of_consecutive_failures() -> None:
    clock = Clock()
    b = _breaker(clock)
    b.record_failure()
    b.record_failure()
    assert b.state is BreakerState.CLOSED and b.allows()
    b.record_failure()
    assert b.state is BreakerState.OPEN and not b.allows()


def test_a_success_resets_the_count_of_failures() -> None:
    b = _breaker(Clock())
    b.record_failure()
    b.record_failure()
    b.record_success()
    b.record_failure()
    b.record_failure()
    assert b.state is BreakerState.CLOSED


def test_half_open_after_the_cooldown_then_a_success_closes_it() -> None:
    clock = Clock()
    b = _breaker(clock)
    for _ in range(3):
        b.record_failure()
    clock.now += 9.99
    assert b.state is BreakerState.OPEN and not b.allows()
    clock.now += 0.01
    assert b.state is BreakerState.HALF_OPEN and b.allows()
    b.record_success()
    assert b.state is BreakerState.CLOSED and b.allows()
    b.record_failure()  # the count started again from zero
    assert b.state is BreakerState.CLOSED


def test_a_failed_trial_in_half_open_opens_it_for_another_cooldown() -> None:
    clock = Clock()
    b = _breaker(clock)
    for _ in range(3):
        b.record_failure()
    clock.now += 10.0
    assert b.state is BreakerState.HALF_OPEN
    b.record_failure()  # one failure is enough in half-open
    assert b.state is BreakerState.OPEN and not b.allows()
    clock.now += 9.0
    assert b.state is BreakerState.OPEN
    clock.now += 1.0
    assert b.state is BreakerState.HALF_OPEN


def test_half_open_admits_exactly_one_trial_at_a_time() -> None:
    clock = Clock()
    b = _breaker(clock)
    for _ in range(3):
        b.record_failure()
    clock.now += 10.0
    assert b.allows()
    assert b.acquire() is True  # the trial
    assert not b.allows() and b.state is BreakerState.HALF_OPEN  # nobody else while it runs
    assert b.acquire() is False
    b.release()  # the trial ended without an outcome (client left, 429): the next request may try
    assert b.allows()
    assert b.acquire() is True
    b.record_success()
    assert b.state is BreakerState.CLOSED and b.allows() and b.acquire() is False


def test_a_closed_breaker_hands_out_no_trial() -> None:
    b = _breaker(Clock())
    assert b.acquire() is False and b.allows()
