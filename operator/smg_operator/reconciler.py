"""One reconcile of one SMGWorker: desired set → every router replica's ``GET /workers`` → plan → calls.

Level-triggered: it compares what should be with what each replica reports, every time, and touches only
workers this SMGWorker owns (by the owner-UID label), so a worker a person added by hand is left alone and
a replica that restarted empty gets the whole set back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from smg_operator.desired import (
    Desired,
    PodInfo,
    Replica,
    desired_workers,
    owned_ids,
    plan,
    router_replicas,
    router_target,
)
from smg_operator.metrics import OperatorMetrics
from smg_operator.routers import RouterCallError, RouterClient
from smg_operator.settings import OperatorSettings
from smg_operator.status import Observed, ReplicaResult

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    """What the handlers share (kept in kopf's memo): settings, the router client, metrics, reconcile pokes."""

    settings: OperatorSettings
    routers: RouterClient
    metrics: OperatorMetrics
    pokes: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    generations: dict[tuple[str, str], int | None] = field(default_factory=dict)
    """Last seen metadata.generation per SMGWorker: a spec change pokes, our own status writes do not."""

    def poke(self, key: tuple[str, str] | None = None) -> None:
        """Wake one SMGWorker's reconcile loop (or all of them) now instead of at the next interval."""
        for k, event in self.pokes.items():
            if key is None or k == key:
                event.set()


def find_replicas(rt: Runtime, *, namespace: str, spec: Mapping[str, Any], pods: Iterable[PodInfo],
                  services: Mapping[tuple[str, str], Mapping[str, str] | None]
                  ) -> tuple[list[Replica], tuple[str, str] | None]:
    """The router replicas of an SMGWorker, or why there are none (reason, message)."""
    s = rt.settings
    target = router_target(namespace=namespace, spec=spec, default_service=s.router_service,
                           default_namespace=s.router_namespace, default_port=s.router_port)
    if target is None:
        return [], ("NoRouterService", "spec.router.service is not set and smg-operator has no --router-service")
    key = (target.namespace, target.service)
    if key not in services:
        return [], ("RouterServiceNotFound", f"Service {target.namespace}/{target.service} not found")
    replicas = router_replicas(target, services[key], pods)
    if not replicas:
        return [], ("NoRouterReplicas", f"no Ready pod behind Service {target.namespace}/{target.service}")
    return replicas, None


async def reconcile(rt: Runtime, *, namespace: str, name: str, uid: str, spec: Mapping[str, Any],
                    pods: Iterable[PodInfo], services: Mapping[tuple[str, str], Mapping[str, str] | None]
                    ) -> Observed:
    pods = list(pods)
    desired = desired_workers(namespace=namespace, name=name, uid=uid, spec=spec, pods=pods)
    replicas, problem = find_replicas(rt, namespace=namespace, spec=spec, pods=pods, services=services)
    drain = float(spec.get("drainTimeoutSeconds", 30))
    results = await asyncio.gather(*(sync_replica(rt, r, desired, uid=uid, drain=drain) for r in replicas))
    conflicts = tuple(sorted({u for _, c in results for u in c}))
    return Observed(desired=desired, replicas=[r for r, _ in results], router_problem=problem, conflicts=conflicts)


async def sync_replica(rt: Runtime, replica: Replica, desired: Desired, *, uid: str, drain: float
                       ) -> tuple[ReplicaResult, tuple[str, ...]]:
    routers = rt.routers
    try:
        current = await routers.list_workers(replica.url)
    except RouterCallError as e:
        return ReplicaResult(pod=replica.pod, url=replica.url, reachable=False, error=str(e)), ()
    p = plan(desired.workers, current, owner_uid=uid)
    present = {w["url"] for w in current} - {w.url for _, w in p.replace} - set(p.conflicts)
    calls: list[tuple[str | None, Any]] = [(w.url, routers.register(replica.url, w.registration())) for w in p.add]
    calls += [(w.url, routers.replace(replica.url, wid, w.registration())) for wid, w in p.replace]
    calls += [(None, routers.remove(replica.url, wid, drain_timeout=drain)) for wid in p.remove]
    outcomes = await asyncio.gather(*(c for _, c in calls), return_exceptions=True)
    errors: list[str] = []
    reachable = True
    for (url, _), outcome in zip(calls, outcomes, strict=True):
        if isinstance(outcome, RouterCallError):
            errors.append(str(outcome))
            reachable = reachable and outcome.reachable
        elif isinstance(outcome, BaseException):
            raise outcome
        elif url is not None:
            present.add(url)
    if not p.empty:
        log.info("router %s: +%d ~%d -%d (errors: %d)", replica.pod, len(p.add), len(p.replace), len(p.remove),
                 len(errors))
    registered = frozenset(present & {w.url for w in desired.workers})
    return ReplicaResult(pod=replica.pod, url=replica.url, reachable=reachable, registered=registered,
                         error="; ".join(errors) or None), p.conflicts


async def deregister_all(rt: Runtime, replicas: Iterable[Replica], *, uid: str, drain: float) -> list[str]:
    """Drain and remove every worker this SMGWorker owns on every replica; the errors (empty when done)."""

    async def one(replica: Replica) -> list[str]:
        try:
            current = await rt.routers.list_workers(replica.url)
            await asyncio.gather(*(rt.routers.remove(replica.url, wid, drain_timeout=drain)
                                   for wid in owned_ids(current, owner_uid=uid)))
        except RouterCallError as e:
            return [f"{replica.pod}: {e}"]
        return []

    results = await asyncio.gather(*(one(r) for r in replicas))
    return [e for errs in results for e in errs]
