"""Removing a worker (``fleet.Lifecycle.remove``): a removal cancelled while it drains leaves nothing half done, and
a completed one tells the router to let go of the worker's connections."""

from __future__ import annotations

import asyncio

import pytest
from smg_router.errors import Conflict, NotFound
from smg_router.fleet.lifecycle import Lifecycle
from smg_router.metrics import Metrics
from smg_router.policies.factory import PolicyFactory
from smg_router.policies.registry import PolicyRegistry
from smg_router.settings import PolicySettings, RetrySettings
from smg_router.workers.load import LoadView
from smg_router.workers.registry import WorkerRegistry
from smg_router.workers.worker import WorkerSpec, WorkerStatus

URL = "http://127.0.0.2:8000"


def _lifecycle() -> Lifecycle:
    metrics, loads = Metrics(), LoadView(max_age=5)
    policies = PolicyRegistry(PolicyFactory(settings=PolicySettings(), loads=loads, metrics=metrics), PolicySettings())
    return Lifecycle(registry=WorkerRegistry(), policies=policies, loads=loads, metrics=metrics, retry=RetrySettings())


@pytest.mark.parametrize("draining_before", [False, True])
async def test_a_removal_cancelled_while_it_drains_leaves_the_worker_as_it_was(draining_before: bool) -> None:
    lifecycle = _lifecycle()
    worker, _ = lifecycle.add(WorkerSpec(url=URL, model_id="m"))
    lifecycle.set_status(worker, WorkerStatus.READY)
    lifecycle.set_draining(worker, draining_before)
    worker.inflight = 1  # a request it is still answering
    removal = asyncio.create_task(lifecycle.remove(worker, drain_timeout=30))
    await asyncio.sleep(0.05)
    assert worker.status is WorkerStatus.DRAINING
    removal.cancel()  # the caller left
    with pytest.raises(asyncio.CancelledError):
        await removal
    assert lifecycle.registry.get(worker.id) is worker
    assert worker.status is (WorkerStatus.DRAINING if draining_before else WorkerStatus.READY)


async def test_a_removed_worker_is_told_to_whoever_keeps_its_connections() -> None:
    lifecycle = _lifecycle()
    told: list[str] = []
    lifecycle.on_removed = told.append
    worker, _ = lifecycle.add(WorkerSpec(url=URL, model_id="m"))
    assert await lifecycle.remove(worker, drain_timeout=1)
    assert told == [URL]


async def test_an_update_while_the_worker_drains_for_its_removal_is_refused_and_one_after_it_is_not_found() -> None:
    lifecycle = _lifecycle()
    worker, _ = lifecycle.add(WorkerSpec(url=URL, model_id="m"))
    lifecycle.set_status(worker, WorkerStatus.READY)
    worker.inflight = 1
    removal = asyncio.create_task(lifecycle.remove(worker, drain_timeout=30))
    await asyncio.sleep(0.05)
    with pytest.raises(Conflict) as refused:
        lifecycle.update(worker, WorkerSpec(url=URL, model_id="m", labels={"a": "b"}))
    assert refused.value.code == "worker_being_removed" and worker.spec.labels == {}
    with pytest.raises(Conflict):  # nor a registration of its URL: it would be removed under its caller
        lifecycle.add(WorkerSpec(url=URL, model_id="m"))
    assert not lifecycle.current(worker) and worker.status is WorkerStatus.DRAINING
    worker.inflight = 0
    assert await removal
    with pytest.raises(NotFound) as gone:  # its caller found it before the removal, and applies after it
        lifecycle.update(worker, WorkerSpec(url=URL, model_id="m", priority=9))
    assert gone.value.code == "worker_not_found" and worker.spec.priority != 9
    assert f'worker="{URL}"' not in lifecycle.metrics.exposition().decode()


async def test_two_removals_of_one_worker_keep_it_refusing_updates_until_the_last_ends() -> None:
    lifecycle = _lifecycle()
    worker, _ = lifecycle.add(WorkerSpec(url=URL, model_id="m"))
    worker.inflight = 1
    first = asyncio.create_task(lifecycle.remove(worker, drain_timeout=30))
    second = asyncio.create_task(lifecycle.remove(worker, drain_timeout=30))
    await asyncio.sleep(0.05)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert worker.status is WorkerStatus.DRAINING and not lifecycle.current(worker)  # the second still drains it
    worker.inflight = 0
    assert await second
    assert lifecycle.registry.get(worker.id) is None
