"""kopf handlers only, thin: indexes of pods and services, event pokes, one reconcile loop per SMGWorker
(a kopf daemon), and the finalizer.  Each unpacks kopf's kwargs, calls ``reconciler`` and translates the
outcome for kopf; the logic lives in ``reconciler``, ``desired`` and ``status``."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kopf

from smg_operator import reconciler
from smg_operator.desired import GROUP, PLURAL, VERSION, PodInfo, pod_info
from smg_operator.reconciler import DeregistrationPending, Runtime

PodIndex = kopf.Index[str, PodInfo]
ServiceIndex = kopf.Index[tuple[str, str], dict[str, str]]


def _runtime(memo: kopf.Memo) -> Runtime:
    rt: Runtime = memo.runtime  # put there by __main__ (kopf.Memo's attributes are untyped)
    return rt


def _indexes(kwargs: Mapping[str, Any]) -> tuple[PodIndex, ServiceIndex]:
    """kopf passes every index to every handler, as a kwarg named after its function; its handler protocols
    cannot name them, so they are taken from ``**kwargs`` here."""
    pods: PodIndex = kwargs["pods_index"]
    services: ServiceIndex = kwargs["services_index"]
    return pods, services


def _namespace(namespace: str | None) -> str:
    """Pods, Services and SMGWorkers are namespaced: kopf passes None only for cluster-scoped resources."""
    if namespace is None:
        raise kopf.PermanentError("a namespaced resource arrived without a namespace")
    return namespace


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = "smg.dev/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="smg.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="smg.dev")
    settings.posting.level = logging.WARNING  # our own Events say what matters; no "handler succeeded" noise
    settings.watching.server_timeout = 300


@kopf.index("pods")
def pods_index(body: kopf.Body, namespace: str | None, **_: Any) -> dict[str, PodInfo]:
    return {_namespace(namespace): pod_info(body)}


@kopf.index("services")
def services_index(
    namespace: str | None, name: str, spec: kopf.Spec, **_: Any
) -> dict[tuple[str, str], dict[str, str]]:
    return {(_namespace(namespace), name): dict(spec.get("selector") or {})}


@kopf.on.event("pods")
def pod_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Wakes only the SMGWorkers the pod concerns (its selectors, its router Service, its former owner)."""
    _runtime(memo).poke_pod(pod_info(body))


@kopf.on.event("services")
def service_changed(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    _runtime(memo).poke_service(_namespace(namespace), name)


@kopf.on.event(GROUP, VERSION, PLURAL)
def smgworker_changed(namespace: str | None, name: str, meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
    _runtime(memo).generation_seen((_namespace(namespace), name), meta.get("generation"))


# cancellation_backoff: on deletion, let a pass in flight finish (the finalizer waits for it) rather than be cancelled
@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_backoff=5.0, cancellation_timeout=10.0)
async def keep_registered(
    namespace: str | None,
    name: str,
    uid: str,
    body: kopf.Body,
    stopped: kopf.DaemonStopped,
    memo: kopf.Memo,
    **kwargs: Any,
) -> None:
    """The reconcile loop of one SMGWorker: on every poke (pod, service or spec change) and every interval."""
    pods, services = _indexes(kwargs)
    await reconciler.keep_registered(
        _runtime(memo),
        namespace=_namespace(namespace),
        name=name,
        uid=uid,
        body=body,
        stopped=stopped,
        pods=pods,
        services=services,
    )


@kopf.on.delete(GROUP, VERSION, PLURAL)
async def deregister(
    namespace: str | None,
    name: str,
    uid: str,
    spec: kopf.Spec,
    status: kopf.Status,
    retry: int,
    memo: kopf.Memo,
    **kwargs: Any,
) -> None:
    """Finalizer: drain and remove this SMGWorker's workers from every replica before the resource goes away."""
    pods, services = _indexes(kwargs)
    try:
        await reconciler.finalize(
            _runtime(memo),
            namespace=_namespace(namespace),
            name=name,
            uid=uid,
            spec=spec,
            status=status,
            retry=retry,
            pods=pods,
            services=services,
        )
    except DeregistrationPending as e:
        raise kopf.TemporaryError(str(e), delay=e.delay) from None
