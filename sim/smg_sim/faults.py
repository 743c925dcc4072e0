"""Fault injection for generation requests: simulated errors, hangs and crashes.

Consulted by the HTTP handlers (`generation`) once per generation request, before any work, so tests of
the router can exercise retries, timeouts and health-based eviction against workers that misbehave
the way real ones do.
"""

from __future__ import annotations

import enum
import random

from .config import SimConfig


class Fault(enum.Enum):
    """What to do with one generation request."""

    NONE = "none"
    ERROR = "error"
    HANG = "hang"
    CRASH = "crash"


class FaultInjector:
    """Draws a fault per generation request from the configured rates (seeded, so reproducible)."""

    def __init__(
        self,
        *,
        error_rate: float = 0.0,
        hang_rate: float = 0.0,
        crash_after: int | None = None,
        seed: int | None = None,
    ) -> None:
        self._error_rate = error_rate
        self._hang_rate = hang_rate
        self._crash_after = crash_after
        self._rng = random.Random(seed)
        self.requests_seen = 0

    @classmethod
    def from_config(cls, config: SimConfig) -> FaultInjector:
        return cls(
            error_rate=config.error_rate,
            hang_rate=config.hang_rate,
            crash_after=config.crash_after,
            seed=config.seed,
        )

    def next_fault(self) -> Fault:
        """Count one generation request and decide its fate."""
        self.requests_seen += 1
        if self._crash_after is not None and self.requests_seen >= self._crash_after:
            return Fault.CRASH
        if not (self._error_rate or self._hang_rate):
            return Fault.NONE
        draw = self._rng.random()
        if draw < self._error_rate:
            return Fault.ERROR
        if draw < self._error_rate + self._hang_rate:
            return Fault.HANG
        return Fault.NONE
