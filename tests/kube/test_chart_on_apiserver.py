"""The Helm chart against the real API server: everything it renders passes a server-side dry run, and the
operator runs with nothing but the chart's own ServiceAccount and RBAC (a token bound to that ServiceAccount)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
from support.helm_chart import example_values, render
from support.kube import ControlPlane
from support.operator_env import KEY, Env, new_env, pool
from support.operator_proc import SETTLE, OperatorProcess
from support.procs import wait_until

NS = "smg"  # the release namespace the chart renders for


def _for_1_20(obj: dict) -> dict:
    """The test API server is 1.20, which serves PodDisruptionBudget only as policy/v1beta1 (same spec)."""
    if obj["kind"] == "PodDisruptionBudget" and obj["apiVersion"] == "policy/v1":
        return {**obj, "apiVersion": "policy/v1beta1"}
    return obj


@pytest.mark.parametrize("example", ["defaults", "regular", "pd", "sim"])
def test_rendered_chart_passes_a_server_side_dry_run(control_plane: ControlPlane, example: str) -> None:
    cp = control_plane
    rendered = render({} if example == "defaults" else example_values(example), namespace=NS)
    for crd in rendered.crds:  # CRDs for real: the custom resources in the chart need them
        cp.apply_yaml(json.dumps(crd))
    cp.wait_crd_established("smgworkers.smg.dev")
    if cp.request("GET", f"/api/v1/namespaces/{NS}")[0] == 404:
        cp.create_namespace(NS)
    docs = {"apiVersion": "v1", "kind": "List", "items": [_for_1_20(o) for o in rendered.objects]}
    out = cp.kubectl("apply", "--dry-run=server", "-n", NS, "-f", "-", input=json.dumps(docs)).stdout
    for obj in rendered.objects:
        assert f"{obj['kind'].lower()}" in out.lower() and obj["metadata"]["name"] in out, (obj["kind"], out)
    assert out.count("(server dry run)") == len(rendered.objects), out


@pytest.fixture(scope="module")
def chart_env(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    cp = control_plane
    e = new_env(cp, tmp_path_factory.mktemp("chart-rbac"), NS)
    rendered = render(namespace=NS)
    rbac_kinds = {"ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}
    rbac = [o for o in rendered.objects if o["kind"] in rbac_kinds]
    assert {o["kind"] for o in rbac} == rbac_kinds
    cp.apply_yaml(json.dumps({"apiVersion": "v1", "kind": "List", "items": rbac}), NS)
    operator_sa = rendered.get("Deployment", "smg-operator")["spec"]["template"]["spec"]["serviceAccountName"]
    token = cp.service_account_token(NS, operator_sa)
    kubeconfig = cp.kubeconfig_for_token(token)
    e.add_service("smg-router", "smg-router")
    e.add_router_pod("router-0")
    args = rendered.get("Deployment", "smg-operator")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--namespace") + 1] == NS
    e.operator = OperatorProcess(
        e.logs,
        kubeconfig,
        admin_key=KEY,
        # --router-namespace as the chart passes it: the default router, the only one allowed by default
        args=[
            "--namespace",
            NS,
            "--reconcile-interval",
            "2",
            "--router-service",
            "smg-router",
            "--router-namespace",
            NS,
        ],
    ).start()
    yield e
    e.operator.stop()
    for proc in [*e.routers.values(), *e.sims.values()]:
        proc.stop()


def test_operator_does_its_whole_job_with_the_charts_rbac(chart_env: Env) -> None:
    e = chart_env
    sim = e.add_worker_pod("w-0", {"app": "w"})
    e.cp.apply_yaml(pool("pool", {"app": "w"}, port=e.worker_port, router_port=e.router_port), NS)
    # watch pods and services, patch status, post events: registered and reported
    wait_until(lambda: sim.url in e.urls("router-0"), timeout=SETTLE, what="registration under the chart's RBAC")
    wait_until(lambda: e.condition("pool", "Ready").get("status") == "True", timeout=SETTLE, what="status written")
    e.routers["router-0"].stop()
    wait_until(lambda: "RouterUnreachable" in e.event_reasons("pool"), timeout=SETTLE, what="an Event posted")
    e.start_router("router-0")
    wait_until(lambda: sim.url in e.urls("router-0"), timeout=SETTLE, what="re-registration")
    # the finalizer: added, and removed after deregistration
    assert "smg.dev/finalizer" in (e.smgw("pool") or {})["metadata"].get("finalizers", [])
    e.cp.kubectl("delete", "smgw", "pool", "-n", NS, "--wait=false")
    wait_until(lambda: e.smgw("pool") is None, timeout=SETTLE, what="the finalizer to be removed")
    assert sim.url not in e.urls("router-0")
    log = e.operator.proc.log()
    messages = re.sub(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ", "", log, flags=re.M)  # a ",403" ms is no 403
    assert "403" not in messages and "Forbidden" not in log and "forbidden" not in log, log[-3000:]
