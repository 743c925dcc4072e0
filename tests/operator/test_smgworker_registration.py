"""An SMGWorker's ready pods end up on every router replica, and its status says so."""

from __future__ import annotations

from kmock_harness import OWNER_UID, POD_UID, SETTLE, Fleet, Kube, Operator, pool_spec, wait_for
from support.procs import MODEL


def _two_replicas_and_two_workers(fleet: Fleet) -> None:
    fleet.router_service()
    fleet.add_routers("router-0", "router-1")
    fleet.add_workers("llama-0", "llama-1", labels={"pool": "llama"})


def test_an_smgworker_selecting_two_ready_pods_registers_both_on_both_router_replicas(
    kube: Kube, fleet: Fleet, operator: Operator
) -> None:
    _two_replicas_and_two_workers(fleet)
    fleet.add_worker("other-0", labels={"pool": "other"})  # not selected
    smgw = kube.create_smgworker(
        "llama", pool_spec("llama", fleet.router_port, fleet.worker_port, labels={"tier": "gold"}, policy="cache_aware")
    )
    uid = smgw["metadata"]["uid"]
    want = {fleet.sims["llama-0"].url, fleet.sims["llama-1"].url}

    wait_for(lambda: fleet.everywhere(want, owner_uid=uid), timeout=SETTLE, what="both pods on both replicas")
    assert fleet.everywhere(want)  # nothing else (the unselected pod is not registered)
    for pod in fleet.routers:
        for worker in fleet.workers(pod):
            pod_name = next(p for p in ("llama-0", "llama-1") if fleet.sims[p].url == worker["url"])
            assert worker["role"] == "regular"
            assert worker["model_id"] == MODEL
            assert worker["owner"] == f"smg-operator:{kube.ns}/llama"
            assert worker["labels"] == {
                "tier": "gold",
                "policy": "cache_aware",
                "smg.dev/managed-by": "smg-operator",
                "smg.dev/smgworker": f"{kube.ns}.llama",
                OWNER_UID: uid,
                "smg.dev/pod": pod_name,
                POD_UID: kube.pod(pod_name)["metadata"]["uid"],
            }

    status = wait_for(
        lambda: (s := kube.status("llama")).get("registeredEndpoints") == 2 and s,
        timeout=SETTLE,
        what="status registeredEndpoints 2",
    )
    assert status["ready"] == "2/2"
    assert status["readyEndpoints"] == 2
    assert status["observedGeneration"] == kube.smgworker("llama")["metadata"]["generation"]
    assert "lastError" not in status  # cleared: a null in the merge patch removes it
    conditions = {c["type"]: c for c in status["conditions"]}
    assert (conditions["Ready"]["status"], conditions["Ready"]["reason"]) == ("True", "Ready")
    assert (conditions["EndpointsResolved"]["status"], conditions["EndpointsResolved"]["reason"]) == (
        "True",
        "EndpointsFound",
    )
    assert (conditions["Registered"]["status"], conditions["Registered"]["reason"]) == (
        "True",
        "RegisteredOnAllReplicas",
    )
    assert all(c["message"] and c["lastTransitionTime"] for c in conditions.values())
    assert sorted(e["url"] for e in status["endpoints"]) == sorted(want)
    assert all(e["registered"] for e in status["endpoints"])
    assert sorted((r["pod"], r["reachable"], r["registered"]) for r in status["routers"]) == [
        ("router-0", True, 2),
        ("router-1", True, 2),
    ]


def test_a_pod_that_is_not_ready_counts_as_selected_but_is_not_registered_until_it_is_ready(
    kube: Kube, fleet: Fleet, operator: Operator
) -> None:
    _two_replicas_and_two_workers(fleet)
    late = fleet.add_worker("llama-2", labels={"pool": "llama"}, ready=False)
    smgw = kube.create_smgworker("llama", pool_spec("llama", fleet.router_port, fleet.worker_port))
    uid = smgw["metadata"]["uid"]
    two = {fleet.sims["llama-0"].url, fleet.sims["llama-1"].url}

    wait_for(lambda: kube.status("llama").get("ready") == "2/3", timeout=SETTLE, what='status ready "2/3"')
    assert fleet.everywhere(two, owner_uid=uid)

    kube.set_pod_status("llama-2", ip=late.host, ready=True)
    wait_for(
        lambda: fleet.everywhere(two | {late.url}, owner_uid=uid),
        timeout=SETTLE,
        what="the pod that became ready on both replicas",
    )
    wait_for(lambda: kube.status("llama").get("ready") == "3/3", timeout=SETTLE, what='status ready "3/3"')


def test_a_changed_spec_replaces_the_registrations_on_every_replica(
    kube: Kube, fleet: Fleet, operator: Operator
) -> None:
    _two_replicas_and_two_workers(fleet)
    smgw = kube.create_smgworker(
        "llama", pool_spec("llama", fleet.router_port, fleet.worker_port, labels={"tier": "gold"})
    )
    uid = smgw["metadata"]["uid"]
    want = {fleet.sims["llama-0"].url, fleet.sims["llama-1"].url}
    wait_for(lambda: fleet.everywhere(want, owner_uid=uid), timeout=SETTLE, what="both pods on both replicas")

    patched = kube.merge(kube.smgw_path("llama"), {"spec": {"labels": {"tier": "silver"}}})
    assert patched["metadata"]["generation"] == 2

    def relabelled() -> bool:
        return all(
            w["labels"].get("tier") == "silver" for pod in fleet.routers for w in fleet.workers(pod)
        ) and fleet.everywhere(want, owner_uid=uid)

    wait_for(relabelled, timeout=SETTLE, what="the new labels on every replica")
    wait_for(
        lambda: kube.status("llama").get("observedGeneration") == 2, timeout=SETTLE, what="status.observedGeneration 2"
    )


def test_kv_capacity_tokens_reaches_every_registration_and_follows_the_field(
    kube: Kube, fleet: Fleet, operator: Operator
) -> None:
    """spec.kvCapacityTokens is each endpoint's kv_capacity_tokens on every replica; changing it
    changes them, removing it clears them (the engine's own report applies again)."""
    _two_replicas_and_two_workers(fleet)
    smgw = kube.create_smgworker(
        "llama", pool_spec("llama", fleet.router_port, fleet.worker_port, kvCapacityTokens=4096)
    )
    uid = smgw["metadata"]["uid"]
    want = {fleet.sims["llama-0"].url, fleet.sims["llama-1"].url}

    def capacities() -> list[object]:
        return [w.get("kv_capacity_tokens") for pod in fleet.routers for w in fleet.workers(pod)]

    def everywhere(value: object) -> bool:
        return fleet.everywhere(want, owner_uid=uid) and capacities() == [value] * 4

    wait_for(lambda: everywhere(4096), timeout=SETTLE, what="kv_capacity_tokens 4096 on both replicas")
    kube.merge(kube.smgw_path("llama"), {"spec": {"kvCapacityTokens": 1000}})
    wait_for(lambda: everywhere(1000), timeout=SETTLE, what="kv_capacity_tokens 1000 on both replicas")
    kube.merge(kube.smgw_path("llama"), {"spec": {"kvCapacityTokens": None}})  # a merge patch's null removes it
    wait_for(lambda: everywhere(None), timeout=SETTLE, what="kv_capacity_tokens cleared on both replicas")


def test_kv_events_reach_every_registration_with_each_pods_own_address(
    kube: Kube, fleet: Fleet, operator: Operator
) -> None:
    """spec.kvEvents registers tcp://<pod IP>:<port> per endpoint on every replica; removing it removes them."""
    _two_replicas_and_two_workers(fleet)
    smgw = kube.create_smgworker(
        "llama",
        pool_spec("llama", fleet.router_port, fleet.worker_port, kvEvents={"port": 5557, "replayPort": 5558}),
    )
    uid = smgw["metadata"]["uid"]
    sims = [fleet.sims["llama-0"], fleet.sims["llama-1"]]
    want = {s.url for s in sims}
    expected = sorted(f"tcp://{s.host}:5557" for s in sims) * 2

    def endpoints() -> list[object]:
        found = [(w.get("kv_events") or {}).get("endpoint") for pod in fleet.routers for w in fleet.workers(pod)]
        return sorted(found, key=str)

    wait_for(
        lambda: fleet.everywhere(want, owner_uid=uid) and endpoints() == sorted(expected),
        timeout=SETTLE,
        what="each pod's KV events endpoint on both replicas",
    )
    kube.merge(kube.smgw_path("llama"), {"spec": {"kvEvents": None}})
    wait_for(lambda: endpoints() == [None] * 4, timeout=SETTLE, what="the KV events endpoints removed")
