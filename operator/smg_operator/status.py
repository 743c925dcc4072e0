"""Pure: what a reconcile observed → the SMGWorker's status, conditions and the events worth posting."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NotRequired, TypedDict

from smg_operator.desired import Desired, DesiredWorker

ConditionStatus = Literal["True", "False"]


class Condition(TypedDict):
    """One entry of ``status.conditions`` (the Kubernetes condition shape)."""

    type: str
    status: ConditionStatus
    reason: str
    message: str
    lastTransitionTime: str
    observedGeneration: int | None


class EndpointStatus(TypedDict):
    url: str
    pod: NotRequired[str]
    """Absent for a static endpoint."""
    registered: bool
    """On every router replica."""


class RouterStatus(TypedDict):
    pod: str
    url: str
    namespace: NotRequired[str]
    """The replica pod's namespace (absent in statuses written before it was recorded)."""
    reachable: bool
    registered: int
    """How many of the desired endpoints this replica holds."""
    lastSync: str


class StaleRouter(TypedDict):
    """A former router replica that may still hold this SMGWorker's workers."""

    pod: str
    url: str
    namespace: str


class SMGWorkerStatus(TypedDict):
    """The ``status`` the operator writes (the CRD's status schema)."""

    observedGeneration: int | None
    ready: str
    """``"<serving>/<selected>"``, the printer column READY."""
    readyEndpoints: int
    registeredEndpoints: int
    conditions: list[Condition]
    """Ready first, then EndpointsResolved and Registered."""
    endpoints: list[EndpointStatus]
    routers: list[RouterStatus]
    lastError: str | None
    """None, not "": in a merge patch null removes the field, and the API server reads "" as null too."""
    staleRouters: NotRequired[list[StaleRouter] | None]
    """Replicas that may still hold this SMGWorker's workers though they are no longer its routers (spec.router
    changed, or the Service stopped selecting them): cleaned by the next passes, then dropped; None when clean."""


@dataclass(frozen=True, slots=True)
class ReplicaResult:
    pod: str
    url: str
    reachable: bool
    registered: frozenset[str] = frozenset()
    """Desired URLs present on this replica after the reconcile."""
    error: str | None = None
    namespace: str = ""


@dataclass(frozen=True, slots=True)
class Observed:
    desired: Desired
    replicas: Sequence[ReplicaResult]
    router_problem: tuple[str, str] | None = None
    """(reason, message) when the router itself could not be found (no Service, no Ready replica) or may not be
    called (``RouterNotAllowed``)."""
    conflicts: tuple[str, ...] = field(default=())
    endpoint_problem: tuple[str, str] | None = None
    """(reason, message) when the spec's static endpoints are refused (``EndpointNotAllowed``): nothing desired."""


@dataclass(frozen=True, slots=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


def _condition(
    ctype: str,
    ok: bool,
    reason: str,
    message: str,
    now: str,
    generation: int | None,
    previous: Mapping[str, Mapping[str, Any]],
) -> Condition:
    status: ConditionStatus = "True" if ok else "False"
    old = previous.get(ctype) or {}
    changed = old.get("status") != status
    return {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": now if changed or not old.get("lastTransitionTime") else old["lastTransitionTime"],
        "observedGeneration": generation,
    }


def build_status(
    observed: Observed, *, generation: int | None, now: str, previous: Mapping[str, Any] | None
) -> tuple[SMGWorkerStatus, list[Event]]:
    """The new status, and the events for transitions (router unreachable / recovered, registration failures)."""
    previous = previous or {}
    prev_conditions: dict[str, Mapping[str, Any]] = {
        c["type"]: c for c in previous.get("conditions") or [] if isinstance(c, dict) and isinstance(c.get("type"), str)
    }
    workers = observed.desired.workers
    urls = {w.url for w in workers}
    replicas = observed.replicas
    everywhere = {u for u in urls if replicas and all(u in r.registered for r in replicas)}

    if observed.endpoint_problem is not None:
        reason, message = observed.endpoint_problem
        resolved = _condition("EndpointsResolved", False, reason, message, now, generation, prev_conditions)
    elif workers:
        resolved = _condition(
            "EndpointsResolved",
            True,
            "EndpointsFound",
            f"{len(workers)} endpoint(s) serving",
            now,
            generation,
            prev_conditions,
        )
    else:
        resolved = _condition(
            "EndpointsResolved",
            False,
            "NoMatchingPods",
            "no Running, Ready pod matches the selector and no static endpoint is set",
            now,
            generation,
            prev_conditions,
        )
    reason, message = _registration(observed, urls)
    registered = _condition("Registered", reason == REGISTERED, reason, message, now, generation, prev_conditions)
    cause = resolved if resolved["status"] == "False" else registered
    ok = cause["status"] == "True"
    ready = _condition(
        "Ready",
        ok,
        "Ready" if ok else cause["reason"],
        "serving" if ok else cause["message"],
        now,
        generation,
        prev_conditions,
    )
    errors = [registered["message"]] if registered["status"] == "False" and workers else []
    if observed.conflicts:
        errors.append("registered by someone else, left alone: " + ", ".join(observed.conflicts))
    status: SMGWorkerStatus = {
        "observedGeneration": generation,
        "ready": f"{len(workers)}/{observed.desired.selected}",
        "readyEndpoints": len(workers),
        "registeredEndpoints": len(everywhere),
        "conditions": [ready, resolved, registered],
        "endpoints": [_endpoint(w, registered=w.url in everywhere) for w in workers],
        "routers": [
            {
                "pod": r.pod,
                "url": r.url,
                "namespace": r.namespace,
                "reachable": r.reachable,
                "registered": len(r.registered & urls),
                "lastSync": now,
            }
            for r in replicas
        ],
        "lastError": "; ".join(errors) or None,
    }
    events = _events(prev_conditions.get("Registered"), registered)
    was = (prev_conditions.get("EndpointsResolved") or {}).get("reason")
    if observed.endpoint_problem is not None and was != resolved["reason"]:
        events.insert(0, Event("Warning", resolved["reason"], resolved["message"]))
    return status, events


REGISTERED = "RegisteredOnAllReplicas"


def _registration(observed: Observed, urls: set[str]) -> tuple[str, str]:
    """The Registered condition's (reason, message): ``REGISTERED`` only when every desired endpoint is on every
    replica; otherwise the first that holds of: the router is missing or not allowed; no replica answered
    (``NoRouterReachable``); none of the endpoints is on any replica (``NotRegistered``); some replica did not
    answer (``RouterUnreachable``); the replicas hold different sets (``ReplicasDisagree``); some endpoint is on
    no replica (``RegistrationFailed``)."""
    if observed.router_problem is not None:
        return observed.router_problem
    replicas = observed.replicas
    unreachable = [r for r in replicas if not r.reachable]
    reachable = [r for r in replicas if r.reachable]
    errors = "; ".join(r.error for r in replicas if r.error)
    if not reachable:
        detail = "; ".join(f"{r.pod} ({r.url}): {r.error}" for r in unreachable) or "no router replica"
        return "NoRouterReachable", f"no router replica answered: {detail}"
    held = [r.registered & urls for r in reachable]
    if urls and not any(held):
        return "NotRegistered", f"none of {len(urls)} endpoint(s) is on any router replica" + (
            f": {errors}" if errors else ""
        )
    if unreachable:
        return "RouterUnreachable", "; ".join(f"{r.pod} ({r.url}): {r.error}" for r in unreachable)
    if any(h != held[0] for h in held):
        counts = ", ".join(f"{r.pod} {len(h)}/{len(urls)}" for r, h in zip(reachable, held, strict=True))
        return "ReplicasDisagree", f"router replicas hold different endpoints ({counts})" + (
            f": {errors}" if errors else ""
        )
    if held[0] != urls:
        return "RegistrationFailed", errors or "some endpoints are not registered yet"
    return REGISTERED, f"{len(urls)} endpoint(s) on {len(replicas)} router replica(s)"


def _endpoint(worker: DesiredWorker, *, registered: bool) -> EndpointStatus:
    if worker.pod:
        return {"url": worker.url, "pod": worker.pod, "registered": registered}
    return {"url": worker.url, "registered": registered}


def _events(before: Mapping[str, Any] | None, after: Condition) -> list[Event]:
    was = (before or {}).get("reason")
    now_reason = after["reason"]
    if after["status"] == "False" and was != now_reason:
        return [Event("Warning", now_reason, after["message"])]
    if after["status"] == "True" and before is not None and before.get("status") == "False":
        return [Event("Normal", "Recovered", f"registered again after {was}: {after['message']}")]
    return []


def differs(new: Mapping[str, Any], old: Mapping[str, Any]) -> bool:
    """Whether writing ``new`` over ``old`` changes more than the sync times (``routers[].lastSync`` and the
    conditions' ``lastTransitionTime``); a null field counts as an absent one, as in a merge patch."""
    return _without_sync_times(new) != _without_sync_times(old)


def _without_sync_times(status: Mapping[str, Any]) -> dict[str, Any]:
    s = {k: v for k, v in status.items() if v is not None}
    s["routers"] = [{k: v for k, v in r.items() if k != "lastSync"} for r in s.get("routers") or []]
    s["conditions"] = [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in s.get("conditions") or []]
    return s
