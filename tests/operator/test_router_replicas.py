"""Router replicas restart and go away; the operator repairs them and says what is going on."""

from __future__ import annotations

from kmock_harness import SETTLE, Fleet, Kube, Operator, registered_pool, wait_for
from support.procs import metric_value


def _registered_pool(kube: Kube, fleet: Fleet) -> tuple[str, set[str]]:
    uid, want = registered_pool(kube, fleet)
    wait_for(
        lambda: kube.condition("llama", "Registered").get("status") == "True", timeout=SETTLE, what="Registered True"
    )
    return uid, want


def test_a_restarted_router_replica_gets_every_worker_back_within_a_couple_of_reconcile_intervals(
    kube: Kube, fleet: Fleet, operator: Operator
) -> None:
    uid, want = _registered_pool(kube, fleet)

    restarted = fleet.restart_router("router-1")  # same IP and port, empty registry, no pod event
    assert restarted.workers() == [] or fleet.urls("router-1", owner_uid=uid) <= want
    # "A couple of reconcile intervals" counted in the operator's own passes (only its timer runs them here,
    # as nothing pokes it): seconds on the wall clock would measure the machine's load as much as the operator.
    # Restored by the third pass at the latest: the one in flight at the restart, the next, and one to spare.
    restoring_pass = operator.passes_until(
        lambda: fleet.urls("router-1", owner_uid=uid) == want, what="every worker back on the restarted replica"
    )
    assert restoring_pass <= 3
    assert fleet.urls("router-0", owner_uid=uid) == want


def test_an_unreachable_router_replica_is_reported_and_its_recovery_is_announced(
    kube: Kube, fleet: Fleet, operator: Operator
) -> None:
    uid, want = _registered_pool(kube, fleet)

    fleet.stop_router("router-1")
    registered = wait_for(
        lambda: (c := kube.condition("llama", "Registered")).get("reason") == "RouterUnreachable" and c,
        timeout=SETTLE,
        what="Registered False, RouterUnreachable",
    )
    assert registered["status"] == "False"
    assert "router-1" in registered["message"]
    ready = kube.condition("llama", "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "RouterUnreachable")
    status = kube.status("llama")
    assert "router-1" in status["lastError"]
    assert {r["pod"]: r["reachable"] for r in status["routers"]} == {"router-0": True, "router-1": False}
    warning = wait_for(
        lambda: [e for e in kube.events("llama") if e["reason"] == "RouterUnreachable"],
        timeout=SETTLE,
        what="a RouterUnreachable event",
    )
    assert warning[0]["type"] == "Warning"
    assert warning[0]["involvedObject"]["uid"] == uid
    assert metric_value(operator.metrics(), "smg_operator_hook_calls_total", result="unreachable") >= 1
    assert fleet.urls("router-0", owner_uid=uid) == want  # the reachable replica is untouched

    fleet.restart_router("router-1")
    wait_for(
        lambda: kube.condition("llama", "Registered").get("status") == "True",
        timeout=SETTLE,
        what="Registered True again",
    )
    wait_for(lambda: "Recovered" in kube.event_reasons("llama"), timeout=SETTLE, what="a Recovered event")
    recovered = next(e for e in kube.events("llama") if e["reason"] == "Recovered")
    assert recovered["type"] == "Normal"
    assert "RouterUnreachable" in recovered["message"]
    assert fleet.urls("router-1", owner_uid=uid) == want
    assert kube.condition("llama", "Ready")["status"] == "True"
    assert kube.event_reasons("llama").count("RouterUnreachable") == 1  # one event per transition, not per loop
