"""Pure: an InferencePool (Gateway API Inference Extension, ``inference.networking.k8s.io/v1``) + pods → the
desired worker set, in the same ``desired.Desired`` shape an SMGWorker gives, so ``reconciler.sync_replica``
carries it out unchanged.

The gateway owns the pool (its status above all); the operator only reads it.  Which pools it takes: with
``--inference-pools annotated`` those annotated ``smg.dev/router: <the operator's --router-service>``, with
``--inference-pools all`` every pool in the watched namespaces.  Each READY pod times each ``spec.targetPorts``
number (a data-parallel rank) is one worker, with the pool's model from the annotation ``smg.dev/model`` (else
the label of that name) and the role ``smg.dev/role`` (default ``regular``).  A pool without a model, or with a
role the router does not know, registers nothing and says why (``PoolProblem``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from smg_operator.desired import (
    DRAIN_ANNOTATION,
    MANAGED_BY,
    OPERATOR,
    OWNER_NAME,
    OWNER_UID,
    POD_NAME,
    POD_UID,
    Desired,
    DesiredWorker,
    PodInfo,
    http_url,
    selector_matches,
)

POOL_GROUP, POOL_VERSION, POOL_PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
POOL_KIND = "InferencePool"
ROUTER_ANNOTATION = "smg.dev/router"
"""On a pool: the router Service (name) that takes its pods, in ``annotated`` mode."""
MODEL_KEY = "smg.dev/model"
"""Annotation (else label) on a pool: the model its workers serve.  An annotation first: a label value cannot
hold a ``/``, which most model names have."""
ROLE_ANNOTATION = "smg.dev/role"
POOL_LABEL = "smg.dev/inferencepool"
"""Label of every worker registered for a pool (``<namespace>.<name>``): marks the workers the pool source owns,
so that those of a pool that went can be found and removed."""
TARGET_PORT_LABEL = "smg.dev/target-port"
ROLES = ("regular", "prefill", "decode")
MODES = ("off", "annotated", "all")
"""``--inference-pools``: off (the default: the CRD may be absent), annotated pools only, or every pool."""


@dataclass(frozen=True, slots=True)
class PoolInfo:
    """What the operator keeps of an InferencePool (kopf's pool index holds these)."""

    namespace: str
    name: str
    uid: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    match_labels: Mapping[str, str]
    target_ports: tuple[int, ...]

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)


def pool_info(body: Mapping[str, Any]) -> PoolInfo:
    meta, spec = body.get("metadata") or {}, body.get("spec") or {}
    selector = spec.get("selector") or {}
    ports: list[int] = []
    for entry in spec.get("targetPorts") or []:
        number = entry.get("number") if isinstance(entry, Mapping) else None
        if isinstance(number, int) and not isinstance(number, bool) and 0 < number < 65536 and number not in ports:
            ports.append(number)
    return PoolInfo(
        namespace=meta.get("namespace", ""),
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        labels=dict(meta.get("labels") or {}),
        annotations=dict(meta.get("annotations") or {}),
        match_labels=dict(selector.get("matchLabels") or {}) if isinstance(selector, Mapping) else {},
        target_ports=tuple(ports),
    )


def takes(pool: PoolInfo, *, mode: str, router_service: str | None) -> bool:
    """Whether the operator registers this pool's pods: every pool (``all``), or those that name its router."""
    if mode == "all":
        return True
    if mode == "annotated":
        return router_service is not None and pool.annotations.get(ROUTER_ANNOTATION, "").strip() == router_service
    return False


@dataclass(frozen=True, slots=True)
class PoolProblem:
    """Why a pool registers nothing: an Event reason and its message."""

    reason: str
    message: str


def pool_model(pool: PoolInfo) -> str | None:
    model = (pool.annotations.get(MODEL_KEY) or pool.labels.get(MODEL_KEY) or "").strip()
    return model or None


def pool_desired(pool: PoolInfo, pods: Iterable[PodInfo]) -> tuple[Desired, PoolProblem | None]:
    """The workers a pool asks for: each serving selected pod at each target port; nothing, and why, when the pool
    lacks what a registration needs."""
    selected = [p for p in pods if p.namespace == pool.namespace and _selects(pool, p)]
    model = pool_model(pool)
    if model is None:
        return Desired(workers=(), selected=len(selected)), PoolProblem(
            "ModelMissing",
            f"InferencePool {pool.namespace}/{pool.name} has no model: set the annotation {MODEL_KEY}; "
            "no worker is registered",
        )
    role = pool.annotations.get(ROLE_ANNOTATION, "regular").strip() or "regular"
    if role not in ROLES:
        return Desired(workers=(), selected=len(selected)), PoolProblem(
            "RoleInvalid",
            f"InferencePool {pool.namespace}/{pool.name}: annotation {ROLE_ANNOTATION}={role!r} is not one of "
            f"{', '.join(ROLES)}; no worker is registered",
        )
    owner_name = f"{pool.namespace}.{pool.name}"
    base = {MANAGED_BY: OPERATOR, OWNER_NAME: owner_name, OWNER_UID: pool.uid, POOL_LABEL: owner_name}
    out: dict[str, DesiredWorker] = {}
    for pod in sorted(selected, key=lambda p: p.name):
        if not pod.serving or not pod.ip:
            continue
        for port in pool.target_ports:
            url = http_url(pod.ip, port)
            out[url] = DesiredWorker(
                url=url,
                role=role,
                model_id=model,
                bootstrap_port=None,
                labels={**base, POD_NAME: pod.name, POD_UID: pod.uid, TARGET_PORT_LABEL: str(port)},
                owner=f"{OPERATOR}:inferencepool/{pool.namespace}/{pool.name}",
                pod=pod.name,
                draining=pod.annotations.get(DRAIN_ANNOTATION, "").strip().lower() == "true",
            )
    return Desired(workers=tuple(out.values()), selected=len(selected)), None


def _selects(pool: PoolInfo, pod: PodInfo) -> bool:
    return selector_matches({"matchLabels": dict(pool.match_labels)}, pod.labels)


def orphaned_ids(current: Iterable[Mapping[str, Any]], *, keep: Iterable[str]) -> list[str]:
    """Ids of pool workers (``POOL_LABEL``) on one replica whose pool (by UID) is not among ``keep``: the pool
    went, or stopped naming this router.  Workers of SMGWorkers and of people carry no ``POOL_LABEL``."""
    kept = set(keep)
    return [
        str(w["id"])
        for w in current
        if (labels := w.get("labels") or {}).get(POOL_LABEL) and labels.get(OWNER_UID) not in kept
    ]
