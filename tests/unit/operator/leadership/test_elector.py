"""leadership.Elector against an in-memory Lease, on virtual time: when a standby takes the lease, and when
the holder stops leading (any failure, or no renewal within the renew deadline)."""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Callable
from typing import TypeVar

import pytest
import urllib3.exceptions
from smg_operator.leadership import Elector, Gate, LeaseRecord, LeaseTiming, StoredLease

T = TypeVar("T")
TIMING = LeaseTiming(lease_duration=6.0, renew_deadline=4.0, retry_period=1.0)
WALL = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


class FakeLease:
    """One Lease with resourceVersion semantics; ``fault`` makes every call raise, ``hang`` never answer."""

    def __init__(self) -> None:
        self.stored: StoredLease | None = None
        self.writes = 0
        self.fault: Exception | None = None
        self.hang = False

    def get(self) -> StoredLease | None:
        return self.stored

    def create(self, record: LeaseRecord) -> bool:
        if self.stored is not None:
            return False
        self._put(record)
        return True

    def update(self, record: LeaseRecord, *, version: str) -> bool:
        if self.stored is None or self.stored.version != version:
            return False
        self._put(record)
        return True

    def _put(self, record: LeaseRecord) -> None:
        self.writes += 1
        self.stored = StoredLease(record, str(self.writes))

    def hold(self, holder: str | None, *, renewed: datetime.datetime = WALL) -> None:
        """Another replica writes the record (a renewal when ``holder`` is the same)."""
        self._put(LeaseRecord(holder=holder, duration=6, acquire_time=WALL, renew_time=renewed))

    async def run(self, fn: Callable[[], T]) -> T:
        """The elector's ``run_sync``: a round trip of 10 ms, or none at all when cut off."""
        await asyncio.sleep(0.01)
        if self.hang:
            await asyncio.sleep(10_000)
        if self.fault is not None:
            raise self.fault
        return fn()


def elector(lease: FakeLease, identity: str = "me") -> Elector:
    loop = asyncio.get_running_loop()
    return Elector(store=lease, identity=identity, timing=TIMING, clock=loop.time, run_sync=lease.run)


def now() -> float:
    return asyncio.get_running_loop().time()


async def at(t: float) -> None:
    await asyncio.sleep(max(0.0, t - now()))


# -- a standby -----------------------------------------------------------------------------------------
async def test_a_standby_takes_a_silent_lease_a_lease_duration_after_it_first_saw_it_whatever_renew_time_says() -> None:
    lease = FakeLease()
    # the holder's renewTime is an hour behind this replica's wall clock (skew, or a dead holder): not a reason
    lease.hold("other", renewed=datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=1))
    e = elector(lease)
    seen = now()
    assert not await e.try_acquire_or_renew()
    await at(seen + 5.9)
    assert not await e.try_acquire_or_renew()
    await at(seen + 6.1)
    assert await e.try_acquire_or_renew()
    assert lease.stored is not None and lease.stored.record.holder == "me"
    assert lease.stored.record.transitions == 1


async def test_a_standby_never_takes_a_lease_whose_record_keeps_changing_even_with_an_old_renew_time() -> None:
    lease = FakeLease()
    e = elector(lease)
    old = datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC)  # the holder's clock is far behind ours
    for i in range(40):  # 40 s: over six lease durations
        lease.hold("other", renewed=old + datetime.timedelta(seconds=i))
        assert not await e.try_acquire_or_renew(), i
        await asyncio.sleep(1.0)


async def test_a_released_or_absent_lease_is_taken_at_once() -> None:
    lease = FakeLease()
    assert await elector(lease, "a").try_acquire_or_renew()  # absent: created
    lease.hold(None)  # released
    assert await elector(lease, "b").try_acquire_or_renew()
    assert lease.stored is not None and lease.stored.record.holder == "b"


async def test_the_holder_keeps_its_acquire_time_and_two_standbys_racing_get_one_winner() -> None:
    lease = FakeLease()
    e = elector(lease)
    assert await e.try_acquire_or_renew()
    assert lease.stored is not None
    acquired = lease.stored.record.acquire_time
    assert await e.try_acquire_or_renew()
    assert lease.stored.record.acquire_time == acquired and lease.stored.record.transitions == 0
    lease.hold(None)
    a, b = elector(lease, "a"), elector(lease, "b")
    assert sorted(await asyncio.gather(a.try_acquire_or_renew(), b.try_acquire_or_renew())) == [False, True]


async def test_acquire_rides_out_api_errors_and_polls_every_retry_period() -> None:
    lease = FakeLease()
    lease.hold("other")
    lease.fault = RuntimeError("boom")
    e = elector(lease)
    task = asyncio.create_task(e.acquire())
    await asyncio.sleep(3)
    lease.fault = None
    await asyncio.wait_for(task, timeout=20)
    assert e.leading
    assert 3 + 6 <= now() <= 3 + 6 + TIMING.retry_period + 0.1  # first seen fault-free at ~3 s, then a duration


async def test_a_standby_tries_again_right_when_the_lease_it_watches_expires_not_at_its_next_retry() -> None:
    lease = FakeLease()
    lease.hold("other")
    timing = LeaseTiming(lease_duration=6.0, renew_deadline=5.0, retry_period=4.0)  # polls at 0, 4, 8, ...
    loop = asyncio.get_running_loop()
    e = Elector(store=lease, identity="me", timing=timing, clock=loop.time, run_sync=lease.run)
    seen = now()
    await asyncio.wait_for(e.acquire(), timeout=20)
    assert seen + 6.0 < now() <= seen + 6.0 + 0.05  # not at seen + 8, the next retry tick


# -- the holder ----------------------------------------------------------------------------------------
async def leading(lease: FakeLease) -> tuple[Elector, Gate, asyncio.Task[None], list[tuple[float, str]]]:
    e = elector(lease)
    await e.acquire()
    gate = Gate()
    lost: list[tuple[float, str]] = []

    def on_lost(reason: str) -> None:
        gate.close(reason)
        lost.append((now(), reason))

    return e, gate, asyncio.create_task(e.keep(on_lost=on_lost)), lost


async def test_the_holder_keeps_leading_while_renewals_succeed() -> None:
    lease = FakeLease()
    e, gate, task, lost = await leading(lease)
    writes = lease.writes
    await asyncio.sleep(60)
    assert not lost and gate.is_open and e.leading
    assert lease.writes - writes >= 55  # one renewal per retry period
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize(
    "fault",
    [
        urllib3.exceptions.MaxRetryError(None, "/apis/coordination.k8s.io", "connection refused"),  # not an OSError
        RuntimeError("a bug"),
        ValueError("bad answer"),
    ],
    ids=type,
)
async def test_any_exception_in_a_renewal_ends_leadership_at_that_renewal(fault: Exception) -> None:
    lease = FakeLease()
    e, gate, task, lost = await leading(lease)
    await asyncio.sleep(5.5)
    failed_at = now()
    lease.fault = fault
    await asyncio.wait_for(task, timeout=10)
    assert len(lost) == 1 and type(fault).__name__ in lost[0][1]
    assert lost[0][0] - failed_at <= TIMING.retry_period + 0.05  # the next renewal, not the deadline
    assert not gate.is_open and not e.leading


async def test_a_renewal_that_hangs_ends_leadership_at_the_renew_deadline_from_the_last_good_renewal_start() -> None:
    lease = FakeLease()
    e, gate, task, lost = await leading(lease)
    await asyncio.sleep(3.3)
    lease.hang = True  # cut off: calls neither answer nor fail
    last_good = e.renewed_at
    assert last_good is not None
    await asyncio.wait_for(task, timeout=30)
    assert len(lost) == 1 and "deadline" in lost[0][1]
    assert lost[0][0] == pytest.approx(last_good + TIMING.renew_deadline, abs=1e-6)
    assert not gate.is_open


async def test_slow_renewals_keep_leadership_while_each_succeeds_within_the_deadline_and_no_longer() -> None:
    lease = FakeLease()
    e, _gate, task, lost = await leading(lease)
    delay = 0.25  # a renewal (two calls) takes ~0.5 s: well within the 4 s deadline

    async def slow(fn: Callable[[], T]) -> T:
        await asyncio.sleep(delay)
        return await lease.run(fn)

    e._run = slow  # the elector's run_sync, slowed down
    await asyncio.sleep(30)
    assert not lost
    delay = 2.5  # ~5 s per renewal: past the deadline
    await asyncio.wait_for(task, timeout=30)
    assert e.renewed_at is not None and len(lost) == 1
    assert lost[0][0] == pytest.approx(e.renewed_at + TIMING.renew_deadline, abs=1e-6)


async def test_another_holder_or_a_conflicting_write_ends_leadership() -> None:
    lease = FakeLease()
    _e, gate, task, lost = await leading(lease)
    await asyncio.sleep(2.5)
    lease.hold("usurper")  # written behind our back: our next read sees another holder
    await asyncio.wait_for(task, timeout=10)
    assert lost and "another replica" in lost[0][1] and not gate.is_open


async def test_release_frees_only_our_own_lease() -> None:
    lease = FakeLease()
    e = elector(lease)
    assert await e.try_acquire_or_renew()
    assert e.release()
    assert lease.stored is not None and lease.stored.record.holder is None
    lease.hold("other")
    assert not e.release()
    assert lease.stored.record.holder == "other"


# -- the timings ---------------------------------------------------------------------------------------
def test_the_default_timings_are_client_gos_and_satisfy_the_invariant_with_a_5s_call_timeout() -> None:
    t = LeaseTiming()
    assert (t.lease_duration, t.renew_deadline, t.retry_period) == (15, 10, 2)
    assert t.problems(call_timeout=5) == []


@pytest.mark.parametrize(
    ("timing", "call_timeout", "complaint"),
    [
        (LeaseTiming(lease_duration=10, renew_deadline=10, retry_period=2), 0.1, "shorter than the lease"),
        (LeaseTiming(lease_duration=15, renew_deadline=10, retry_period=2), 5.5, "must not exceed"),
        (LeaseTiming(lease_duration=15, renew_deadline=4, retry_period=4), 1, "retry period"),
    ],
)
def test_unsound_timings_are_named(timing: LeaseTiming, call_timeout: float, complaint: str) -> None:
    assert any(complaint in p for p in timing.problems(call_timeout=call_timeout))
