"""``waiting.WaitingRoom``: held requests are released by ``wake`` in arrival order, once every role they need is
routable; the queue is bounded; expiry and cancellation leave nothing behind in the queue or the gauge."""

from __future__ import annotations

import asyncio

import pytest
from smg_router.errors import NoWorkerAvailable
from smg_router.metrics import Metrics
from smg_router.settings import HoldSettings
from smg_router.waiting import WaitingRoom


class Fleet:
    """Which (role, model) pairs have a routable worker."""

    def __init__(self) -> None:
        self.up: set[tuple[str, str]] = set()

    def routable(self, role: str, model: str) -> bool:
        return (role, model) in self.up


def _room(fleet: Fleet, metrics: Metrics, *, seconds: float = 5.0, size: int = 256) -> WaitingRoom:
    hold = HoldSettings(seconds=seconds, queue_size=size)
    return WaitingRoom(settings=hold, metrics=metrics, routable=fleet.routable)


def _gauge(metrics: Metrics, model: str, role: str) -> float | None:
    return metrics.registry.get_sample_value("smg_model_requests_waiting", {"model": model, "role": role})


def _outcomes(metrics: Metrics, model: str, outcome: str) -> float | None:
    return metrics.registry.get_sample_value("smg_model_holds_total", {"model": model, "outcome": outcome})


async def test_a_routable_model_passes_without_waiting() -> None:
    fleet, metrics = Fleet(), Metrics()
    fleet.up.add(("regular", "m"))
    await asyncio.wait_for(_room(fleet, metrics).hold("m", ("regular",)), 0.1)
    assert _outcomes(metrics, "m", "sent") is None  # never held


async def test_held_requests_are_released_in_arrival_order_by_wake() -> None:
    fleet, metrics = Fleet(), Metrics()
    room = _room(fleet, metrics)
    order: list[int] = []

    async def request(n: int) -> None:
        await room.hold("m", ("regular",))
        order.append(n)

    tasks = [asyncio.create_task(request(n)) for n in range(5)]
    await asyncio.sleep(0.01)
    assert room.waiting("m") == 5 and _gauge(metrics, "m", "regular") == 5
    room.wake()  # nothing changed: nobody goes
    await asyncio.sleep(0.01)
    assert order == []
    fleet.up.add(("regular", "m"))
    room.wake()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4]
    assert room.waiting("m") == 0 and _gauge(metrics, "m", "regular") == 0
    assert _outcomes(metrics, "m", "sent") == 5


async def test_a_pd_request_counts_under_each_role_it_still_awaits() -> None:
    fleet, metrics = Fleet(), Metrics()
    room = _room(fleet, metrics)
    task = asyncio.create_task(room.hold("m", ("prefill", "decode")))
    await asyncio.sleep(0.01)
    assert (_gauge(metrics, "m", "prefill"), _gauge(metrics, "m", "decode")) == (1, 1)
    fleet.up.add(("decode", "m"))
    room.wake()
    await asyncio.sleep(0.01)
    assert not task.done()
    assert (_gauge(metrics, "m", "prefill"), _gauge(metrics, "m", "decode")) == (1, 0)
    fleet.up.add(("prefill", "m"))
    room.wake()
    await asyncio.wait_for(task, 1)
    assert (_gauge(metrics, "m", "prefill"), _gauge(metrics, "m", "decode")) == (0, 0)


async def test_the_hold_off_expired_or_full_is_a_503_naming_the_model() -> None:
    fleet, metrics = Fleet(), Metrics()
    with pytest.raises(NoWorkerAvailable) as off:
        await _room(fleet, metrics, seconds=0).hold("m", ("regular",))
    assert off.value.code == "no_available_workers" and "'m'" in off.value.message
    assert off.value.response().headers["Retry-After"] == "5"
    room = _room(fleet, metrics, seconds=0.2, size=1)
    first = asyncio.create_task(room.hold("m", ("regular",)))
    await asyncio.sleep(0.01)
    with pytest.raises(NoWorkerAvailable) as full:
        await room.hold("m", ("regular",))
    assert full.value.code == "hold_queue_full"
    with pytest.raises(NoWorkerAvailable) as expired:
        await first
    assert expired.value.code == "hold_expired" and "'m'" in expired.value.message
    assert room.waiting("m") == 0 and _gauge(metrics, "m", "regular") == 0
    assert (_outcomes(metrics, "m", "full"), _outcomes(metrics, "m", "expired")) == (1, 1)


async def test_a_cancelled_request_leaves_the_queue() -> None:
    fleet, metrics = Fleet(), Metrics()
    room = _room(fleet, metrics)
    task = asyncio.create_task(room.hold("m", ("regular",)))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert room.waiting("m") == 0 and _gauge(metrics, "m", "regular") == 0
    assert _outcomes(metrics, "m", "cancelled") == 1
    fleet.up.add(("regular", "m"))
    room.wake()  # nothing left to release
