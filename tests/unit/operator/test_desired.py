"""Pure desired-state logic: which pods become workers, which pods are router replicas, and the plan."""

from __future__ import annotations

import pytest
from smg_operator.desired import (
    OWNER_UID,
    POD_UID,
    PodInfo,
    RouterTarget,
    desired_workers,
    plan,
    pod_info,
    router_replicas,
    selector_matches,
)


def pod(
    name: str,
    ip: str | None = "127.0.0.5",
    *,
    labels=None,
    ready=True,
    running=True,
    terminating=False,
    ns="ns",
    annotations=None,
    uid=None,
) -> PodInfo:
    return PodInfo(
        namespace=ns,
        name=name,
        uid=uid or f"uid-{name}",
        labels=labels or {"app": "w"},
        annotations=annotations or {},
        ip=ip,
        running=running,
        ready=ready,
        terminating=terminating,
    )


SPEC = {"role": "regular", "model": "m", "selector": {"matchLabels": {"app": "w"}}, "port": 8000}


def test_only_running_ready_non_terminating_selected_pods_are_desired() -> None:
    pods = [
        pod("a", "127.0.0.2"),
        pod("b", "127.0.0.3", ready=False),
        pod("c", "127.0.0.4", terminating=True),
        pod("d", "127.0.0.5", running=False),
        pod("e", None),
        pod("f", "127.0.0.7", labels={"app": "x"}),
        pod("g", "127.0.0.8", ns="other"),
    ]
    d = desired_workers(namespace="ns", name="pool", uid="U", spec=SPEC, pods=pods)
    assert [w.url for w in d.workers] == ["http://127.0.0.2:8000"]
    assert d.selected == 5  # a-e match the selector in this namespace
    w = d.workers[0]
    assert w.labels[OWNER_UID] == "U" and w.labels[POD_UID] == "uid-a" and w.owner == "smg-operator:ns/pool"


def test_bootstrap_port_annotation_wins_over_the_spec() -> None:
    spec = {**SPEC, "role": "prefill", "bootstrapPort": 8998}
    pods = [
        pod("a", "127.0.0.2", annotations={"sglang.ai/bootstrap-port": "9100"}),
        pod("b", "127.0.0.3"),
        pod("c", "127.0.0.4", annotations={"sglang.ai/bootstrap-port": "junk"}),
    ]
    ports = {
        w.pod: w.bootstrap_port
        for w in desired_workers(namespace="ns", name="p", uid="U", spec=spec, pods=pods).workers
    }
    assert ports == {"a": 9100, "b": 8998, "c": 8998}


def test_static_endpoints_and_policy_label() -> None:
    spec = {
        "role": "decode",
        "model": "m",
        "endpoints": ["http://127.0.0.9:7000/"],
        "policy": "cache_aware",
        "labels": {"zone": "a"},
    }
    d = desired_workers(namespace="ns", name="p", uid="U", spec=spec, pods=[pod("a")])
    (w,) = d.workers
    assert w.url == "http://127.0.0.9:7000" and w.role == "decode" and w.pod is None
    assert w.labels["policy"] == "cache_aware" and w.labels["zone"] == "a"
    assert d.selected == 1


@pytest.mark.parametrize(
    ("selector", "labels", "match"),
    [
        ({"matchLabels": {"a": "1"}}, {"a": "1", "b": "2"}, True),
        ({"matchLabels": {"a": "1"}}, {"a": "2"}, False),
        ({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1", "2"]}]}, {"a": "2"}, True),
        ({"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]}, {"a": "1"}, False),
        ({"matchExpressions": [{"key": "a", "operator": "Exists"}]}, {}, False),
        ({"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]}, {}, True),
        ({}, {"a": "1"}, False),
        (None, {"a": "1"}, False),
    ],
)
def test_label_selectors(selector, labels, match) -> None:
    assert selector_matches(selector, labels) is match


def test_router_replicas_are_the_running_pods_the_service_selects() -> None:
    target = RouterTarget(service="smg", namespace="ns", port=30000)
    app = {"app": "smg"}
    pods = [
        pod("r1", "127.0.0.2", labels=app),
        pod("r2", "127.0.0.3", labels=app, ready=False),  # not Ready yet: it needs its workers from us
        pod("r3", "127.0.0.4", labels=app, terminating=True),
        pod("r4", "127.0.0.5", labels=app, running=False),
        pod("r5", None, labels=app),
        pod("w1", "127.0.0.6", labels={"app": "w"}),
        pod("r6", "127.0.0.7", labels=app, ns="elsewhere"),
    ]
    assert [(r.pod, r.url) for r in router_replicas(target, app, pods)] == [
        ("r1", "http://127.0.0.2:30000"),
        ("r2", "http://127.0.0.3:30000"),
    ]
    assert router_replicas(target, {}, pods) == []


def test_plan_touches_only_owned_workers() -> None:
    d = desired_workers(
        namespace="ns", name="p", uid="U", spec=SPEC, pods=[pod("a", "127.0.0.2"), pod("b", "127.0.0.3")]
    )
    a, b = d.workers
    current = [
        {"id": "wa", "url": a.url, **a.registration()},  # mine, same: keep
        {"id": "wb", "url": b.url, **{**b.registration(), "labels": {OWNER_UID: "U", POD_UID: "old"}}},  # recreated
        {"id": "wx", "url": "http://127.0.0.9:8000", "labels": {OWNER_UID: "U"}},  # mine, gone: remove
        {"id": "wh", "url": "http://127.0.0.8:8000", "labels": {}},  # a person's: leave alone
    ]
    p = plan(d.workers, current, owner_uid="U")
    assert p.add == () and [wid for wid, _ in p.replace] == ["wb"] and p.remove == ("wx",) and p.conflicts == ()
    # a URL a person registered is never taken over
    p2 = plan(d.workers, [{"id": "wh", "url": a.url, "labels": {}}], owner_uid="U")
    assert p2.conflicts == (a.url,) and [w.url for w in p2.add] == [b.url]


def test_pod_info_reads_a_pod_body() -> None:
    body = {
        "metadata": {
            "namespace": "ns",
            "name": "a",
            "uid": "u1",
            "labels": {"x": "y"},
            "deletionTimestamp": "2026-01-01T00:00:00Z",
        },
        "status": {"phase": "Running", "podIP": "127.0.0.2", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    info = pod_info(body)
    assert info.ready and info.running and info.terminating and not info.serving


def test_the_drain_annotation_marks_a_pod_worker_draining_and_the_plan_drains_and_undrains_it() -> None:
    drained = pod("a", "127.0.0.2", annotations={"smg.dev/drain": "true"})
    d = desired_workers(namespace="ns", name="p", uid="U", spec=SPEC, pods=[drained, pod("b", "127.0.0.3")])
    a, b = d.workers
    assert (a.draining, b.draining) == (True, False)
    assert a.registration() == {**b.registration(), "url": a.url, "labels": a.labels}  # draining is no POST field
    ready = [{"id": "wa", "status": "ready", **a.registration()}, {"id": "wb", "status": "ready", **b.registration()}]
    assert plan(d.workers, ready, owner_uid="U").drain == (("wa", True),)
    draining = [{**ready[0], "status": "draining"}, ready[1]]
    assert plan(d.workers, draining, owner_uid="U").empty  # already drained: nothing to do
    undrained = desired_workers(namespace="ns", name="p", uid="U", spec=SPEC, pods=[pod("a", "127.0.0.2")])
    assert plan(undrained.workers, draining, owner_uid="U").drain == (("wa", False),)
    for value in ("false", "", "yes"):  # only "true" drains
        other = pod("a", "127.0.0.2", annotations={"smg.dev/drain": value})
        assert not desired_workers(namespace="ns", name="p", uid="U", spec=SPEC, pods=[other]).workers[0].draining


# -- IPv6 --------------------------------------------------------------------------------------------
def test_ipv6_pod_and_router_urls_put_the_address_in_brackets() -> None:
    d = desired_workers(
        namespace="ns", name="w", uid="u", spec={"selector": {"matchLabels": {"app": "w"}}}, pods=[pod("a", "fd00::5")]
    )
    assert [w.url for w in d.workers] == ["http://[fd00::5]:8000"]
    target = RouterTarget(service="r", namespace="ns", port=30000)
    replicas = router_replicas(target, {"app": "r"}, [pod("r0", "fd00::10", labels={"app": "r"})])
    assert [r.url for r in replicas] == ["http://[fd00::10]:30000"]
    v4 = router_replicas(target, {"app": "r"}, [pod("r0", "10.0.0.7", labels={"app": "r"})])
    assert [r.url for r in v4] == ["http://10.0.0.7:30000"]  # IPv4 stays bare


# -- kvCapacityTokens ------------------------------------------------------------------------------------------
def test_kv_capacity_tokens_goes_into_every_registration_and_a_change_replaces_them() -> None:
    spec = {**SPEC, "kvCapacityTokens": 4096, "endpoints": ["http://127.0.0.9:7000"]}
    d = desired_workers(namespace="ns", name="p", uid="U", spec=spec, pods=[pod("a", "127.0.0.2")])
    assert [w.registration()["kv_capacity_tokens"] for w in d.workers] == [4096, 4096]  # pods and endpoints
    current = [{"id": f"w{i}", "status": "ready", **w.registration()} for i, w in enumerate(d.workers)]
    assert plan(d.workers, current, owner_uid="U").empty
    changed = desired_workers(
        namespace="ns", name="p", uid="U", spec={**spec, "kvCapacityTokens": 1000}, pods=[pod("a", "127.0.0.2")]
    )
    replaced = plan(changed.workers, current, owner_uid="U").replace
    assert [(wid, w.registration()["kv_capacity_tokens"]) for wid, w in replaced] == [("w0", 1000), ("w1", 1000)]
    # left out of the SMGWorker: left out of the POST (a router without the field still takes it), and a PUT
    # without it clears the router's value
    unset = desired_workers(
        namespace="ns", name="p", uid="U", spec={**SPEC, "endpoints": spec["endpoints"]}, pods=[pod("a", "127.0.0.2")]
    )
    assert all("kv_capacity_tokens" not in w.registration() for w in unset.workers)
    assert [wid for wid, _ in plan(unset.workers, current, owner_uid="U").replace] == ["w0", "w1"]
    listed_by_an_older_router = [{k: v for k, v in c.items() if k != "kv_capacity_tokens"} for c in current]
    assert plan(unset.workers, listed_by_an_older_router, owner_uid="U").empty


# -- kvEvents ----------------------------------------------------------------------------------------------------
def test_kv_events_become_each_pods_own_endpoints_and_a_change_replaces_them() -> None:
    """spec.kvEvents names ports; each pod's registration says its own IP, as the engine binds on its pod."""
    spec = {**SPEC, "kvEvents": {"port": 5557, "replayPort": 5558}, "endpoints": ["http://127.0.0.9:7000"]}
    pods = [pod("a", "127.0.0.2"), pod("b", "fd00::3")]
    d = desired_workers(namespace="ns", name="p", uid="U", spec=spec, pods=pods)
    assert [w.registration()["kv_events"] for w in d.workers] == [
        {"endpoint": "tcp://127.0.0.2:5557", "replay_endpoint": "tcp://127.0.0.2:5558", "topic": ""},
        {"endpoint": "tcp://[fd00::3]:5557", "replay_endpoint": "tcp://[fd00::3]:5558", "topic": ""},
        {"endpoint": "tcp://127.0.0.9:5557", "replay_endpoint": "tcp://127.0.0.9:5558", "topic": ""},
    ]
    current = [{"id": f"w{i}", "status": "ready", **w.registration()} for i, w in enumerate(d.workers)]
    assert plan(d.workers, current, owner_uid="U").empty
    moved = desired_workers(
        namespace="ns", name="p", uid="U", spec={**spec, "kvEvents": {"port": 6000, "topic": "kv"}}, pods=pods
    )
    replaced = plan(moved.workers, current, owner_uid="U").replace
    assert [w.registration()["kv_events"]["endpoint"] for _, w in replaced] == [
        "tcp://127.0.0.2:6000",
        "tcp://[fd00::3]:6000",
        "tcp://127.0.0.9:6000",
    ]
    assert all(w.registration()["kv_events"]["replay_endpoint"] is None for _, w in replaced)
    without = desired_workers(namespace="ns", name="p", uid="U", spec={**SPEC}, pods=pods)
    assert all("kv_events" not in w.registration() for w in without.workers)
