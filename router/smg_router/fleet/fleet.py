"""The fleet: the one place that orchestrates worker lifecycle steps for the HTTP layer and the command line.

``Lifecycle`` applies each mutation to the registry, every policy instance, the load view and the metrics
(the one path); ``Fleet`` sequences what comes around it: a newly registered worker is probed at once (so
the answer carries a real status, not "pending"), the health checker and the load monitor run in the
background, each with its own probe client (its own connection pool: a health round never waits for a
connection that a load poll holds, nor the other way round).  All of them exist from construction;
``start`` opens the pools.
"""

from __future__ import annotations

from smg_router.fleet.health import HealthChecker
from smg_router.fleet.kv_feeds import KvFeeds
from smg_router.fleet.lifecycle import Lifecycle
from smg_router.fleet.load_monitor import LoadMonitor
from smg_router.fleet.probes import ProbeClient
from smg_router.metrics import Metrics
from smg_router.policies.index import EventIndexes
from smg_router.policies.registry import PolicyRegistry
from smg_router.settings import Settings
from smg_router.workers.load import LoadView
from smg_router.workers.registry import WorkerRegistry
from smg_router.workers.worker import Worker, WorkerSpec


class Fleet:
    def __init__(
        self,
        *,
        settings: Settings,
        registry: WorkerRegistry,
        policies: PolicyRegistry,
        loads: LoadView,
        metrics: Metrics,
        events: EventIndexes | None = None,
    ) -> None:
        self.feeds = (
            None
            if events is None
            else KvFeeds(events=events, metrics=metrics, loads=loads, on_index_change=lambda: policies.sync(registry))
        )
        self.lifecycle = Lifecycle(
            registry=registry, policies=policies, loads=loads, metrics=metrics, retry=settings.retry, feeds=self.feeds
        )
        self.health_probes = ProbeClient()
        self.load_probes = ProbeClient()
        self.health = HealthChecker(probes=self.health_probes, lifecycle=self.lifecycle, settings=settings.health)
        self.load_monitor = LoadMonitor(
            probes=self.load_probes,
            registry=registry,
            policies=policies,
            loads=loads,
            metrics=metrics,
            settings=settings.load,
        )

    async def start(self) -> None:
        await self.health_probes.start()
        await self.load_probes.start()

    async def close(self) -> None:
        if self.feeds is not None:
            await self.feeds.close()
        await self.health_probes.close()
        await self.load_probes.close()

    async def register(self, spec: WorkerSpec, *, probe: bool = True) -> tuple[Worker, bool]:
        """Add a worker (idempotent: the same spec again returns the existing one, ``created`` False)."""
        worker, created = self.lifecycle.add(spec)
        if created and probe:
            await self.health.probe(worker)
        return worker, created

    async def remove(self, worker: Worker, *, drain_timeout: float) -> bool:
        """Drain, then remove from the registry, every policy, the load view and the metrics."""
        return await self.lifecycle.remove(worker, drain_timeout=drain_timeout)
