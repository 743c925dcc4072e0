"""Pods come and go: a terminating pod leaves every replica at once, its successor on the same IP comes back."""

from __future__ import annotations

from kmock_harness import HOLD_FINALIZER, POD_UID, SETTLE, Fleet, Kube, Operator, pool_spec, wait_for


def test_a_terminating_pod_is_drained_from_both_replicas_and_its_successor_on_the_same_ip_is_registered(
    kube: Kube, fleet: Fleet, operator: Operator
) -> None:
    fleet.router_service()
    fleet.add_routers("router-0", "router-1")
    leaving, staying = fleet.add_workers("llama-0", "llama-1", labels={"pool": "llama"})
    uid = kube.create_smgworker("llama", pool_spec("llama", fleet.router_port, fleet.worker_port))["metadata"]["uid"]
    wait_for(
        lambda: fleet.everywhere({leaving.url, staying.url}, owner_uid=uid),
        timeout=SETTLE,
        what="both pods on both replicas",
    )
    old_pod_uid = kube.pod("llama-0")["metadata"]["uid"]

    terminating = kube.terminate_pod("llama-0")
    assert terminating["metadata"]["deletionTimestamp"] and terminating["metadata"]["finalizers"] == [HOLD_FINALIZER]
    wait_for(
        lambda: fleet.everywhere({staying.url}, owner_uid=uid),
        timeout=SETTLE,
        what="the terminating pod removed from both replicas",
    )
    status = wait_for(
        lambda: (s := kube.status("llama")).get("registeredEndpoints") == 1 and s,
        timeout=SETTLE,
        what="status registeredEndpoints 1",
    )
    assert status["ready"] == "1/2"  # still selected while it terminates, no longer serving

    kube.release_pod("llama-0")
    wait_for(lambda: kube.pod("llama-0") is None, timeout=SETTLE, what="the pod gone")
    kube.create_pod("llama-0", labels={"pool": "llama"}, ip=leaving.host)  # a StatefulSet's successor
    new_pod_uid = kube.pod("llama-0")["metadata"]["uid"]
    assert new_pod_uid != old_pod_uid

    def successor_registered() -> bool:
        return fleet.everywhere({leaving.url, staying.url}, owner_uid=uid) and all(
            w["labels"][POD_UID] == new_pod_uid
            for pod in fleet.routers
            for w in fleet.workers(pod)
            if w["url"] == leaving.url
        )

    wait_for(successor_registered, timeout=SETTLE, what="the successor registered with its new pod uid")
    wait_for(lambda: kube.status("llama").get("ready") == "2/2", timeout=SETTLE, what='status ready "2/2"')
