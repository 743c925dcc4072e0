"""What each registration carries: a prefill pod's bootstrap port, and static endpoints outside the cluster."""

from __future__ import annotations

from kmock_harness import OWNER_UID, SETTLE, Fleet, Kube, Operator, pool_spec, wait_for
from support.procs import free_port


def test_the_bootstrap_port_annotation_of_a_prefill_pod_wins_over_the_spec(
    kube: Kube, fleet: Fleet, operator: Operator
) -> None:
    fleet.router_service()
    fleet.add_routers("router-0", "router-1")
    annotated_port, spec_port = free_port(), free_port()
    annotated = fleet.add_worker(
        "prefill-0",
        labels={"pool": "prefill"},
        annotations={"sglang.ai/bootstrap-port": str(annotated_port)},
        extra=["--role", "prefill", "--bootstrap-port", str(annotated_port)],
    )
    plain = fleet.add_worker(
        "prefill-1", labels={"pool": "prefill"}, extra=["--role", "prefill", "--bootstrap-port", str(spec_port)]
    )
    uid = kube.create_smgworker(
        "prefill", pool_spec("prefill", fleet.router_port, fleet.worker_port, role="prefill", bootstrapPort=spec_port)
    )["metadata"]["uid"]

    wait_for(
        lambda: fleet.everywhere({annotated.url, plain.url}, owner_uid=uid),
        timeout=SETTLE,
        what="both prefill pods on both replicas",
    )
    for pod in fleet.routers:
        ports = {w["url"]: (w["role"], w["bootstrap_port"]) for w in fleet.workers(pod)}
        assert ports == {annotated.url: ("prefill", annotated_port), plain.url: ("prefill", spec_port)}


def test_static_endpoints_are_registered_on_every_replica(kube: Kube, fleet: Fleet, operator: Operator) -> None:
    fleet.router_service()
    fleet.add_routers("router-0", "router-1")
    outside = [fleet.add_sim("outside-0"), fleet.add_sim("outside-1")]  # no pods: "outside the cluster"
    spec = pool_spec("none", fleet.router_port, fleet.worker_port, endpoints=[s.url + "/" for s in outside])
    del spec["selector"]
    uid = kube.create_smgworker("external", spec)["metadata"]["uid"]

    want = {s.url for s in outside}
    wait_for(
        lambda: fleet.everywhere(want, owner_uid=uid), timeout=SETTLE, what="the static endpoints on both replicas"
    )
    for pod in fleet.routers:
        for worker in fleet.workers(pod):
            assert "smg.dev/pod" not in worker["labels"] and worker["labels"][OWNER_UID] == uid
    status = wait_for(
        lambda: (s := kube.status("external")).get("registeredEndpoints") == 2 and s,
        timeout=SETTLE,
        what="status registeredEndpoints 2",
    )
    assert status["ready"] == "2/2"
    assert sorted((e["url"], e.get("pod")) for e in status["endpoints"]) == sorted((u, None) for u in want)
    assert kube.condition("external", "Ready")["status"] == "True"
