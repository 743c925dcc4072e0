"""The InferencePool source: one loop that keeps every taken pool's workers registered on every router replica.

A pass: for each pool ``inference_pools.takes`` → its desired set (pure) → ``reconciler.sync_replica`` on each
replica of the operator's router (the same diff and calls as an SMGWorker's pass, owner = the pool's UID) →
then, on every replica seen, the removal of pool workers whose pool is no longer taken (deleted, or no longer
naming this router).  Level-triggered like the SMGWorker loop: pod, pool and Service events poke it, and it runs
every ``reconcile_interval`` anyway.

One loop, not a kopf daemon per pool: a daemon needs a finalizer on the pool, and the pool belongs to the
gateway.  The operator never writes an InferencePool (no status, no finalizer, no annotation): it only posts
Events about one.  Without a finalizer a deleted pool is seen only as missing, hence the orphan sweep; replicas
are swept while they hold pool workers, including the replicas of an earlier pass (a pool whose namespace
held the only router that served it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from smg_operator.desired import PodInfo, Replica
from smg_operator.inference_pools import (
    POOL_GROUP,
    POOL_KIND,
    POOL_VERSION,
    PoolInfo,
    PoolProblem,
    orphaned_ids,
    pool_desired,
    takes,
)
from smg_operator.reconciler import Interest, Key, Runtime, find_replicas, sync_replica
from smg_operator.routers import RouterCallError

log = logging.getLogger(__name__)
DRAIN = 30.0
"""Seconds a pool worker that leaves is drained for before it is removed (an SMGWorker's default)."""

PoolIndex = Mapping[Key, Iterable[PoolInfo]]
PodIndex = Mapping[str, Iterable[PodInfo]]
ServiceIndex = Mapping[Key, Iterable[Mapping[str, str]]]


@dataclass(frozen=True, slots=True)
class Indexes:
    """kopf's live views: pools, pods and Services (read afresh by every pass)."""

    pools: PoolIndex
    pods: PodIndex
    services: ServiceIndex


@dataclass
class PoolSync:
    """The InferencePool loop and what it remembers between passes (kept in kopf's memo as ``pools``)."""

    rt: Runtime
    mode: str
    poke_event: asyncio.Event = field(default_factory=asyncio.Event)
    interests: dict[Key, Interest] = field(default_factory=dict)
    """Per taken pool, what its last pass looked at (scopes the pod pokes)."""
    problems: dict[Key, str] = field(default_factory=dict)
    """What was last said per pool ("reason:message", "" for fine): an Event only when it changes."""
    swept: dict[tuple[str, str], Replica] = field(default_factory=dict)
    """Replicas an earlier pass saw: swept for orphans until they hold none and no pool uses them."""
    task: asyncio.Task[None] | None = None

    def start(self, indexes: Indexes) -> None:
        """Start the loop (once).  Called by the first pool, pod or Service event: kopf runs handlers only once
        its indexes are filled, so the first pass never mistakes an empty index for "no pool left"."""
        if self.task is None:
            self.task = asyncio.create_task(self._loop(indexes), name="smg-inferencepools")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.task = None

    def poke(self) -> None:
        self.poke_event.set()

    def poke_pod(self, pod: PodInfo) -> None:
        """A pod changed: wake the loop if it concerns a pool (as a worker or a router replica)."""
        if not self.interests or any(i.wants_pod(pod) for i in self.interests.values()):
            self.poke_event.set()

    def poke_service(self, namespace: str, name: str) -> None:
        if any(i.router == (namespace, name) for i in self.interests.values()) or not self.interests:
            self.poke_event.set()

    async def _loop(self, indexes: Indexes) -> None:
        while True:
            self.poke_event.clear()
            try:
                await self.sync_once(indexes)
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad pass must not end the loop; the next one retries
                log.exception("InferencePool pass failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.poke_event.wait(), timeout=self.rt.settings.reconcile_interval)
            await asyncio.sleep(0.05)  # coalesce a burst of pod events into one pass

    async def sync_once(self, indexes: Indexes) -> None:
        """One pass over every pool, then the orphan sweep."""
        s = self.rt.settings
        pools = [p for store in indexes.pools.values() for p in store]
        taken = sorted(
            (p for p in pools if takes(p, mode=self.mode, router_service=s.router_service)), key=lambda p: p.key
        )
        services = {key: next(iter(store), None) for key, store in indexes.services.items()}
        replicas: dict[tuple[str, str], Replica] = {}
        interests: dict[Key, Interest] = {}
        routers_found = True

        def pods_of(pool: PoolInfo) -> list[PodInfo]:  # its namespace's, and its router's
            namespaces = {pool.namespace, s.router_namespace or pool.namespace}
            return [p for ns in namespaces for p in indexes.pods.get(ns, ())]

        outcomes = await asyncio.gather(  # the pools side by side, as SMGWorkers' loops run
            *(self._sync_pool(pool, pods=pods_of(pool), services=services) for pool in taken)
        )
        for pool, (found, router_found) in zip(taken, outcomes, strict=True):
            routers_found = routers_found and router_found
            for r in found:
                replicas[(r.namespace, r.pod)] = r
            router = (s.router_namespace or pool.namespace, s.router_service or "")
            interests[pool.key] = Interest(
                namespace=pool.namespace,
                selector={"matchLabels": dict(pool.match_labels)},
                claimed=frozenset(),
                router=router,
                router_selector=services.get(router),
                router_pods=frozenset((r.namespace, r.pod) for r in found),
            )
        for key in [k for k in self.interests if k not in interests]:  # no longer taken: forget what we said of it
            self.problems.pop(key, None)
            self.rt.metrics.forget_pool(f"{key[0]}/{key[1]}")
        self.interests = interests
        if s.router_namespace:  # the router's replicas even with no pool left (one deleted while we were down)
            own, _ = find_replicas(
                self.rt,
                namespace=s.router_namespace,
                spec={},
                pods=indexes.pods.get(s.router_namespace, ()),
                services=services,
            )
            self.swept.update({(r.namespace, r.pod): r for r in own})
        self.swept.update(replicas)
        running = {
            (p.namespace, p.name)
            for ns in {r.namespace for r in self.swept.values()}
            for p in indexes.pods.get(ns, ())
            if p.running and not p.terminating
        }
        for gone in [key for key in self.swept if key not in running]:  # a router gone held its registry in memory
            del self.swept[gone]
        await self._sweep(keep={p.uid for p in taken}, current=replicas, strip=routers_found)

    async def _sync_pool(
        self, pool: PoolInfo, *, pods: list[PodInfo], services: Mapping[Key, Mapping[str, str] | None]
    ) -> tuple[list[Replica], bool]:
        """One pool on each replica of its router; those replicas, and whether its router was found."""
        desired, problem = pool_desired(pool, pods)
        replicas, router_problem = find_replicas(
            self.rt, namespace=pool.namespace, spec={}, pods=pods, services=services
        )
        if problem is None and router_problem is not None:
            problem = PoolProblem(*router_problem)
        await self._report(pool, problem)
        results = await asyncio.gather(
            *(sync_replica(self.rt, r, desired, uid=pool.uid, drain=DRAIN) for r in replicas)
        )
        everywhere = frozenset.intersection(*(r.registered for r, _ in results)) if results else frozenset()
        self.rt.metrics.pool_workers.labels(f"{pool.namespace}/{pool.name}").set(len(everywhere))
        for result, conflicts in results:
            if result.error:
                log.warning("InferencePool %s/%s on %s: %s", pool.namespace, pool.name, result.pod, result.error)
            for url in conflicts:
                log.warning(
                    "InferencePool %s/%s: %s is registered on %s by someone else; left alone",
                    pool.namespace,
                    pool.name,
                    url,
                    result.pod,
                )
        return replicas, router_problem is None

    async def _report(self, pool: PoolInfo, problem: PoolProblem | None) -> None:
        """A log line and a Warning Event on the pool when its problem appears or changes; a log line when it ends."""
        said = f"{problem.reason}:{problem.message}" if problem else ""
        if self.problems.get(pool.key) == said:
            return
        self.problems[pool.key] = said
        if problem is None:
            log.info("InferencePool %s/%s: registering its workers", pool.namespace, pool.name)
            return
        log.warning("%s: %s", problem.reason, problem.message)
        await self.rt.kube.post_event(
            namespace=pool.namespace,
            name=pool.name,
            uid=pool.uid,
            type="Warning",
            reason=problem.reason,
            message=problem.message,
            kind=POOL_KIND,
            api_version=f"{POOL_GROUP}/{POOL_VERSION}",
        )

    async def _sweep(self, *, keep: set[str], current: Mapping[tuple[str, str], Replica], strip: bool) -> None:
        """Remove the workers of pools no longer taken from every replica seen, and with ``strip`` every pool worker
        from a replica that is no router of a taken pool any more (the Service stopped selecting it, or the router
        moved); forget a replica that holds none and is no such router (or cannot be reached and is not one).

        ``strip`` only when every taken pool found its router: a router Service missing for a moment must not strip
        the workers from replicas that still serve them (as ``reconciler.clean_stale`` does for SMGWorkers)."""
        replicas = list(self.swept.values())
        outcomes = await asyncio.gather(
            *(
                self._sweep_replica(r, keep=keep if (r.namespace, r.pod) in current or not strip else set())
                for r in replicas
            )
        )
        for r, clean in zip(replicas, outcomes, strict=True):
            if clean and strip and (r.namespace, r.pod) not in current:  # without strip, kept for a later pass
                del self.swept[(r.namespace, r.pod)]

    async def _sweep_replica(self, replica: Replica, *, keep: set[str]) -> bool:
        try:
            workers = await self.rt.routers.list_workers(replica.url)
        except RouterCallError as e:
            log.info("InferencePool sweep: %s unreachable (%s)", replica.pod, e)
            return not e.reachable
        orphans = orphaned_ids(workers, keep=keep)
        for wid in orphans:
            _ = self.rt.remove_later(replica.url, wid, drain=DRAIN)
        if orphans:
            log.info("InferencePool sweep: removing %d worker(s) of pools gone from %s", len(orphans), replica.pod)
        return not orphans
