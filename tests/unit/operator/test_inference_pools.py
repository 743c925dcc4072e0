"""An InferencePool as a worker source, the pure part: which pools are taken, what a pool's pods and target ports
become, and which registrations on a replica belong to no pool any more."""

from __future__ import annotations

from typing import Any

import pytest
from smg_operator.desired import OWNER_UID, POD_NAME, plan
from smg_operator.inference_pools import (
    POOL_LABEL,
    TARGET_PORT_LABEL,
    PoolInfo,
    orphaned_ids,
    pool_desired,
    pool_info,
    takes,
)
from smg_operator.settings import parse_settings
from support.operator_pods import ready_pod

NS = "ns"


def pool_body(
    *, annotations: dict[str, str] | None = None, labels: dict[str, str] | None = None, ports: Any = (8000, 8001)
) -> dict[str, Any]:
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {
            "namespace": NS,
            "name": "llama",
            "uid": "pool-uid",
            "annotations": {"smg.dev/router": "smg-router", "smg.dev/model": "meta/llama-3", **(annotations or {})},
            "labels": labels or {},
        },
        "spec": {
            "selector": {"matchLabels": {"app": "llama"}},
            "targetPorts": [{"number": p} for p in ports],
            "endpointPickerRef": {"name": "smg-epp", "port": {"number": 9002}},
        },
    }


def pool(**kw: Any) -> PoolInfo:
    return pool_info(pool_body(**kw))


def test_a_pool_is_read_from_its_v1_object() -> None:
    p = pool(ports=(8000, 8001, 8000, 0, "x"))
    assert (p.namespace, p.name, p.uid) == (NS, "llama", "pool-uid")
    assert p.match_labels == {"app": "llama"}
    assert p.target_ports == (8000, 8001)  # duplicates and numbers no port can have are dropped


@pytest.mark.parametrize(
    ("mode", "annotation", "taken"),
    [
        ("annotated", "smg-router", True),
        ("annotated", "other-router", False),
        ("annotated", None, False),
        ("all", None, True),
        ("off", "smg-router", False),
    ],
)
def test_a_pool_is_taken_when_it_names_the_operators_router_or_every_pool_is(
    mode: str, annotation: str | None, taken: bool
) -> None:
    body = pool_body()
    if annotation is None:
        del body["metadata"]["annotations"]["smg.dev/router"]
    else:
        body["metadata"]["annotations"]["smg.dev/router"] = annotation
    assert takes(pool_info(body), mode=mode, router_service="smg-router") is taken


def test_every_ready_pod_at_every_target_port_is_one_worker_of_the_pools_model() -> None:
    pods = [
        ready_pod(NS, "llama-a", {"app": "llama"}, ip="10.0.0.1"),
        ready_pod(NS, "llama-b", {"app": "llama"}, ip="10.0.0.2"),
        ready_pod(NS, "llama-c", {"app": "llama"}, ip="10.0.0.3", ready=False),
        ready_pod(NS, "llama-d", {"app": "llama"}, ip="10.0.0.4", terminating=True),
        ready_pod(NS, "other", {"app": "other"}, ip="10.0.0.5"),
        ready_pod("elsewhere", "llama-e", {"app": "llama"}, ip="10.0.0.6"),
    ]
    desired, problem = pool_desired(pool(), pods)
    assert problem is None
    assert sorted(w.url for w in desired.workers) == [
        "http://10.0.0.1:8000",
        "http://10.0.0.1:8001",
        "http://10.0.0.2:8000",
        "http://10.0.0.2:8001",
    ]
    assert desired.selected == 4  # the pool's pods in its namespace, ready or not
    w = next(w for w in desired.workers if w.url == "http://10.0.0.2:8001")
    assert (w.role, w.model_id, w.pod, w.bootstrap_port) == ("regular", "meta/llama-3", "llama-b", None)
    assert w.labels[OWNER_UID] == "pool-uid"
    assert w.labels[POOL_LABEL] == "ns.llama"
    assert w.labels[POD_NAME] == "llama-b"
    assert w.labels[TARGET_PORT_LABEL] == "8001"
    assert w.owner == "smg-operator:inferencepool/ns/llama"


def test_the_role_annotation_sets_the_role_and_the_model_may_come_from_a_label() -> None:
    body = pool_body(annotations={"smg.dev/role": "decode"}, labels={"smg.dev/model": "qwen"})
    del body["metadata"]["annotations"]["smg.dev/model"]
    desired, problem = pool_desired(pool_info(body), [ready_pod(NS, "a", {"app": "llama"}, ip="10.0.0.1")])
    assert problem is None
    assert {(w.role, w.model_id) for w in desired.workers} == {("decode", "qwen")}


def test_a_pool_without_a_model_registers_nothing_and_names_the_annotation() -> None:
    body = pool_body()
    del body["metadata"]["annotations"]["smg.dev/model"]
    desired, problem = pool_desired(pool_info(body), [ready_pod(NS, "a", {"app": "llama"}, ip="10.0.0.1")])
    assert desired.workers == ()
    assert problem is not None and problem.reason == "ModelMissing"
    assert "smg.dev/model" in problem.message and "ns/llama" in problem.message


def test_a_pool_with_an_unknown_role_registers_nothing() -> None:
    desired, problem = pool_desired(
        pool(annotations={"smg.dev/role": "leader"}), [ready_pod(NS, "a", {"app": "llama"}, ip="10.0.0.1")]
    )
    assert desired.workers == ()
    assert problem is not None and problem.reason == "RoleInvalid" and "'leader'" in problem.message


def test_the_pools_workers_diff_like_an_smgworkers_owned_by_the_pool_uid() -> None:
    desired, _ = pool_desired(pool(), [ready_pod(NS, "a", {"app": "llama"}, ip="10.0.0.1")])
    registered = [w.registration() | {"id": f"w{i}"} for i, w in enumerate(desired.workers)]
    assert plan(desired.workers, registered, owner_uid="pool-uid").empty
    gone, _ = pool_desired(pool(), [])
    assert sorted(plan(gone.workers, registered, owner_uid="pool-uid").remove) == ["w0", "w1"]


def test_the_sweep_picks_only_pool_workers_whose_pool_is_not_kept() -> None:
    current = [
        {"id": "kept", "labels": {POOL_LABEL: "ns.llama", OWNER_UID: "pool-uid"}},
        {"id": "orphan", "labels": {POOL_LABEL: "ns.gone", OWNER_UID: "gone-uid"}},
        {"id": "smgworker", "labels": {OWNER_UID: "gone-uid"}},  # an SMGWorker's: not the pool source's
        {"id": "by-hand", "labels": {}},
    ]
    assert orphaned_ids(current, keep={"pool-uid"}) == ["orphan"]


def test_the_inference_pool_source_is_off_by_default_and_needs_the_operators_router(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SMG_OPERATOR_INFERENCE_POOLS", raising=False)
    assert parse_settings([]).inference_pools == "off"
    assert parse_settings(["--inference-pools", "all", "--router-service", "smg"]).inference_pools == "all"
    monkeypatch.setenv("SMG_OPERATOR_INFERENCE_POOLS", "annotated")
    assert parse_settings(["--router-service", "smg"]).inference_pools == "annotated"
    with pytest.raises(SystemExit):
        parse_settings([])
    assert "--inference-pools needs --router-service" in capsys.readouterr().err
    monkeypatch.setenv("SMG_OPERATOR_INFERENCE_POOLS", "some")
    with pytest.raises(SystemExit):
        parse_settings(["--router-service", "smg"])
    assert "--inference-pools must be one of off, annotated, all" in capsys.readouterr().err
