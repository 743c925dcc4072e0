"""Pure: SMGWorker + pods → the desired worker set; router pods → replicas; desired vs. current → a plan.

No I/O here: the handlers feed these functions what kopf's indexes hold, and ``reconciler`` carries out
the plans.  Everything a router registration carries is decided in this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

GROUP, VERSION, PLURAL = "smg.dev", "v1alpha1", "smgworkers"
BOOTSTRAP_ANNOTATION = "sglang.ai/bootstrap-port"
DRAIN_ANNOTATION = "smg.dev/drain"
"""``"true"`` on a pod: its worker stays registered but drained on every replica (no new requests, in-flight
finish) until the annotation goes; a way to take a pod out of rotation without deleting it."""
MANAGED_BY = "smg.dev/managed-by"
OWNER_NAME = "smg.dev/smgworker"
OWNER_UID = "smg.dev/smgworker-uid"
POD_NAME = "smg.dev/pod"
POD_UID = "smg.dev/pod-uid"
OPERATOR = "smg-operator"


@dataclass(frozen=True, slots=True)
class PodInfo:
    """What the operator keeps of a Pod (kopf's pod index holds these)."""

    namespace: str
    name: str
    uid: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    ip: str | None
    running: bool
    ready: bool
    terminating: bool

    @property
    def serving(self) -> bool:
        """Running, Ready, with an IP, and not on its way out: the only pods that get traffic."""
        return self.running and self.ready and not self.terminating and bool(self.ip)


def pod_info(body: Mapping[str, Any]) -> PodInfo:
    meta, status = body.get("metadata", {}), body.get("status", {}) or {}
    conditions = status.get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return PodInfo(
        namespace=meta.get("namespace", ""),
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        labels=dict(meta.get("labels") or {}),
        annotations=dict(meta.get("annotations") or {}),
        ip=status.get("podIP"),
        running=status.get("phase") == "Running",
        ready=ready,
        terminating=meta.get("deletionTimestamp") is not None,
    )


def selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels AND every matchExpression); an empty selector matches
    nothing here, because an SMGWorker that forgot its selector must not grab every pod of the namespace."""
    if not selector:
        return False
    match_labels = selector.get("matchLabels") or {}
    expressions = selector.get("matchExpressions") or []
    if not match_labels and not expressions:
        return False
    if any(labels.get(k) != v for k, v in match_labels.items()):
        return False
    for e in expressions:
        key, op, values = e.get("key"), e.get("operator"), e.get("values") or []
        has = key in labels
        if (
            (op == "In" and not (has and labels[key] in values))
            or (op == "NotIn" and has and labels[key] in values)
            or (op == "Exists" and not has)
            or (op == "DoesNotExist" and has)
        ):
            return False
    return True


def http_url(ip: str, port: int) -> str:
    """``http://IP:PORT``, an IPv6 address in brackets (``http://[fd00::5]:8000``) as RFC 3986 wants it: without
    them the URL does not parse, and an IPv6 cluster would register nothing."""
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}"


@dataclass(frozen=True, slots=True)
class DesiredWorker:
    """One registration the operator wants on every router replica."""

    url: str
    role: str
    model_id: str
    bootstrap_port: int | None
    labels: Mapping[str, str]
    owner: str
    pod: str | None = None
    kv_capacity_tokens: int | None = None
    """``spec.kvCapacityTokens``: the engine's usable KV cache in tokens, which caps the worker's tree share on the
    router in place of what the engine reports."""
    draining: bool = False
    """The pod carries ``smg.dev/drain: "true"``: registered, but draining (PATCH ``draining``)."""
    kv_events: Mapping[str, Any] | None = None
    """``spec.kvEvents`` made concrete for this endpoint: where its engine publishes its KV events (``tcp://<pod
    IP>:<port>``), where it replays them, the topic."""

    def registration(self) -> dict[str, Any]:
        """The POST /workers (and PUT) body.  ``kv_capacity_tokens`` only when set: a router that predates the field
        refuses it, and a PUT without it clears it."""
        body: dict[str, Any] = {
            "url": self.url,
            "role": self.role,
            "model_id": self.model_id,
            "bootstrap_port": self.bootstrap_port,
            "labels": dict(self.labels),
            "owner": self.owner,
        }
        if self.kv_capacity_tokens is not None:
            body["kv_capacity_tokens"] = self.kv_capacity_tokens
        if self.kv_events is not None:
            body["kv_events"] = dict(self.kv_events)
        return body


@dataclass(frozen=True, slots=True)
class Desired:
    workers: tuple[DesiredWorker, ...]
    selected: int
    """Pods the selector matches (ready or not) plus static endpoints: the denominator of "ready x/y"."""


def _bootstrap_port(spec: Mapping[str, Any], pod: PodInfo | None) -> int | None:
    if pod is not None:
        raw = pod.annotations.get(BOOTSTRAP_ANNOTATION)
        if raw is not None and raw.strip().isdigit() and 0 < int(raw) < 65536:
            return int(raw)
    port = spec.get("bootstrapPort")
    return int(port) if isinstance(port, int) else None


def kv_events_at(host: str, spec: Mapping[str, Any]) -> dict[str, Any] | None:
    """``spec.kvEvents`` for the engine at ``host`` (a pod IP, or a static endpoint's host): the router's
    ``kv_events`` field, or None when the SMGWorker has none."""
    events = spec.get("kvEvents")
    if not isinstance(events, Mapping) or not isinstance(events.get("port"), int):
        return None
    where = f"[{host}]" if ":" in host and not host.startswith("[") else host
    replay = events.get("replayPort")
    return {
        "endpoint": f"tcp://{where}:{events['port']}",
        "replay_endpoint": f"tcp://{where}:{replay}" if isinstance(replay, int) else None,
        "topic": events.get("topic") or "",
    }


def desired_workers(
    *, namespace: str, name: str, uid: str, spec: Mapping[str, Any], pods: Iterable[PodInfo]
) -> Desired:
    """The workers an SMGWorker asks for: its serving selected pods, plus its static endpoints."""
    role, model = spec.get("role", "regular"), spec.get("model", "")
    port = int(spec.get("port") or 8000)
    base = {**(spec.get("labels") or {}), MANAGED_BY: OPERATOR, OWNER_NAME: f"{namespace}.{name}", OWNER_UID: uid}
    if spec.get("policy"):
        base["policy"] = spec["policy"]
    owner = f"{OPERATOR}:{namespace}/{name}"
    kv = spec.get("kvCapacityTokens")
    kv_tokens = kv if isinstance(kv, int) and not isinstance(kv, bool) and kv > 0 else None  # the CRD says >= 1
    selected = [p for p in pods if p.namespace == namespace and selector_matches(spec.get("selector"), p.labels)]
    out: dict[str, DesiredWorker] = {}
    for pod in sorted(selected, key=lambda p: p.name):
        if not pod.serving or not pod.ip:
            continue
        url = http_url(pod.ip, port)
        out[url] = DesiredWorker(
            url=url,
            role=role,
            model_id=model,
            bootstrap_port=_bootstrap_port(spec, pod),
            labels={**base, POD_NAME: pod.name, POD_UID: pod.uid},
            owner=owner,
            pod=pod.name,
            kv_capacity_tokens=kv_tokens,
            draining=pod.annotations.get(DRAIN_ANNOTATION, "").strip().lower() == "true",
            kv_events=kv_events_at(pod.ip, spec),
        )
    endpoints = [str(e).rstrip("/") for e in spec.get("endpoints") or []]
    for url in endpoints:
        out.setdefault(
            url,
            DesiredWorker(
                url=url,
                role=role,
                model_id=model,
                bootstrap_port=_bootstrap_port(spec, None),
                labels=base,
                owner=owner,
                kv_capacity_tokens=kv_tokens,
                kv_events=kv_events_at(urlsplit(url).hostname or "", spec),
            ),
        )
    return Desired(workers=tuple(out.values()), selected=len(selected) + len(set(endpoints)))


@dataclass(frozen=True, slots=True)
class RouterTarget:
    """Where an SMGWorker's router replicas are found."""

    service: str
    namespace: str
    port: int


def router_target(
    *,
    namespace: str,
    spec: Mapping[str, Any],
    default_service: str | None,
    default_namespace: str | None,
    default_port: int,
) -> RouterTarget | None:
    router = spec.get("router") or {}
    service = router.get("service") or default_service
    if not service:
        return None
    return RouterTarget(
        service=service,
        namespace=router.get("namespace") or default_namespace or namespace,
        port=int(router.get("port") or default_port),
    )


@dataclass(frozen=True, slots=True)
class Replica:
    pod: str
    url: str
    namespace: str = ""


def router_replicas(
    target: RouterTarget, service_selector: Mapping[str, str] | None, pods: Iterable[PodInfo]
) -> list[Replica]:
    """The running pods the router Service selects, Ready or not.

    Not only the Ready ones: a router is Ready (``/readiness``) only once it has a routable worker, and it gets
    its workers from us, so waiting for Ready would leave a new replica empty forever.  Terminating pods are
    left out: they are on their way out.
    """
    if not service_selector:
        return []
    selector = {"matchLabels": dict(service_selector)}
    return sorted(
        (
            Replica(pod=p.name, url=http_url(p.ip, target.port), namespace=p.namespace)
            for p in pods
            if p.namespace == target.namespace
            and p.running
            and p.ip
            and not p.terminating
            and selector_matches(selector, p.labels)
        ),
        key=lambda r: r.pod,
    )


@dataclass(frozen=True, slots=True)
class Plan:
    """What to do on one router replica: register, replace (same URL, new spec), remove (by worker id), and
    drain or undrain (by worker id) the ones whose pod's ``smg.dev/drain`` annotation changed."""

    add: tuple[DesiredWorker, ...] = ()
    replace: tuple[tuple[str, DesiredWorker], ...] = ()
    remove: tuple[str, ...] = ()
    drain: tuple[tuple[str, bool], ...] = ()
    conflicts: tuple[str, ...] = field(default=())
    """URLs wanted but registered there by someone else: left alone and reported."""

    @property
    def empty(self) -> bool:
        return not (self.add or self.replace or self.remove or self.drain)


def _same(current: Mapping[str, Any], want: DesiredWorker) -> bool:
    return (
        current.get("role"),
        current.get("model_id"),
        current.get("bootstrap_port"),
        current.get("labels") or {},
        current.get("owner"),
        current.get("kv_capacity_tokens"),
        current.get("kv_events"),
    ) == (
        want.role,
        want.model_id,
        want.bootstrap_port,
        dict(want.labels),
        want.owner,
        want.kv_capacity_tokens,
        None if want.kv_events is None else dict(want.kv_events),
    )


def plan(desired: Iterable[DesiredWorker], current: Iterable[Mapping[str, Any]], *, owner_uid: str) -> Plan:
    """Diff one replica's ``GET /workers`` against the desired set; touch only workers this SMGWorker owns."""
    want = {w.url: w for w in desired}
    add: list[DesiredWorker] = []
    replace: list[tuple[str, DesiredWorker]] = []
    remove: list[str] = []
    drain: list[tuple[str, bool]] = []
    conflicts: list[str] = []
    seen: set[str] = set()
    for cur in current:
        url, labels = cur.get("url"), cur.get("labels") or {}
        mine = labels.get(OWNER_UID) == owner_uid
        if url in want:
            seen.add(url)
            if not mine:
                conflicts.append(url)
            else:
                if not _same(cur, want[url]):
                    replace.append((cur["id"], want[url]))
                if (cur.get("status") == "draining") != want[url].draining:
                    drain.append((cur["id"], want[url].draining))
        elif mine:
            remove.append(cur["id"])
    add = [w for url, w in want.items() if url not in seen]
    return Plan(
        add=tuple(add), replace=tuple(replace), remove=tuple(remove), drain=tuple(drain), conflicts=tuple(conflicts)
    )


def owned_ids(current: Iterable[Mapping[str, Any]], *, owner_uid: str) -> list[str]:
    return [w["id"] for w in current if (w.get("labels") or {}).get(OWNER_UID) == owner_uid]


# -- model declarations (scale from zero) -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Declaration:
    """The model an SMGWorker keeps known on every router replica, pods or none (``PUT /models/{model}``): a request
    for it then waits for a worker (the router's ``--hold-when-empty``) instead of a 404 once the pool is at zero."""

    model: str
    role: str
    owner: str
    """This SMGWorker's, by namespace, name and UID: the router keeps the model while any owner declares it, so two
    SMGWorkers of one model (prefill and decode) withdraw independently."""

    def body(self) -> dict[str, str]:
        return {"role": self.role, "owner": self.owner}


def declaration_owner(*, namespace: str, name: str, uid: str) -> str:
    return f"{OPERATOR}:{namespace}/{name}@{uid}"


def desired_declaration(*, namespace: str, name: str, uid: str, spec: Mapping[str, Any]) -> Declaration | None:
    """The declaration of an SMGWorker's model (None without a model: the CRD requires one)."""
    model = spec.get("model")
    if not isinstance(model, str) or not model:
        return None
    return Declaration(
        model=model,
        role=spec.get("role") or "regular",
        owner=declaration_owner(namespace=namespace, name=name, uid=uid),
    )


def plan_declarations(
    want: Declaration | None, declared: Iterable[Mapping[str, Any]], *, owner: str
) -> tuple[Declaration | None, tuple[str, ...]]:
    """Diff one replica's ``declared_models`` (of ``GET /workers``) against the wanted declaration: the declaration
    to PUT (None: it is there as wanted) and the models whose declaration by ``owner`` to withdraw (a model the
    SMGWorker no longer names); never another owner's."""
    mine: dict[str, str | None] = {}
    for entry in declared:
        for d in entry.get("declarations") or ():
            if isinstance(d, Mapping) and d.get("owner") == owner and isinstance(entry.get("model"), str):
                mine[entry["model"]] = d.get("role")
    put = None if want is None or mine.get(want.model, "") == want.role else want
    withdraw = tuple(sorted(m for m in mine if want is None or m != want.model))
    return put, withdraw


def owned_declarations(declared: Iterable[Mapping[str, Any]], *, owner_uid: str) -> list[tuple[str, str]]:
    """(model, owner) of every declaration on a replica by the SMGWorker of this UID (its finalizer withdraws them)."""
    suffix = f"@{owner_uid}"
    return [
        (entry["model"], d["owner"])
        for entry in declared
        if isinstance(entry.get("model"), str)
        for d in entry.get("declarations") or ()
        if isinstance(d, Mapping) and isinstance(d.get("owner"), str) and d["owner"].endswith(suffix)
    ]
