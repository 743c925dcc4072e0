"""The Kubernetes emulator behind this tier behaves like an API server where kopf and the operator can tell."""

from __future__ import annotations

import json
import threading
import urllib.request
from typing import Any

import pytest
from kmock_harness import SETTLE, Kube, wait_for
from support.kmock_emulator import EmulatorServer, KubernetesEmulator

PODS = "/api/v1/namespaces/ns/pods"


@pytest.fixture
def api(kube: Kube) -> Kube:
    return Kube(kube.server, namespace="ns")


def _pod(name: str, **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, **meta},
        "spec": {"containers": []},
        "status": {"phase": "Running"},
    }


def _watch(api: Kube, path: str, timeout: float = 0.5) -> list[dict[str, Any]]:
    """Every event of a watch the server ends after ``timeout`` s (the replay is sent before that clock starts,
    so the result holds the whole replay, and the timeout only ends the wait for more)."""
    url = f"{api.server.url}{path}{'&' if '?' in path else '?'}watch=true&timeoutSeconds={timeout:g}"
    with urllib.request.urlopen(url, timeout=timeout + 5) as resp:
        return [json.loads(line) for line in resp.read().splitlines() if line.strip()]


def _stream(api: Kube, path: str, into: list[dict[str, Any]], count: int) -> None:
    """Append the events of a watch to ``into`` as they arrive, until ``count`` came (or ``SETTLE`` s passed)."""
    url = f"{api.server.url}{path}{'&' if '?' in path else '?'}watch=true&timeoutSeconds={SETTLE:g}"
    with urllib.request.urlopen(url, timeout=SETTLE + 5) as resp:
        while len(into) < count and (line := resp.readline()):
            if line.strip():
                into.append(json.loads(line))


def test_discovery_lists_the_builtin_resources_and_the_installed_crd_with_its_status_subresource(api: Kube) -> None:
    groups = {g["name"] for g in api.call("GET", "/apis")["groups"]}
    assert {"apiextensions.k8s.io", "events.k8s.io", "coordination.k8s.io", "smg.dev"} <= groups
    core = {r["name"]: r for r in api.call("GET", "/api/v1")["resources"]}
    assert {"pods", "pods/status", "services", "namespaces", "events", "endpoints"} <= set(core)
    assert core["pods"]["kind"] == "Pod" and core["pods"]["namespaced"] is True
    assert {"list", "watch", "patch"} <= set(core["pods"]["verbs"])
    smg = {r["name"]: r for r in api.call("GET", "/apis/smg.dev/v1alpha1")["resources"]}
    assert set(smg) == {"smgworkers", "smgworkers/status"}
    assert smg["smgworkers"]["kind"] == "SMGWorker" and smg["smgworkers"]["shortNames"] == ["smgw"]
    crds = api.items("/apis/apiextensions.k8s.io/v1/customresourcedefinitions")
    assert [c["metadata"]["name"] for c in crds] == ["smgworkers.smg.dev"]


def test_create_stamps_metadata_fills_generate_name_and_leaves_status_to_the_status_subresource(api: Kube) -> None:
    pod = api.call("POST", PODS, _pod("p1"))
    meta = pod["metadata"]
    assert meta["uid"] and meta["creationTimestamp"].endswith("Z") and meta["generation"] == 1
    assert int(meta["resourceVersion"]) > 0 and meta["namespace"] == "ns"
    assert pod["status"] == {"phase": "Pending"}  # the kubelet (the test) sets the rest through /status
    other = api.call("POST", PODS, _pod("p2"))
    assert int(other["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])
    assert other["metadata"]["uid"] != meta["uid"]
    with pytest.raises(AssertionError, match="409"):
        api.call("POST", PODS, _pod("p1"))
    event = api.call("POST", "/api/v1/namespaces/ns/events", {"metadata": {"generateName": "p1."}, "reason": "X"})
    assert event["metadata"]["name"].startswith("p1.") and len(event["metadata"]["name"]) == len("p1.") + 5


def test_the_crd_schema_defaults_are_applied(api: Kube) -> None:
    smgw = api.create_smgworker(
        "w", {"role": "regular", "model": "m", "selector": {"matchLabels": {"a": "b"}}, "router": {"service": "r"}}
    )
    assert smgw["spec"]["port"] == 8000
    assert smgw["spec"]["drainTimeoutSeconds"] == 30
    assert "port" not in smgw["spec"]["router"]  # no schema default: the operator's --router-port applies


def test_generation_moves_only_with_the_spec_and_a_no_op_patch_changes_nothing(api: Kube) -> None:
    api.create_smgworker(
        "w", {"role": "regular", "model": "m", "endpoints": ["http://127.0.0.1:1"], "router": {"service": "r"}}
    )
    path = api.smgw_path("w")
    on_status = api.merge(path + "/status", {"status": {"ready": "0/1"}})
    assert on_status["metadata"]["generation"] == 1 and on_status["status"] == {"ready": "0/1"}
    on_meta = api.merge(path, {"metadata": {"annotations": {"a": "b"}}})
    assert on_meta["metadata"]["generation"] == 1
    assert int(on_meta["metadata"]["resourceVersion"]) > int(on_status["metadata"]["resourceVersion"])
    same = api.merge(path, {"metadata": {"annotations": {"a": "b"}}})
    assert same["metadata"]["resourceVersion"] == on_meta["metadata"]["resourceVersion"]
    on_spec = api.merge(path, {"spec": {"model": "m2"}})
    assert on_spec["metadata"]["generation"] == 2


def test_the_status_subresource_is_split_from_the_main_resource(api: Kube) -> None:
    api.create_smgworker(
        "w", {"role": "regular", "model": "m", "endpoints": ["http://127.0.0.1:1"], "router": {"service": "r"}}
    )
    path = api.smgw_path("w")
    main = api.merge(path, {"spec": {"model": "m2"}, "status": {"ready": "9/9"}})
    assert main["spec"]["model"] == "m2" and "status" not in main
    sub = api.merge(path + "/status", {"spec": {"model": "m3"}, "status": {"ready": "1/1"}})
    assert sub["spec"]["model"] == "m2" and sub["status"] == {"ready": "1/1"}


def test_a_failed_json_patch_test_answers_422_and_a_stale_resource_version_409(api: Kube) -> None:
    pod = api.call("POST", PODS, _pod("p1"))
    rv = pod["metadata"]["resourceVersion"]
    ok = api.call(
        "PATCH",
        f"{PODS}/p1",
        [
            {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
            {"op": "add", "path": "/metadata/finalizers", "value": ["x/y"]},
        ],
        content_type="application/json-patch+json",
    )
    assert ok["metadata"]["finalizers"] == ["x/y"]
    with pytest.raises(AssertionError, match="422"):
        api.call(
            "PATCH",
            f"{PODS}/p1",
            [
                {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
                {"op": "remove", "path": "/metadata/finalizers"},
            ],
            content_type="application/json-patch+json",
        )
    with pytest.raises(AssertionError, match="409"):
        api.merge(f"{PODS}/p1", {"metadata": {"resourceVersion": rv, "labels": {"a": "b"}}})
    with pytest.raises(AssertionError, match="409"):
        api.call("PUT", f"{PODS}/p1", {**_pod("p1"), "metadata": {"name": "p1", "resourceVersion": rv}})
    current = api.pod("p1")
    replaced = api.call("PUT", f"{PODS}/p1", {**current, "metadata": {**current["metadata"], "labels": {"c": "d"}}})
    assert replaced["metadata"]["labels"] == {"c": "d"} and replaced["metadata"]["uid"] == current["metadata"]["uid"]
    assert replaced["status"] == current["status"]  # PUT on the main resource leaves status alone


def test_a_finalizer_holds_a_deleted_object_until_it_is_removed(api: Kube) -> None:
    api.call("POST", PODS, _pod("p1", finalizers=["x/y"]))
    deleting = api.call("DELETE", f"{PODS}/p1")
    assert deleting["metadata"]["deletionTimestamp"] and deleting["metadata"]["generation"] == 2
    assert api.pod("p1")["metadata"]["deletionTimestamp"]
    with pytest.raises(AssertionError, match="422"):  # no new finalizers on an object being deleted
        api.merge(f"{PODS}/p1", {"metadata": {"finalizers": ["x/y", "x/z"]}})
    api.merge(f"{PODS}/p1", {"metadata": {"finalizers": None}})
    assert api.pod("p1") is None
    assert api.items(PODS) == []
    assert api.call("POST", PODS, _pod("p1"))["metadata"]["uid"] != deleting["metadata"]["uid"]


def test_a_watch_resumes_exactly_after_the_listed_resource_version(api: Kube) -> None:
    api.call("POST", PODS, _pod("before"))
    listed = api.call("GET", PODS)
    since = listed["metadata"]["resourceVersion"]
    assert [p["metadata"]["name"] for p in listed["items"]] == ["before"]
    api.call("POST", PODS, _pod("after"))
    api.merge(f"{PODS}/before", {"metadata": {"labels": {"x": "y"}}})
    api.call("POST", "/api/v1/namespaces/elsewhere/pods", _pod("elsewhere"))
    api.call("DELETE", f"{PODS}/after")

    events = _watch(api, f"{PODS}?resourceVersion={since}")
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "after"),
        ("MODIFIED", "before"),
        ("DELETED", "after"),
    ]
    versions = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
    assert versions == sorted(versions) and versions[0] > int(since)

    fresh = _watch(api, PODS)  # no resourceVersion: the current objects, as ADDED
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in fresh] == [("ADDED", "before")]
    cluster_wide = _watch(api, f"/api/v1/pods?resourceVersion={since}")
    assert ("ADDED", "elsewhere") in [(e["type"], e["object"]["metadata"]["name"]) for e in cluster_wide]


def test_a_live_watch_sees_every_change_after_its_replay_without_a_gap(api: Kube) -> None:
    since = api.call("GET", PODS)["metadata"]["resourceVersion"]
    api.call("POST", PODS, _pod("p0"))
    seen: list[dict[str, Any]] = []
    watcher = threading.Thread(
        target=_stream, args=(api, f"{PODS}?resourceVersion={since}", seen, 20), name="test-watch", daemon=True
    )
    watcher.start()
    for i in range(1, 10):  # racing the watch's start: each lands in its replay or in its live stream
        api.call("POST", PODS, _pod(f"p{i}"))
    wait_for(lambda: seen, timeout=SETTLE, what="the watch's first event")  # its replay is under way
    for i in range(10, 20):  # after the replay began: these can only come through the live stream
        api.call("POST", PODS, _pod(f"p{i}"))
    watcher.join(SETTLE)
    assert not watcher.is_alive(), f"the watch saw only {len(seen)} of 20 events"
    assert [e["object"]["metadata"]["name"] for e in seen] == [f"p{i}" for i in range(20)]


def test_a_watch_from_before_the_kept_history_is_gone() -> None:
    with EmulatorServer(KubernetesEmulator(history_limit=3)) as server:
        api = Kube(server, namespace="ns")
        for i in range(5):
            api.call("POST", PODS, _pod(f"p{i}"))
        events = _watch(api, f"{PODS}?resourceVersion=1")
        assert [(e["type"], e["object"]["code"]) for e in events] == [("ERROR", 410)]
