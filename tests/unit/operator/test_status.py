"""Pure status building: conditions with reasons, counts, and events only on transitions."""

from __future__ import annotations

from smg_operator.desired import Desired, DesiredWorker
from smg_operator.status import Observed, ReplicaResult, build_status, differs

W = [
    DesiredWorker(
        url=f"http://127.0.0.{i}:8000",
        role="regular",
        model_id="m",
        bootstrap_port=None,
        labels={},
        owner="o",
        pod=f"p{i}",
    )
    for i in (2, 3)
]
URLS = frozenset(w.url for w in W)


def conditions(status):
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_all_registered_is_ready() -> None:
    obs = Observed(
        desired=Desired(tuple(W), 2),
        replicas=[ReplicaResult("r1", "u1", True, URLS), ReplicaResult("r2", "u2", True, URLS)],
    )
    status, events = build_status(obs, generation=3, now="T1", previous=None)
    assert conditions(status) == {
        "Ready": ("True", "Ready"),
        "EndpointsResolved": ("True", "EndpointsFound"),
        "Registered": ("True", "RegisteredOnAllReplicas"),
    }
    assert status["ready"] == "2/2" and status["registeredEndpoints"] == 2 and status["observedGeneration"] == 3
    assert all(e["registered"] for e in status["endpoints"]) and events == []


def test_unreachable_router_is_reported_once_then_recovered() -> None:
    bad = Observed(
        desired=Desired(tuple(W), 3),
        replicas=[ReplicaResult("r1", "u1", True, URLS), ReplicaResult("r2", "u2", False, error="refused")],
    )
    status, events = build_status(bad, generation=1, now="T1", previous=None)
    assert conditions(status)["Registered"] == ("False", "RouterUnreachable")
    assert conditions(status)["Ready"] == ("False", "RouterUnreachable")
    assert status["ready"] == "2/3" and status["registeredEndpoints"] == 0 and "refused" in status["lastError"]
    assert [(e.type, e.reason) for e in events] == [("Warning", "RouterUnreachable")]
    again, events = build_status(bad, generation=1, now="T2", previous=status)
    assert events == []
    assert again["conditions"][2]["lastTransitionTime"] == "T1"  # unchanged condition keeps its time
    good = Observed(
        desired=Desired(tuple(W), 2),
        replicas=[ReplicaResult("r1", "u1", True, URLS), ReplicaResult("r2", "u2", True, URLS)],
    )
    fixed, events = build_status(good, generation=1, now="T3", previous=again)
    assert [(e.type, e.reason) for e in events] == [("Normal", "Recovered")]
    assert fixed["conditions"][2]["lastTransitionTime"] == "T3" and fixed["lastError"] is None


def test_no_pods_and_no_router() -> None:
    obs = Observed(desired=Desired((), 0), replicas=[], router_problem=("RouterServiceNotFound", "Service x/y"))
    status, events = build_status(obs, generation=1, now="T", previous=None)
    assert conditions(status) == {
        "Ready": ("False", "NoMatchingPods"),
        "EndpointsResolved": ("False", "NoMatchingPods"),
        "Registered": ("False", "RouterServiceNotFound"),
    }
    assert [e.reason for e in events] == ["RouterServiceNotFound"]


def test_a_status_differs_only_by_more_than_its_sync_times() -> None:
    obs = Observed(desired=Desired(tuple(W), 2), replicas=[ReplicaResult("r1", "u1", True, URLS)])
    first, _ = build_status(obs, generation=1, now="T1", previous=None)
    later, _ = build_status(obs, generation=1, now="T2", previous=None)  # new lastSync and lastTransitionTime
    assert later["routers"][0]["lastSync"] == "T2" and later["conditions"][0]["lastTransitionTime"] == "T2"
    assert not differs(later, first)
    assert not differs(first, {k: v for k, v in first.items() if k != "lastError"})  # null == absent
    assert differs({**first, "registeredEndpoints": 1}, first)
    unreachable, _ = build_status(
        Observed(desired=Desired(tuple(W), 2), replicas=[ReplicaResult("r1", "u1", False)]),
        generation=1,
        now="T1",
        previous=None,
    )
    assert differs(unreachable, first)


# -- Ready means ready ---------------------------------------------------------------------------------
def _ready(replicas, *, desired=None, **observed):
    obs = Observed(desired=desired or Desired(tuple(W), 2), replicas=replicas, **observed)
    status, events = build_status(obs, generation=1, now="T", previous=None)
    return conditions(status)["Ready"], conditions(status)["Registered"], status, events


def test_no_reachable_router_replica_is_not_ready_with_its_own_reason() -> None:
    ready, registered, status, _ = _ready(
        [ReplicaResult("r1", "u1", False, error="refused"), ReplicaResult("r2", "u2", False, error="timeout")]
    )
    assert ready == registered == ("False", "NoRouterReachable")
    assert "refused" in status["lastError"] and "timeout" in status["lastError"]


def test_none_of_the_endpoints_registered_anywhere_is_not_ready_with_its_own_reason() -> None:
    ready, _, status, events = _ready(
        [ReplicaResult("r1", "u1", True, error="register: 500"), ReplicaResult("r2", "u2", True)]
    )
    assert ready == ("False", "NotRegistered")
    assert status["registeredEndpoints"] == 0 and "500" in status["lastError"]
    assert [(e.type, e.reason) for e in events] == [("Warning", "NotRegistered")]
    # one replica away and the other holding nothing: still "none registered", the more telling reason
    ready, _, _, _ = _ready([ReplicaResult("r1", "u1", False, error="refused"), ReplicaResult("r2", "u2", True)])
    assert ready == ("False", "NotRegistered")


def test_replicas_that_disagree_are_not_ready_with_their_own_reason() -> None:
    one, other = frozenset({W[0].url}), frozenset({W[1].url})
    for held in ((URLS, one), (one, other), (URLS, frozenset())):
        ready, _, status, _ = _ready(
            [ReplicaResult("r1", "u1", True, held[0]), ReplicaResult("r2", "u2", True, held[1])]
        )
        assert ready == ("False", "ReplicasDisagree"), held
        assert "r1 " in ready_message(status) and "r2 " in ready_message(status)


def test_ready_only_when_every_endpoint_is_on_every_replica() -> None:
    ready, _, _, _ = _ready([ReplicaResult("r1", "u1", True, URLS), ReplicaResult("r2", "u2", True, URLS)])
    assert ready == ("True", "Ready")
    # the replicas agree but one endpoint is on none of them
    one = frozenset({W[0].url})
    ready, _, status, _ = _ready([ReplicaResult("r1", "u1", True, one), ReplicaResult("r2", "u2", True, one)])
    assert ready == ("False", "RegistrationFailed") and status["registeredEndpoints"] == 1


def test_a_refused_router_is_not_ready_with_a_warning_event() -> None:
    ready, registered, _, events = _ready(
        [], router_problem=("RouterNotAllowed", "Service t/r is not an allowed router")
    )
    assert ready == registered == ("False", "RouterNotAllowed")
    assert [(e.type, e.reason) for e in events] == [("Warning", "RouterNotAllowed")]


def test_a_refused_endpoint_is_not_ready_with_a_warning_event_once_and_then_recovers() -> None:
    refused = Observed(
        desired=Desired((), 1),
        replicas=[ReplicaResult("r1", "u1", True)],
        endpoint_problem=("EndpointNotAllowed", "http://169.254.169.254:80: 169.254.169.254 is link-local"),
    )
    status, events = build_status(refused, generation=1, now="T1", previous=None)
    assert conditions(status)["Ready"] == ("False", "EndpointNotAllowed")
    assert conditions(status)["EndpointsResolved"] == ("False", "EndpointNotAllowed")
    assert "169.254.169.254" in ready_message(status) and status["endpoints"] == []
    assert [(e.type, e.reason) for e in events] == [("Warning", "EndpointNotAllowed")]
    again, events = build_status(refused, generation=1, now="T2", previous=status)
    assert events == []
    fixed = Observed(desired=Desired(tuple(W), 2), replicas=[ReplicaResult("r1", "u1", True, URLS)])
    status, _ = build_status(fixed, generation=2, now="T3", previous=again)
    assert conditions(status)["Ready"] == ("True", "Ready")


def ready_message(status) -> str:
    return next(c["message"] for c in status["conditions"] if c["type"] == "Ready")
