"""kopf handlers only, thin: indexes of pods and services, event pokes, one reconcile loop per SMGWorker
(a kopf daemon), and the finalizer.  The logic they call lives in ``reconciler``, ``desired`` and ``status``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

import kopf

from smg_operator import k8s
from smg_operator.desired import GROUP, PLURAL, VERSION, PodInfo, pod_info
from smg_operator.reconciler import Runtime, deregister_all, find_replicas, reconcile
from smg_operator.status import build_status

log = logging.getLogger(__name__)
STATUS_REFRESH = 60.0
"""Rewrite an unchanged status at most this often (keeps routers[].lastSync honest without a write per loop)."""


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = "smg.dev/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="smg.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="smg.dev")
    settings.posting.level = logging.WARNING  # our own Events say what matters; no "handler succeeded" noise
    settings.watching.server_timeout = 300


@kopf.index("pods")
def pods_index(body: kopf.Body, namespace: str, **_: Any) -> dict[str, PodInfo]:
    return {namespace: pod_info(body)}


@kopf.index("services")
def services_index(namespace: str, name: str, spec: kopf.Spec, **_: Any) -> dict[tuple[str, str], dict[str, str]]:
    return {(namespace, name): dict(spec.get("selector") or {})}


@kopf.on.event("pods")
def pod_changed(memo: kopf.Memo, **_: Any) -> None:
    memo.runtime.poke()


@kopf.on.event("services")
def service_changed(memo: kopf.Memo, **_: Any) -> None:
    memo.runtime.poke()


@kopf.on.event(GROUP, VERSION, PLURAL)
def smgworker_changed(namespace: str, name: str, meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
    rt: Runtime = memo.runtime
    generation = meta.get("generation")
    if rt.generations.get((namespace, name)) != generation:  # a spec change, not our own status write
        rt.generations[(namespace, name)] = generation
        rt.poke((namespace, name))


def _pods(index: kopf.Index) -> list[PodInfo]:
    return [pod for store in index.values() for pod in store]


def _services(index: kopf.Index) -> dict[tuple[str, str], Mapping[str, str] | None]:
    return {key: next(iter(store), None) for key, store in index.items()}


# cancellation_backoff: on deletion, let a pass in flight finish (the finalizer waits for it) rather than be cancelled
@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_backoff=5.0, cancellation_timeout=10.0)
async def keep_registered(namespace: str, name: str, uid: str, body: kopf.Body, stopped: kopf.DaemonStopped,
                          pods_index: kopf.Index, services_index: kopf.Index, memo: kopf.Memo, **_: Any) -> None:
    """The reconcile loop of one SMGWorker: on every poke (pod, service or spec change) and every interval."""
    rt: Runtime = memo.runtime
    key = (namespace, name)
    poke = rt.pokes.setdefault(key, asyncio.Event())
    last_write = 0.0
    try:
        while not stopped and not body.meta.get("deletionTimestamp"):
            poke.clear()
            try:
                last_write = await _reconcile_once(rt, namespace=namespace, name=name, uid=uid, body=body,
                                                   pods_index=pods_index, services_index=services_index,
                                                   last_write=last_write)
            except Exception:  # one bad reconcile must not end the loop; the next one retries
                rt.metrics.reconciles.labels("error").inc()
                log.exception("reconcile of %s/%s failed", namespace, name)
            await _wait_any(poke, stopped, interval=rt.settings.reconcile_interval)
    finally:
        rt.pokes.pop(key, None)


async def _wait_any(poke: asyncio.Event, stopped: kopf.DaemonStopped, *, interval: float) -> None:
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


async def _reconcile_once(rt: Runtime, *, namespace: str, name: str, uid: str, body: kopf.Body,
                          pods_index: kopf.Index, services_index: kopf.Index, last_write: float) -> float:
    observed = await reconcile(rt, namespace=namespace, name=name, uid=uid, spec=body.get("spec", {}),
                               pods=_pods(pods_index), services=_services(services_index))
    previous = body.get("status") or {}
    status, events = build_status(observed, generation=body.meta.get("generation"), now=k8s.now_iso(),
                                  previous=previous)
    ready = status["conditions"][0]["status"] == "True"
    rt.metrics.reconciles.labels("ok" if ready else "degraded").inc()
    rt.metrics.registered.labels(f"{namespace}/{name}").set(status["registeredEndpoints"])
    if _without_sync_times(status) != _without_sync_times(previous) or time.monotonic() - last_write > STATUS_REFRESH:
        if not await k8s.patch_status(namespace, name, status):
            return last_write  # deleted meanwhile
        last_write = time.monotonic()
    for event in events:
        await k8s.post_event(namespace=namespace, name=name, uid=uid, type=event.type, reason=event.reason,
                             message=event.message)
    return last_write


def _without_sync_times(status: Mapping[str, Any]) -> Any:
    s = {k: v for k, v in status.items() if v is not None}  # a null field is an absent one
    s["routers"] = [{k: v for k, v in r.items() if k != "lastSync"} for r in s.get("routers") or []]
    s["conditions"] = [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in s.get("conditions") or []]
    return s


@kopf.on.delete(GROUP, VERSION, PLURAL)
async def deregister(namespace: str, name: str, uid: str, spec: kopf.Spec, retry: int, pods_index: kopf.Index,
                     services_index: kopf.Index, memo: kopf.Memo, **_: Any) -> None:
    """Finalizer: drain and remove this SMGWorker's workers from every replica before the resource goes away."""
    rt: Runtime = memo.runtime
    for _ in range(200):  # let the reconcile loop finish its last pass, so it cannot re-register behind us
        if (namespace, name) not in rt.pokes:
            break
        await asyncio.sleep(0.05)
    replicas, _problem = find_replicas(rt, namespace=namespace, spec=spec, pods=_pods(pods_index),
                                       services=_services(services_index))
    errors = await deregister_all(rt, replicas, uid=uid, drain=float(spec.get("drainTimeoutSeconds", 30)))
    if errors:
        message = "; ".join(errors)
        if retry == 0 or retry % 10 == 0:
            await k8s.post_event(namespace=namespace, name=name, uid=uid, type="Warning",
                                 reason="RouterUnreachable", message=f"cannot deregister yet, retrying: {message}")
        await k8s.patch_status(namespace, name, {"lastError": f"deregistration pending: {message}"})
        raise kopf.TemporaryError(f"router unreachable; retrying: {message}", delay=min(2.0 ** min(retry, 5), 30.0))
    rt.metrics.forget(f"{namespace}/{name}")
    rt.generations.pop((namespace, name), None)
    log.info("SMGWorker %s/%s deregistered from %d router replica(s)", namespace, name, len(replicas))
