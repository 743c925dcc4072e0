"""Leader election with client-go's semantics, and the gate every write of the operator goes through.

Timing (``LeaseTiming``): the holder renews every ``retry_period``; if no renewal succeeded within
``renew_deadline`` of the start of the last successful one, or any renewal fails in any way (an exception of
any type, a conflict, another holder), it stops leading at once: ``Elector.keep`` calls ``on_lost``, which
closes the ``Gate`` (no router call, status patch or Event after that) and stops kopf.

A standby judges expiry by its own monotonic clock: the lease is expired when the record (holder, renew time,
...) has not changed for ``lease_duration`` since *this* replica last saw it change.  The holder's
``renewTime`` is never compared with the local wall clock, so clock skew between nodes cannot make a standby
take a lease early.

Why that cannot split: the holder's last possible renewal started at ``t``; the standby saw that record no
earlier than ``t``, so it takes over no earlier than ``t + lease_duration``.  The holder stopped calling at
``t + renew_deadline`` and its calls in flight end within one call timeout after that, so
``renew_deadline + call timeout <= lease_duration`` (enforced by the settings) leaves no overlap.  Router calls
in flight are also cancelled when the gate closes.

No Kubernetes client here: the API side is the ``LeaseStore`` protocol (``k8s.LeaseStore`` is the real one),
so the election is unit-tested with a fake store and a fake clock.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["Elector", "Gate", "GateClosed", "LeaseRecord", "LeaseStore", "LeaseTiming", "StoredLease"]


# -- the gate ------------------------------------------------------------------------------------------
class GateClosed(Exception):
    """This replica no longer leads: the write was not made."""


class Gate:
    """Open while this replica may write (it leads, or election is off); closed for good once leadership ends.

    ``run`` refuses a call when closed and cancels the calls it runs when the gate closes, so a slow router
    call (a drain waits up to its timeout) cannot outlive the lease."""

    def __init__(self, *, open: bool = True) -> None:
        self._open = open
        self._reason = ""
        self._inflight: set[asyncio.Future[Any]] = set()

    @property
    def is_open(self) -> bool:
        return self._open

    def open(self) -> None:
        self._open = True

    def close(self, reason: str) -> None:
        """Refuse every call from now on and cancel the ones in flight (synchronous: no await between the
        decision that leadership is over and the last call)."""
        if not self._open:
            return
        self._open, self._reason = False, reason
        for call in list(self._inflight):
            call.cancel()

    def check(self) -> None:
        if not self._open:
            raise GateClosed(f"not leading: {self._reason or 'leadership not held'}")

    async def run(self, call: Awaitable[T]) -> T:
        """Await ``call`` if the gate is open; GateClosed if it is closed or closes meanwhile."""
        try:
            self.check()
        except GateClosed:
            if asyncio.iscoroutine(call):
                call.close()  # never started: no "coroutine was never awaited" warning
            raise
        future = asyncio.ensure_future(call)
        self._inflight.add(future)
        try:
            return await future
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not self._open and not (task is not None and task.cancelling()):
                raise GateClosed(f"not leading: {self._reason}") from None
            raise
        finally:
            self._inflight.discard(future)


# -- the lease -----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseTiming:
    """client-go's three durations, in seconds."""

    lease_duration: float = 15.0
    """How long a standby waits after it last saw the record change before it takes the lease."""
    renew_deadline: float = 10.0
    """How long the holder keeps leading without a successful renewal (from the start of the last one)."""
    retry_period: float = 2.0
    """Between two renewals by the holder, and between two tries by a standby."""

    def problems(self, *, call_timeout: float) -> list[str]:
        """What is wrong with these durations for calls bounded by ``call_timeout`` (empty when sound)."""
        out = []
        if not 0 < self.retry_period < self.renew_deadline:
            out.append("the retry period must be positive and shorter than the renew deadline")
        if not self.renew_deadline < self.lease_duration:
            out.append("the renew deadline must be shorter than the lease duration")
        if self.renew_deadline + call_timeout > self.lease_duration:
            out.append(
                f"renew deadline + call timeout ({self.renew_deadline:g} + {call_timeout:g} s) must not exceed the"
                f" lease duration ({self.lease_duration:g} s): a call started just before the deadline could still"
                " land after a standby took over"
            )
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseRecord:
    """The spec of a coordination.k8s.io/v1 Lease."""

    holder: str | None
    duration: int | None
    acquire_time: datetime.datetime | None = None
    renew_time: datetime.datetime | None = None
    transitions: int = 0


@dataclass(frozen=True, slots=True)
class StoredLease:
    record: LeaseRecord
    version: str
    """metadata.resourceVersion: the update is conditional on it (optimistic concurrency)."""


class LeaseStore(Protocol):
    """The Lease on the API server; every call bounded by the request timeout, run in a worker thread."""

    def get(self) -> StoredLease | None: ...

    def create(self, record: LeaseRecord) -> bool:
        """False when someone else created it first (409)."""
        ...

    def update(self, record: LeaseRecord, *, version: str) -> bool:
        """False when the Lease changed since ``version`` was read (409)."""
        ...


class RunSync(Protocol):
    """Runs a blocking store call without blocking the loop (``asyncio.to_thread``; tests pass a fake)."""

    def __call__(self, fn: Callable[[], T], /) -> Awaitable[T]: ...


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class Elector:
    """Acquire, keep and give up one Lease.

    ``clock`` is monotonic seconds and must be the event loop's clock (``asyncio.timeout`` bounds a renewal by
    it; ``loop.time()`` is ``time.monotonic()`` by default); ``wall`` only stamps the record."""

    def __init__(
        self,
        *,
        store: LeaseStore,
        identity: str,
        timing: LeaseTiming,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime.datetime] = _utcnow,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        run_sync: RunSync = asyncio.to_thread,
    ) -> None:
        self.store, self.identity, self.timing = store, identity, timing
        self._clock, self._wall, self._sleep, self._run = clock, wall, sleep, run_sync
        self._observed: LeaseRecord | None = None
        self._observed_at = 0.0
        self.leading = False
        self.renewed_at: float | None = None
        """Monotonic time at which the last successful acquire or renew request started."""

    # one try ----------------------------------------------------------------------------------------
    async def try_acquire_or_renew(self) -> bool:
        """One round trip (a read, then a create or a conditional update): True when this replica holds the
        lease afterwards.  Raises whatever the store raises."""
        started = self._clock()
        now = self._wall()
        mine = LeaseRecord(
            holder=self.identity,
            duration=round(self.timing.lease_duration),
            acquire_time=now,
            renew_time=now,
            transitions=0,
        )
        current = await self._run(self.store.get)
        if current is None:
            if not await self._run(lambda: self.store.create(mine)):
                return False
            return self._hold(mine, started)
        record = current.record
        if record != self._observed:  # the record changed: (re)start the standby's expiry clock
            self._observed, self._observed_at = record, self._clock()
        held_by_other = bool(record.holder) and record.holder != self.identity
        if held_by_other and not self._expired(record):
            return False
        if record.holder == self.identity:
            mine = replace(mine, acquire_time=record.acquire_time, transitions=record.transitions)
        else:
            mine = replace(mine, transitions=record.transitions + 1)
        if not await self._run(lambda: self.store.update(mine, version=current.version)):
            return False
        return self._hold(mine, started)

    def _expired(self, record: LeaseRecord) -> bool:
        return self._clock() > self._expires_at(record)

    def _expires_at(self, record: LeaseRecord) -> float:
        duration = record.duration if record.duration and record.duration > 0 else self.timing.lease_duration
        return self._observed_at + duration

    def _next_try_in(self) -> float:
        """A standby tries again after a retry period, or right when the lease it watches expires if sooner:
        the takeover then comes a lease duration after the standby last saw the record change, not up to one
        retry period later."""
        if self._observed is None or not self._observed.holder or self._observed.holder == self.identity:
            return self.timing.retry_period
        until = self._expires_at(self._observed) - self._clock()
        return min(self.timing.retry_period, max(0.0, until) + 0.01)

    def _hold(self, record: LeaseRecord, started: float) -> bool:
        self._observed, self._observed_at = record, self._clock()
        self.renewed_at = started
        return True

    # the loops --------------------------------------------------------------------------------------
    async def acquire(self) -> None:
        """Try every retry period until this replica holds the lease; errors are logged and retried."""
        standing_by = False
        while True:
            try:
                if await self.try_acquire_or_renew():
                    break
            except Exception as e:  # a standby rides out any API trouble
                log.warning("leader election: could not read or take the lease: %s: %s", type(e).__name__, e)
            else:
                if not standing_by:  # said once: a standby polls for as long as the leader lives
                    log.info("leader election: the lease is held by another replica; %s stands by", self.identity)
                    standing_by = True
            await self._sleep(self._next_try_in())
        self.leading = True
        log.info("leader election: %s holds the lease", self.identity)

    async def keep(self, *, on_lost: Callable[[str], None]) -> None:
        """Renew every retry period while leading.  The first failure of any kind, or no success within the
        renew deadline, ends leadership: ``on_lost(reason)`` is called (synchronously) and this returns."""
        assert self.leading and self.renewed_at is not None, "keep() after acquire()"
        reason = ""
        while not reason:
            deadline = self.renewed_at + self.timing.renew_deadline
            await self._sleep(max(0.0, min(self.timing.retry_period, deadline - self._clock())))
            remaining = deadline - self._clock()
            if remaining <= 0:
                reason = f"no successful renewal within the renew deadline ({self.timing.renew_deadline:g} s)"
                break
            try:
                async with asyncio.timeout(remaining):
                    ok = await self.try_acquire_or_renew()
            except TimeoutError:
                reason = f"renewal still pending at the renew deadline ({self.timing.renew_deadline:g} s)"
            except Exception as e:  # any error: urllib3's MaxRetryError, a 500, a bug — not only ApiException
                reason = f"renewal failed: {type(e).__name__}: {e}"
            else:
                if not ok:
                    reason = "the lease is held by another replica, or changed under us"
        self.leading = False
        log.error("leader election: %s lost the lease: %s", self.identity, reason)
        on_lost(reason)

    def release(self) -> bool:
        """Give the lease up on a clean exit (sync: call it in a thread), so a standby takes over at once
        rather than after expiry.  True if it was ours and is now free."""
        current = self.store.get()
        if current is None or current.record.holder != self.identity:
            return False
        free = replace(current.record, holder=None, renew_time=None)
        return self.store.update(free, version=current.version)
