"""The reconcile of one SMGWorker: one pass, the loop that repeats it, and the finalizer's deregistration.

A pass: desired set → every router replica's ``GET /workers`` → plan → calls → status and Events.
Level-triggered: it compares what should be with what each replica reports, every time, and touches only
workers this SMGWorker owns (by the owner-UID label), so a worker a person added by hand is left alone and
a replica that restarted empty gets the whole set back.

``handlers`` calls in here with what kopf hands it; nothing here imports kopf (or kubernetes): kopf's
``DaemonStopped`` arrives as a ``Stopping``, the API writes go through ``Runtime.kube`` (``smg_operator.k8s``
in production), and a deregistration that must be retried raises ``DeregistrationPending``, which the
handler turns into ``kopf.TemporaryError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from smg_operator.desired import (
    Declaration,
    Desired,
    DesiredWorker,
    PodInfo,
    Replica,
    RouterTarget,
    desired_declaration,
    desired_workers,
    owned_declarations,
    owned_ids,
    plan,
    plan_declarations,
    router_replicas,
    router_target,
    selector_matches,
)
from smg_operator.metrics import OperatorMetrics
from smg_operator.routers import RouterCallError, RouterClient
from smg_operator.settings import OperatorSettings
from smg_operator.status import Observed, ReplicaResult, build_status, differs
from smg_operator.tenancy import refused_endpoints, router_refusal, trusted_replicas

log = logging.getLogger(__name__)
STATUS_REFRESH = 60.0
"""Rewrite an unchanged status at most this often (keeps routers[].lastSync honest without a write per loop)."""

Key = tuple[str, str]
"""(namespace, name) of an SMGWorker."""
PodIndex = Mapping[str, Iterable[PodInfo]]
"""kopf's pod index: namespace → the pods there."""
ServiceIndex = Mapping[Key, Iterable[Mapping[str, str]]]
"""kopf's service index: (namespace, name) → the Service's selector (one)."""


class Kube(Protocol):
    """The Kubernetes side of a reconcile: ``smg_operator.k8s`` is the real one (a module fits the protocol)."""

    def now_iso(self) -> str: ...

    async def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> bool: ...

    async def post_event(
        self,
        *,
        namespace: str,
        name: str,
        uid: str,
        type: str,
        reason: str,
        message: str,
        kind: str = ...,
        api_version: str = ...,
    ) -> None:
        """An Event about an SMGWorker, or the object ``kind``/``api_version`` names (an InferencePool)."""


class Stopping(Protocol):
    """What the loop needs of kopf's ``DaemonStopped``: true once the daemon must stop; ``wait()`` until then."""

    def __bool__(self) -> bool: ...

    def wait(self) -> Awaitable[object]: ...


@dataclass(frozen=True, slots=True)
class Interest:
    """What one SMGWorker's last pass looked at: the pods and the Service whose events must wake its loop.

    Pokes are scoped by it, so a pod event wakes only the SMGWorkers it concerns instead of every loop."""

    namespace: str
    selector: Mapping[str, Any] | None
    claimed: frozenset[str]
    """Names of the pods the selector matched (serving or not): a pod relabelled away still wakes its old owner."""
    router: Key | None
    """(namespace, name) of the router Service."""
    router_selector: Mapping[str, str] | None
    router_pods: frozenset[Key]
    """(namespace, name) of the replicas, current and stale."""

    def wants_pod(self, pod: PodInfo) -> bool:
        if pod.namespace == self.namespace and (
            pod.name in self.claimed or selector_matches(self.selector, pod.labels)
        ):
            return True
        if (pod.namespace, pod.name) in self.router_pods:
            return True
        return (
            self.router is not None
            and pod.namespace == self.router[0]
            and selector_matches({"matchLabels": dict(self.router_selector or {})}, pod.labels)
        )


@dataclass
class Runtime:
    """What the handlers share (kept in kopf's memo): settings, the router client, metrics, the Kubernetes
    writes, reconcile pokes, and the drains in flight."""

    settings: OperatorSettings
    routers: RouterClient
    metrics: OperatorMetrics
    kube: Kube
    pokes: dict[Key, asyncio.Event] = field(default_factory=dict)
    """One per running reconcile loop: set to wake it early.  A key is here exactly while its loop runs."""
    generations: dict[Key, int | None] = field(default_factory=dict)
    """Last seen metadata.generation per SMGWorker: a spec change pokes, our own status writes do not."""
    interests: dict[Key, Interest] = field(default_factory=dict)
    """Per running loop, what its last pass looked at (absent before its first pass: then every event pokes it)."""
    removals: dict[tuple[str, str], asyncio.Task[str | None]] = field(default_factory=dict)
    """(replica URL, worker id) → its drain-then-remove call in flight.  Drains take up to drainTimeoutSeconds
    (an hour at most), so a pass starts them and moves on; the next pass sees the worker still listed and
    leaves it to the call in flight."""

    def poke(self, key: Key | None = None) -> None:
        """Wake one SMGWorker's reconcile loop (or all of them) now instead of at the next interval."""
        for k, event in self.pokes.items():
            if key is None or k == key:
                event.set()

    def poke_pod(self, pod: PodInfo) -> None:
        """A pod changed (or went): wake the loops it concerns, as a worker, a router replica or a stale one."""
        for key, event in self.pokes.items():
            interest = self.interests.get(key)
            if interest is None or interest.wants_pod(pod):
                event.set()

    def poke_service(self, namespace: str, name: str) -> None:
        """A Service changed: wake the loops whose router it is."""
        for key, event in self.pokes.items():
            interest = self.interests.get(key)
            if interest is None or interest.router == (namespace, name):
                event.set()

    def remove_later(self, replica: str, worker_id: str, *, drain: float) -> asyncio.Task[str | None]:
        """Drain then remove a worker on one replica, in the background; the call already in flight for it if any.

        The task's result is the error (None when done); it never raises."""
        key = (replica, worker_id)
        task = self.removals.get(key)
        if task is None:
            task = asyncio.create_task(self._remove(replica, worker_id, drain), name=f"smg-remove {worker_id}")
            self.removals[key] = task
            task.add_done_callback(lambda _: self.removals.pop(key, None))
        return task

    async def _remove(self, replica: str, worker_id: str, drain: float) -> str | None:
        try:
            await self.routers.remove(replica, worker_id, drain_timeout=drain)
        except RouterCallError as e:
            log.warning("removing worker %s from %s failed (retried by the next pass): %s", worker_id, replica, e)
            return str(e)
        return None

    async def close(self) -> None:
        """Cancel the drains in flight (the operator stops; the next leader's passes start them again)."""
        tasks = list(self.removals.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def generation_seen(self, key: Key, generation: int | None) -> None:
        """An SMGWorker event: poke its loop if the spec changed (a new generation), not for our own status write."""
        if self.generations.get(key) != generation:
            self.generations[key] = generation
            self.poke(key)


class DeregistrationPending(Exception):
    """Some replica still holds a deleted SMGWorker's workers (it could not be reached): retry after ``delay``."""

    def __init__(self, message: str, *, delay: float) -> None:
        super().__init__(message)
        self.delay = delay


def retry_delay(retry: int) -> float:
    """Seconds before the finalizer's next try: 1, 2, 4, ... doubling, at most 30."""
    return min(2.0 ** min(retry, 5), 30.0)


def _pods(index: PodIndex) -> list[PodInfo]:
    return [pod for store in index.values() for pod in store]


def _services(index: ServiceIndex) -> dict[Key, Mapping[str, str] | None]:
    return {key: next(iter(store), None) for key, store in index.items()}


def _meta(body: Mapping[str, Any]) -> Mapping[str, Any]:
    meta: Mapping[str, Any] = body.get("metadata") or {}
    return meta


# -- the loop ------------------------------------------------------------------------------------------
async def keep_registered(
    rt: Runtime,
    *,
    namespace: str,
    name: str,
    uid: str,
    body: Mapping[str, Any],
    stopped: Stopping,
    pods: PodIndex,
    services: ServiceIndex,
) -> None:
    """The reconcile loop of one SMGWorker (its kopf daemon): a pass on every poke (pod, service or spec change)
    and every ``reconcile_interval``, until the daemon is stopped or the SMGWorker is being deleted.

    ``body``, ``pods`` and ``services`` are the live views kopf keeps current: every pass reads them afresh."""
    key = (namespace, name)
    poke = rt.pokes.setdefault(key, asyncio.Event())
    last_write = 0.0
    try:
        while not stopped and not _meta(body).get("deletionTimestamp"):
            poke.clear()
            try:
                last_write = await _reconcile_and_report(
                    rt,
                    namespace=namespace,
                    name=name,
                    uid=uid,
                    body=body,
                    pods=pods,
                    services=services,
                    last_write=last_write,
                )
            except Exception:  # one bad reconcile must not end the loop; the next one retries
                rt.metrics.reconciles.labels("error").inc()
                log.exception("reconcile of %s/%s failed", namespace, name)
            await _wait_any(poke, stopped, interval=rt.settings.reconcile_interval)
    finally:
        rt.pokes.pop(key, None)
        rt.interests.pop(key, None)


async def _wait_any(poke: asyncio.Event, stopped: Stopping, *, interval: float) -> None:
    waiters = [asyncio.ensure_future(poke.wait()), asyncio.ensure_future(stopped.wait())]
    try:
        await asyncio.wait(waiters, timeout=interval, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*waiters, return_exceptions=True)
    if not stopped:  # a stopped daemon exits at once (kopf cancels one that does not exit within a few cycles)
        await asyncio.sleep(0.05)  # coalesce a burst of pod events into one reconcile


async def _reconcile_and_report(
    rt: Runtime,
    *,
    namespace: str,
    name: str,
    uid: str,
    body: Mapping[str, Any],
    pods: PodIndex,
    services: ServiceIndex,
    last_write: float,
) -> float:
    """One pass, then the status write policy: write when something changed, or ``STATUS_REFRESH`` after the
    last write; post the transition Events.  Returns the monotonic time of the last status write."""
    spec: Mapping[str, Any] = body.get("spec", {})
    previous: Mapping[str, Any] = body.get("status") or {}
    service_map = _services(services)
    target = _router_key(rt, namespace, spec)
    relevant = _pods_in(pods, {namespace, *(target[:1] if target else ())})
    observed = await reconcile(
        rt, namespace=namespace, name=name, uid=uid, spec=spec, pods=relevant, services=service_map
    )
    current = [Replica(pod=r.pod, url=r.url, namespace=r.namespace) for r in observed.replicas]
    recorded = recorded_replicas(previous)
    stale = await clean_stale(
        rt,
        recorded=trusted_replicas(
            recorded,
            pods=_pods_in(pods, {r.namespace for r in recorded}),
            allowed=rt.settings.allowed_router_services,
        ),
        current=current,
        pods=_pods_in(pods, {r.namespace for r in recorded}),
        uid=uid,
        drain=float(spec.get("drainTimeoutSeconds", 30)),
        clean=observed.router_problem is None,
    )
    rt.interests[(namespace, name)] = Interest(
        namespace=namespace,
        selector=spec.get("selector"),
        claimed=frozenset(
            p.name for p in relevant if p.namespace == namespace and selector_matches(spec.get("selector"), p.labels)
        ),
        router=target,
        router_selector=service_map.get(target) if target else None,
        router_pods=frozenset((r.namespace, r.pod) for r in [*current, *stale]),
    )
    status, events = build_status(
        observed, generation=_meta(body).get("generation"), now=rt.kube.now_iso(), previous=previous
    )
    # no sync time: an entry that stays (its replica unreachable) must not make every pass a status write
    status["staleRouters"] = [{"pod": r.pod, "url": r.url, "namespace": r.namespace} for r in stale] or None
    ready = status["conditions"][0]["status"] == "True"
    rt.metrics.reconciles.labels("ok" if ready else "degraded").inc()
    rt.metrics.registered.labels(f"{namespace}/{name}").set(status["registeredEndpoints"])
    if differs(status, previous) or time.monotonic() - last_write > STATUS_REFRESH:
        if not await rt.kube.patch_status(namespace, name, status):
            return last_write  # deleted meanwhile
        last_write = time.monotonic()
    for event in events:
        await rt.kube.post_event(
            namespace=namespace, name=name, uid=uid, type=event.type, reason=event.reason, message=event.message
        )
    return last_write


def _target(rt: Runtime, namespace: str, spec: Mapping[str, Any]) -> RouterTarget | None:
    """The SMGWorker's router Service, with the operator's defaults filled in."""
    s = rt.settings
    return router_target(
        namespace=namespace,
        spec=spec,
        default_service=s.router_service,
        default_namespace=s.router_namespace,
        default_port=s.router_port,
    )


def _router_key(rt: Runtime, namespace: str, spec: Mapping[str, Any]) -> Key | None:
    target = _target(rt, namespace, spec)
    return None if target is None else (target.namespace, target.service)


def _pods_in(index: PodIndex, namespaces: Iterable[str]) -> list[PodInfo]:
    """The pods of some namespaces only: a pass need not walk the whole cluster's pods."""
    return [pod for ns in set(namespaces) for pod in index.get(ns, ())]


def recorded_replicas(status: Mapping[str, Any]) -> list[Replica]:
    """The replicas an earlier pass wrote to status (``routers`` and ``staleRouters``): who may hold our workers.

    Whoever may write the status can forge these: ``tenancy.trusted_replicas`` decides which get a call."""
    out: dict[tuple[str, str], Replica] = {}
    for entry in [*(status.get("routers") or []), *(status.get("staleRouters") or [])]:
        if isinstance(entry, Mapping) and entry.get("pod") and entry.get("url") and entry.get("namespace"):
            r = Replica(pod=str(entry["pod"]), url=str(entry["url"]), namespace=str(entry["namespace"]))
            out.setdefault((r.namespace, r.pod), r)
    return list(out.values())


def _alive(replica: Replica, pods: Iterable[PodInfo]) -> bool:
    """Whether the pod of a recorded replica still runs (a router that is gone holds nothing: its registry was
    in memory)."""
    return any(
        p.namespace == replica.namespace and p.name == replica.pod and p.running and not p.terminating for p in pods
    )


async def clean_stale(
    rt: Runtime,
    *,
    recorded: Iterable[Replica],
    current: Iterable[Replica],
    pods: Iterable[PodInfo],
    uid: str,
    drain: float,
    clean: bool,
) -> list[Replica]:
    """Deregister this SMGWorker from replicas that are no longer its routers but still run (spec.router changed,
    or the Service stopped selecting them); the ones still to clean.

    Only when ``clean``, i.e. the current router was found: a Service missing for a moment must not strip the
    workers from replicas that still serve them.  Until then the stale replicas stay recorded."""
    pods = list(pods)
    now = {(r.namespace, r.pod) for r in current}
    stale = [r for r in recorded if (r.namespace, r.pod) not in now and _alive(r, pods)]
    if not clean or not stale:
        return stale
    results = await asyncio.gather(*(_deregister_replica(rt, r, uid=uid, drain=drain) for r in stale))
    left = [r for r, errors in zip(stale, results, strict=True) if errors]
    for r, errors in zip(stale, results, strict=True):
        if not errors:
            log.info("deregistered from former router replica %s/%s", r.namespace, r.pod)
    return left


# -- the finalizer -------------------------------------------------------------------------------------
async def finalize(
    rt: Runtime,
    *,
    namespace: str,
    name: str,
    uid: str,
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
    retry: int,
    pods: PodIndex,
    services: ServiceIndex,
) -> None:
    """Drain and remove this SMGWorker's workers from every replica before the resource goes away.

    Every replica counts: the router Service's, and every replica an earlier pass recorded in ``status`` whose
    pod still runs, so a deleted or changed Service does not leave registrations behind.  The finalizer is
    released only when each of them answered, or is provably gone (its pod no longer runs).  Raises
    ``DeregistrationPending`` while a replica cannot be reached (``retry`` counts the tries before this one): a
    Warning Event on the first try and every tenth, and ``status.lastError`` say so."""
    for _ in range(200):  # let the reconcile loop finish its last pass, so it cannot re-register behind us
        if (namespace, name) not in rt.pokes:
            break
        await asyncio.sleep(0.05)
    all_pods = _pods(pods)
    current, _problem = find_replicas(rt, namespace=namespace, spec=spec, pods=all_pods, services=_services(services))
    seen = {(r.namespace, r.pod) for r in current}
    recorded = trusted_replicas(recorded_replicas(status), pods=all_pods, allowed=rt.settings.allowed_router_services)
    replicas = current + [r for r in recorded if (r.namespace, r.pod) not in seen]
    errors = await deregister_all(rt, replicas, uid=uid, drain=float(spec.get("drainTimeoutSeconds", 30)))
    if errors:
        message = "; ".join(errors)
        if retry == 0 or retry % 10 == 0:
            await rt.kube.post_event(
                namespace=namespace,
                name=name,
                uid=uid,
                type="Warning",
                reason="RouterUnreachable",
                message=f"cannot deregister yet, retrying: {message}",
            )
        await rt.kube.patch_status(namespace, name, {"lastError": f"deregistration pending: {message}"})
        raise DeregistrationPending(f"router unreachable; retrying: {message}", delay=retry_delay(retry))
    rt.metrics.forget(f"{namespace}/{name}")
    rt.generations.pop((namespace, name), None)
    log.info("SMGWorker %s/%s deregistered from %d router replica(s)", namespace, name, len(replicas))


# -- one pass ------------------------------------------------------------------------------------------
def find_replicas(
    rt: Runtime,
    *,
    namespace: str,
    spec: Mapping[str, Any],
    pods: Iterable[PodInfo],
    services: Mapping[tuple[str, str], Mapping[str, str] | None],
) -> tuple[list[Replica], tuple[str, str] | None]:
    """The router replicas of an SMGWorker, or why there are none (reason, message)."""
    s = rt.settings
    target = _target(rt, namespace, spec)
    if target is None:
        return [], ("NoRouterService", "spec.router.service is not set and smg-operator has no --router-service")
    key = (target.namespace, target.service)
    refusal = router_refusal(key, s.allowed_router_services)  # before anything else: no call may go there
    if refusal is not None:
        return [], ("RouterNotAllowed", refusal)
    if key not in services:
        return [], ("RouterServiceNotFound", f"Service {target.namespace}/{target.service} not found")
    replicas = router_replicas(target, services[key], pods)
    if not replicas:
        return [], ("NoRouterReplicas", f"no Ready pod behind Service {target.namespace}/{target.service}")
    return replicas, None


async def reconcile(
    rt: Runtime,
    *,
    namespace: str,
    name: str,
    uid: str,
    spec: Mapping[str, Any],
    pods: Iterable[PodInfo],
    services: Mapping[tuple[str, str], Mapping[str, str] | None],
) -> Observed:
    """One pass over every replica of the SMGWorker's router; an allow-list violation (tenancy) registers nothing:
    a not-allowed router gets no call at all, and a refused static endpoint empties the desired set, so the
    allowed routers lose this SMGWorker's workers until its spec is fixed (never a partial apply)."""
    pods = list(pods)
    desired = desired_workers(namespace=namespace, name=name, uid=uid, spec=spec, pods=pods)
    declaration = desired_declaration(namespace=namespace, name=name, uid=uid, spec=spec)
    refused = refused_endpoints(spec.get("endpoints") or [], rt.settings.allowed_endpoints)
    if refused:
        desired = Desired(workers=(), selected=desired.selected)
        declaration = None
    replicas, problem = find_replicas(rt, namespace=namespace, spec=spec, pods=pods, services=services)
    drain = float(spec.get("drainTimeoutSeconds", 30))
    results = await asyncio.gather(
        *(sync_replica(rt, r, desired, uid=uid, drain=drain, declaration=declaration) for r in replicas)
    )
    conflicts = tuple(sorted({u for _, c in results for u in c}))
    return Observed(
        desired=desired,
        replicas=[r for r, _ in results],
        router_problem=problem,
        conflicts=conflicts,
        endpoint_problem=("EndpointNotAllowed", "; ".join(refused)) if refused else None,
    )


async def sync_replica(
    rt: Runtime, replica: Replica, desired: Desired, *, uid: str, drain: float, declaration: Declaration | None = None
) -> tuple[ReplicaResult, tuple[str, ...]]:
    """Bring one replica to the desired workers, and to the SMGWorker's model declaration (``declaration``: the model
    stays known there with zero workers; a model the SMGWorker no longer names is withdrawn)."""
    routers = rt.routers
    try:
        current = await routers.list_workers(replica.url)
        declared = await routers.list_declared(replica.url)  # the same answer, shared
    except RouterCallError as e:
        return (
            ReplicaResult(pod=replica.pod, url=replica.url, namespace=replica.namespace, reachable=False, error=str(e)),
            (),
        )
    p = plan(desired.workers, current, owner_uid=uid)
    present = {w["url"] for w in current} - {w.url for _, w in p.replace} - set(p.conflicts)
    calls: list[tuple[str | None, Awaitable[object]]] = [(w.url, _add(routers, replica.url, w)) for w in p.add]
    calls += [(w.url, routers.replace(replica.url, wid, w.registration())) for wid, w in p.replace]
    calls += [(None, routers.set_draining(replica.url, wid, draining)) for wid, draining in p.drain]
    owner = declaration.owner if declaration is not None else None
    put, withdraw = plan_declarations(declaration, declared, owner=owner) if owner else (None, ())
    if put is not None:
        calls.append((None, routers.declare(replica.url, put.model, put.body())))
    calls += [(None, routers.withdraw(replica.url, model, owner)) for model in withdraw if owner]
    for wid in p.remove:  # drains run on in the background: a long one must not hold up this pass or others
        _ = rt.remove_later(replica.url, wid, drain=drain)  # its outcome shows in the next pass's GET /workers
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
        log.info(
            "router %s: +%d ~%d -%d (errors: %d)", replica.pod, len(p.add), len(p.replace), len(p.remove), len(errors)
        )
    registered = frozenset(present & {w.url for w in desired.workers})
    return ReplicaResult(
        pod=replica.pod,
        url=replica.url,
        namespace=replica.namespace,
        reachable=reachable,
        registered=registered,
        error="; ".join(errors) or None,
    ), p.conflicts


async def _add(routers: RouterClient, replica: str, worker: DesiredWorker) -> None:
    """Register a worker; one whose pod is annotated ``smg.dev/drain`` is drained at once (a new registration
    is ``pending`` until its first health probe, so it takes no request in between)."""
    worker_id = await routers.register(replica, worker.registration())
    if worker.draining and worker_id is not None:
        await routers.set_draining(replica, worker_id, True)


async def deregister_all(rt: Runtime, replicas: Iterable[Replica], *, uid: str, drain: float) -> list[str]:
    """Drain and remove every worker this SMGWorker owns on every replica; the errors (empty when done)."""
    results = await asyncio.gather(*(_deregister_replica(rt, r, uid=uid, drain=drain) for r in replicas))
    return [e for errs in results for e in errs]


async def _deregister_replica(rt: Runtime, replica: Replica, *, uid: str, drain: float) -> list[str]:
    """Withdraw this SMGWorker's model declarations, then drain and remove its workers on one replica (joining
    removals already in flight).  Another SMGWorker's declaration of the same model stays: the model stays known."""
    try:
        current = await rt.routers.list_workers(replica.url)
        declared = await rt.routers.list_declared(replica.url)
        for model, owner in owned_declarations(declared, owner_uid=uid):
            await rt.routers.withdraw(replica.url, model, owner)
    except RouterCallError as e:
        return [f"{replica.pod}: {e}"]
    tasks = [rt.remove_later(replica.url, wid, drain=drain) for wid in owned_ids(current, owner_uid=uid)]
    return [f"{replica.pod}: {e}" for e in await asyncio.gather(*tasks) if e is not None]
