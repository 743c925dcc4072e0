"""The one lifecycle path: every worker add, update, status change and removal goes through here.

Each mutation updates the registry, then re-syncs every policy instance (default, per-model, prefill,
decode) to the workers it can reach, then the load view and the metrics.  Removal is ordered: drain
(stop routing, wait for in-flight) → remove from the registry → re-sync the policies (the worker leaves
every tree) → forget its load and metric series.  The admin API, the command line and the health
checker all call this; nothing else mutates workers.

An update applies to a registered worker whole, or not at all: one that comes for a worker already removed (its
caller looked it up, then waited for a body) is a 404, and one that comes while the worker drains for its removal is
a 409 (the removal wins: no update makes a leaving worker routable again or republishes its series after it left).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from smg_router.errors import BadRequest, Conflict, NotFound
from smg_router.fleet.kv_feeds import KvFeeds
from smg_router.metrics import Metrics
from smg_router.policies.registry import PolicyRegistry
from smg_router.settings import RetrySettings
from smg_router.workers.breaker import CircuitBreaker
from smg_router.workers.load import LoadView
from smg_router.workers.registry import WorkerRegistry
from smg_router.workers.worker import Worker, WorkerSpec, WorkerStatus

log = logging.getLogger(__name__)


class Lifecycle:
    def __init__(
        self,
        *,
        registry: WorkerRegistry,
        policies: PolicyRegistry,
        loads: LoadView,
        metrics: Metrics,
        retry: RetrySettings,
        feeds: KvFeeds | None = None,
    ) -> None:
        self.feeds = feeds
        """The subscribers to the workers' KV events, kept in step before the policies (which read them)."""
        self.registry = registry
        self.policies = policies
        self.loads = loads
        self.metrics = metrics
        self._retry = retry
        self.on_removed: Callable[[str], None] = lambda url: None
        """Told the URL of every worker removed (the router closes its idle connections to it)."""
        self.on_change: Callable[[], None] = lambda: None
        """Told after every add, update and status change (the requests held for a routable worker look again:
        ``waiting``)."""
        self._removing: dict[str, int] = {}
        """Ids of the workers a removal drains, with how many removals (a second DELETE waits like the first)."""

    def add(self, spec: WorkerSpec) -> tuple[Worker, bool]:
        """Register a worker; the same URL with the same spec is a no-op returning (existing, False)."""
        existing = self.registry.by_url(spec.url)
        if existing is not None:
            if existing.id in self._removing:
                raise Conflict(
                    f"worker {spec.url} is being removed (id {existing.id}); register it again once it is gone",
                    code="worker_being_removed",
                )
            if existing.spec == spec or (spec.model_id is None and _same_but_model(existing.spec, spec)):
                return existing, False
            raise Conflict(
                f"worker {spec.url} is already registered with another spec (id {existing.id}); "
                "use PUT or PATCH /workers/{id} to change it",
                code="worker_exists",
            )
        worker = Worker(
            spec,
            CircuitBreaker(
                failure_threshold=self._retry.breaker_failure_threshold, cooldown=self._retry.breaker_cooldown
            ),
        )
        self.registry.add(worker)
        self._changed(worker, "added")
        log.info("worker added: %s role=%s model=%s", spec.url, spec.role, spec.model_id)
        return worker, True

    def current(self, worker: Worker) -> bool:
        """Whether ``worker`` is registered and not being removed: an update would apply."""
        return self.registry.get(worker.id) is worker and worker.id not in self._removing

    def update(self, worker: Worker, spec: WorkerSpec) -> Worker:
        """A registered worker's new spec; 404 when it was removed since its caller found it, 409 while it drains for
        its removal."""
        if self.registry.get(worker.id) is not worker:
            raise NotFound(f"no worker with id {worker.id!r} (removed)", code="worker_not_found")
        if worker.id in self._removing:
            raise Conflict(
                f"worker {worker.id} is being removed (a DELETE drains it); it takes no update",
                code="worker_being_removed",
            )
        if spec.url != worker.url:
            raise BadRequest(
                "url: cannot change a worker's URL; register the new URL and delete this one", code="invalid_field"
            )
        if spec == worker.spec:
            return worker
        old_role = worker.role
        self.registry.respec(worker, spec)
        if spec.role != old_role:
            self.metrics.forget_worker(worker.url, old_role)
        self._changed(worker, "updated")
        log.info("worker updated: %s role=%s model=%s labels=%s", spec.url, spec.role, spec.model_id, spec.labels)
        return worker

    def set_status(self, worker: Worker, status: WorkerStatus) -> None:
        if worker.status is status or self.registry.get(worker.id) is not worker:
            return
        log.info("worker %s: %s -> %s", worker.url, worker.status.value, status.value)
        worker.status = status
        self._publish_health(worker)
        self.on_change()

    def set_draining(self, worker: Worker, draining: bool) -> None:
        if draining:
            self.set_status(worker, WorkerStatus.DRAINING)
        elif worker.status is WorkerStatus.DRAINING:
            self.set_status(worker, WorkerStatus.READY if worker.health_failures == 0 else WorkerStatus.NOT_READY)

    async def remove(self, worker: Worker, *, drain_timeout: float) -> bool:
        """Drain then remove; returns whether the drain finished before the timeout.  Cancelled while it drains (its
        caller left), nothing is half done: the worker is as it was, draining only if it was before."""
        was_draining = worker.status is WorkerStatus.DRAINING
        self.set_status(worker, WorkerStatus.DRAINING)
        deadline = time.monotonic() + drain_timeout
        self._removing[worker.id] = self._removing.get(worker.id, 0) + 1
        try:
            while worker.inflight > 0 and time.monotonic() < deadline:  # noqa: ASYNC110 - polling keeps the hot path free of events
                await asyncio.sleep(0.02)
        except asyncio.CancelledError:
            if not was_draining and self._removing[worker.id] == 1:  # no other removal still drains it
                self.set_draining(worker, False)
            log.info("worker %s: removal cancelled while it drained; left as it was", worker.url)
            raise
        finally:
            if (left := self._removing[worker.id] - 1) > 0:
                self._removing[worker.id] = left
            else:
                del self._removing[worker.id]
        drained = worker.inflight == 0
        if self.registry.get(worker.id) is not worker:
            return drained  # removed meanwhile by a concurrent call
        self.registry.discard(worker)
        self._sync()
        self.loads.forget(worker.id)
        self.metrics.forget_worker(worker.url, worker.role)
        self.on_removed(worker.url)
        self.metrics.lifecycle_events.labels("removed", worker.role).inc()
        log.info("worker removed: %s (drained=%s)", worker.url, drained)
        return drained

    def _sync(self) -> None:
        if self.feeds is not None:
            self.feeds.sync(self.registry)
        self.policies.sync(self.registry)

    def _changed(self, worker: Worker, event: str) -> None:
        self._sync()
        self.metrics.lifecycle_events.labels(event, worker.role).inc()
        self._publish_health(worker)
        self.on_change()

    def _publish_health(self, worker: Worker) -> None:
        self.metrics.worker_healthy.labels(worker.url, worker.role).set(1 if worker.status is WorkerStatus.READY else 0)
        self.metrics.worker_inflight.labels(worker.url, worker.role).set(worker.inflight)


def _same_but_model(a: WorkerSpec, b: WorkerSpec) -> bool:
    """A re-registration without model_id matches a worker whose model was discovered."""
    return (a.url, a.role, a.bootstrap_port, a.labels, a.priority, a.owner, a.kv_capacity_tokens) == (
        b.url,
        b.role,
        b.bootstrap_port,
        b.labels,
        b.priority,
        b.owner,
        b.kv_capacity_tokens,
    )
