"""Removing a worker (``fleet.Lifecycle.remove``): a removal cancelled while it drains leaves nothing half done, and
a completed one tells the router to let go of the worker's connections."""

from __future__ import annotations

import asyncio

import pytest
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
