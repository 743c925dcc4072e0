"""InferencePools (Gateway API Inference Extension, ``inference.networking.k8s.io/v1``) as a worker source on a
real kube-apiserver: a real smg-operator started with ``--inference-pools annotated`` before the CRD exists says
so and keeps running; once the CRD (vendored from the GIE repository) is installed, a pool annotated with the
operator's router becomes one worker per READY pod and target port on both real smg-router replicas (real smg-sim
processes behind each pod and port), follows its pods, leaves when the pool goes, and the pool itself is never
written: its status (the gateway's) and its resourceVersion stay as the test left them."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.helm_chart import render
from support.kube import ControlPlane
from support.operator_env import KEY, Env, leading_own_router, port_free_on, routed_env
from support.operator_proc import SETTLE, OperatorProcess
from support.procs import MODEL, metric_value, next_host, start_sim, wait_until

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "tests/data/crds/inference.networking.k8s.io_inferencepools.yaml"
CRD_NAME = "inferencepools.inference.networking.k8s.io"
REPLICAS = ("router-0", "router-1")
GATEWAY_STATUS = {
    "parents": [
        {
            "parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "inference-gateway"},
            "conditions": [
                {
                    "type": "Accepted",
                    "status": "True",
                    "reason": "Accepted",
                    "message": "set by the gateway",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                    "observedGeneration": 1,
                }
            ],
        }
    ]
}


def for_kubernetes_1_20(node: Any) -> Any:
    """The CRD as the test API server (Kubernetes 1.20) takes it: without its ``x-kubernetes-validations`` (CEL
    rules came with 1.25; 1.20 would drop the unknown field anyway, stripping it says so instead of hoping) and
    without the empty-string ``default`` of ``endpointPickerRef.group`` (1.20 reads it as null and refuses the CRD:
    "default: Invalid value: "null": in body must be of type string")."""
    if isinstance(node, dict):
        return {
            k: for_kubernetes_1_20(v)
            for k, v in node.items()
            if k != "x-kubernetes-validations" and not (k == "default" and v == "")
        }
    if isinstance(node, list):
        return [for_kubernetes_1_20(v) for v in node]
    return node


def install_crd(cp: ControlPlane) -> None:
    cp.apply_yaml(json.dumps(for_kubernetes_1_20(yaml.safe_load(CRD.read_text()))))
    cp.wait_crd_established(CRD_NAME)


def pool_path(ns: str, name: str = "") -> str:
    return f"/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools" + (f"/{name}" if name else "")


@pytest.fixture(scope="module")
def env(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    cp = control_plane
    if cp.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}")[0] == 200:
        cp.api("DELETE", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}")
        wait_until(
            lambda: cp.request("GET", "/apis/inference.networking.k8s.io/v1")[0] == 404,
            timeout=30,
            what="the InferencePool CRD gone",
        )
    e = routed_env(cp, tmp_path_factory.mktemp("operator-pools"), f"pools-{uuid.uuid4().hex[:4]}")
    try:
        e.operator = e.new_operator(*leading_own_router(e.ns), "--inference-pools", "annotated", interval=2).start()
        yield e
    finally:
        e.stop()
        cp.request("DELETE", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}")


def registered(e: Env, pod: str) -> dict[str, tuple[str, str, str]]:
    """Worker URL -> (model, role, owning pool label) on router replica ``pod``."""
    return {
        w["url"]: (w["model_id"], w["role"], (w.get("labels") or {}).get("smg.dev/inferencepool", ""))
        for w in e.routers[pod].workers()
    }


def on_every_replica(e: Env, want: dict[str, tuple[str, str, str]], what: str) -> None:
    try:
        wait_until(lambda: all(registered(e, r) == want for r in REPLICAS), timeout=SETTLE, what=what)
    except AssertionError as err:
        seen = {r: registered(e, r) for r in REPLICAS}
        raise AssertionError(
            f"{err}; registered: {seen}; operator log:\n{e.operator and e.operator.proc.log()[-4000:]}"
        ) from None


def test_a_pool_is_its_ready_pods_times_its_target_ports_on_every_replica_and_its_status_is_never_written(
    env: Env,
) -> None:
    e, cp = env, env.cp
    operator = e.operator
    assert operator is not None

    # no CRD yet: a clear line, and the operator keeps running (live and ready)
    wait_until(
        lambda: "does not serve inferencepools.inference.networking.k8s.io/v1" in operator.proc.log(),
        timeout=SETTLE,
        what="the missing-CRD log line",
    )
    assert operator.proc.alive() and operator.probe("/readyz") == 200

    install_crd(cp)
    hosts = {"llama-a": next_host(), "llama-b": next_host()}
    first = port_free_on(list(hosts.values()))
    ports = (first, next(p for p in iter(lambda: port_free_on(list(hosts.values())), None) if p != first))
    for pod, host in hosts.items():
        for port in ports:
            e.sims[f"{pod}:{port}"] = start_sim(e.logs, host=host, port=port)
        cp.make_ready_pod(e.ns, pod, {"app": "llama"}, host, finalizers=["smg.test/hold"])
    pool = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "llama", "annotations": {"smg.dev/router": "smg-router", "smg.dev/model": MODEL}},
        "spec": {
            "selector": {"matchLabels": {"app": "llama"}},
            "targetPorts": [{"number": p} for p in ports],
            "endpointPickerRef": {"name": "smg-router-epp", "port": {"number": 9002}},
        },
    }
    cp.api("POST", pool_path(e.ns), pool)
    # the gateway's status, set as a gateway sets it (through the status subresource)
    got = cp.api("GET", pool_path(e.ns, "llama"))
    got["status"] = GATEWAY_STATUS
    written = cp.api("PUT", pool_path(e.ns, "llama") + "/status", got)
    version = written["metadata"]["resourceVersion"]

    owner = f"{e.ns}.llama"
    want = {f"http://{h}:{p}": (MODEL, "regular", owner) for h in hosts.values() for p in ports}
    assert len(want) == 4
    on_every_replica(e, want, "2 pods x 2 target ports on both replicas")
    for r in REPLICAS:
        e.routers[r].wait_routable(4)
    gauge = {"inferencepool": f"{e.ns}/llama"}
    wait_until(
        lambda: metric_value(operator.metrics(), "smg_operator_inferencepool_workers", **gauge) == 4,
        timeout=SETTLE,
        what="smg_operator_inferencepool_workers 4",
    )

    # a pod turning unready takes both its ranks off every replica; ready again brings them back
    cp.set_pod_ready(e.ns, "llama-a", False)
    b_only = {u: v for u, v in want.items() if f"//{hosts['llama-b']}:" in u}
    on_every_replica(e, b_only, "the unready pod's two workers gone")
    cp.set_pod_ready(e.ns, "llama-a", True)
    on_every_replica(e, want, "the pod ready again, its workers back")

    # a terminating then deleted pod leaves too
    cp.mark_terminating(e.ns, "llama-b")
    a_only = {u: v for u, v in want.items() if f"//{hosts['llama-a']}:" in u}
    on_every_replica(e, a_only, "the terminating pod's two workers gone")
    cp.release_pod(e.ns, "llama-b")
    on_every_replica(e, a_only, "the deleted pod stays gone")

    # a spec change is followed: one target port left, one worker left
    patched = cp.api(
        "PATCH",
        pool_path(e.ns, "llama"),
        {"spec": {"targetPorts": [{"number": ports[0]}]}},
        content_type="application/merge-patch+json",
    )
    version = patched["metadata"]["resourceVersion"]  # the test's own write; the operator's would move it again
    on_every_replica(
        e, {f"http://{hosts['llama-a']}:{ports[0]}": want[f"http://{hosts['llama-a']}:{ports[0]}"]}, "one port left"
    )

    # the pool was only read: no status write, no finalizer, no annotation (any write bumps resourceVersion)
    now = cp.api("GET", pool_path(e.ns, "llama"))
    assert now["metadata"]["resourceVersion"] == version
    assert now["status"] == GATEWAY_STATUS
    assert not now["metadata"].get("finalizers")
    assert set(now["metadata"]["annotations"]) == {"smg.dev/router", "smg.dev/model"}

    # the pool goes: all its workers leave every replica
    cp.api("DELETE", pool_path(e.ns, "llama"))
    on_every_replica(e, {}, "the deleted pool's workers gone from both replicas")
    assert f'inferencepool="{e.ns}/llama"' not in operator.metrics()  # its series goes with it


def test_a_pool_without_a_model_registers_nothing_and_gets_an_event_naming_the_annotation(env: Env) -> None:
    e, cp = env, env.cp
    install_crd(cp)  # already there after the first test; here too when this one runs alone
    host = next_host()
    e.sims["mistral-a"] = start_sim(e.logs, host=host, port=e.worker_port)
    cp.make_ready_pod(e.ns, "mistral-a", {"app": "mistral"}, host, finalizers=["smg.test/hold"])
    pool = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "mistral", "annotations": {"smg.dev/router": "smg-router"}},
        "spec": {
            "selector": {"matchLabels": {"app": "mistral"}},
            "targetPorts": [{"number": e.worker_port}],
            "endpointPickerRef": {"name": "smg-router-epp", "port": {"number": 9002}},
        },
    }
    cp.api("POST", pool_path(e.ns), pool)

    def warned() -> list[dict[str, Any]]:
        events = cp.api("GET", f"/api/v1/namespaces/{e.ns}/events")["items"]
        return [
            ev
            for ev in events
            if ev["involvedObject"].get("kind") == "InferencePool" and ev["involvedObject"].get("name") == "mistral"
        ]

    wait_until(lambda: bool(warned()), timeout=SETTLE, what="a Warning Event on the pool")
    (event,) = warned()
    assert (event["type"], event["reason"]) == ("Warning", "ModelMissing")
    assert "smg.dev/model" in event["message"]
    assert all(f"//{host}:" not in url for r in REPLICAS for url in registered(e, r))

    # the annotation added: its worker is registered on both replicas
    cp.api(
        "PATCH",
        pool_path(e.ns, "mistral"),
        {"metadata": {"annotations": {"smg.dev/model": MODEL}}},
        content_type="application/merge-patch+json",
    )
    url = f"http://{host}:{e.worker_port}"
    wait_until(
        lambda: all(registered(e, r).get(url) == (MODEL, "regular", f"{e.ns}.mistral") for r in REPLICAS),
        timeout=SETTLE,
        what="the pool's worker once it names its model",
    )
    # no longer naming this router: its worker leaves
    cp.api(
        "PATCH",
        pool_path(e.ns, "mistral"),
        {"metadata": {"annotations": {"smg.dev/router": "another-router"}}},
        content_type="application/merge-patch+json",
    )
    wait_until(
        lambda: all(url not in registered(e, r) for r in REPLICAS),
        timeout=SETTLE,
        what="the worker of a pool that stopped naming this router gone",
    )


def test_the_charts_epp_mode_works_with_nothing_but_the_charts_rbac(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The chart's EPP mode rendered for a namespace: its RBAC and its InferencePool applied to the real API server
    (the pool passes the GIE CRD's schema there), and an operator holding only a token of the chart's operator
    ServiceAccount registers the pool's pod and ports (reading pools with get/list/watch suffices: no 403)."""
    cp = control_plane
    install_crd(cp)
    e = routed_env(cp, tmp_path_factory.mktemp("pools-chart"), f"pools-chart-{uuid.uuid4().hex[:4]}", replicas=1)
    try:
        host = next_host()
        first = port_free_on([host])
        ports = (first, next(p for p in iter(lambda: port_free_on([host]), None) if p != first))
        values = {
            "epp": {
                "enabled": True,
                "inferencePool": {"selector": {"app": "llama"}, "model": MODEL, "targetPorts": list(ports)},
            },
            "operator": {"uninstallHook": {"enabled": False}},
        }
        rendered = render(values, namespace=e.ns)
        rbac_kinds = {"ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}
        objects = [o for o in rendered.objects if o["kind"] in rbac_kinds]
        objects += [rendered.get("Service", "smg-router-epp"), rendered.get("InferencePool", "smg")]
        cp.apply_yaml(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}), e.ns)
        version = cp.api("GET", pool_path(e.ns, "smg"))["metadata"]["resourceVersion"]
        deployment = rendered.get("Deployment", "smg-operator")["spec"]["template"]["spec"]
        chart_args = deployment["containers"][0]["args"]
        assert chart_args[chart_args.index("--inference-pools") + 1] == "annotated"
        token = cp.service_account_token(e.ns, deployment["serviceAccountName"])
        for port in ports:
            e.sims[f"llama-a:{port}"] = start_sim(e.logs, host=host, port=port)
        cp.make_ready_pod(e.ns, "llama-a", {"app": "llama"}, host, finalizers=["smg.test/hold"])
        e.operator = OperatorProcess(
            e.logs,
            cp.kubeconfig_for_token(token),
            admin_key=KEY,
            args=[
                *e.operator_args(2),
                *("--router-service", "smg-router", "--router-namespace", e.ns, "--inference-pools", "annotated"),
            ],
        ).start()
        want = {f"http://{host}:{p}": (MODEL, "regular", f"{e.ns}.smg") for p in ports}
        wait_until(lambda: registered(e, "router-0") == want, timeout=SETTLE, what="the chart's pool registered")
        cp.mark_terminating(e.ns, "llama-a")
        wait_until(lambda: registered(e, "router-0") == {}, timeout=SETTLE, what="its pod's workers gone")
        cp.release_pod(e.ns, "llama-a")
        assert cp.api("GET", pool_path(e.ns, "smg"))["metadata"]["resourceVersion"] == version
        log = e.operator.proc.log()
        messages = re.sub(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ", "", log, flags=re.M)  # a ",403" ms is no 403
        assert "403" not in messages and "Forbidden" not in log and "forbidden" not in log, log[-3000:]
    finally:
        e.stop()
