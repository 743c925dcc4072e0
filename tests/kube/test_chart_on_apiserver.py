"""The Helm chart against the real 1.20 API server: what it renders for this server passes a server-side dry
run; a real ``helm install`` / ``helm upgrade`` (the Helm SDK's actions, server-side apply, capabilities and
``lookup`` from the live server) picks the APIs 1.20 serves and keeps or follows the admin token; and the
operator runs with nothing but the chart's own ServiceAccount and RBAC (a token bound to that ServiceAccount).

The server has no controllers or kubelet: installed Deployments make no pods, which is all these tests need.
No Job runs either, so the releases here turn the pre-delete hook off (``tests/e2e`` runs it in a real
cluster); its RBAC is checked here by running ``smg-operator-uninstall`` with the hook's own ServiceAccount.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import helm_python as helm
import pytest
from support.helm_chart import CHART, example_values, render, server_capabilities
from support.kube import ControlPlane
from support.operator_env import KEY, Env, new_env, pool
from support.operator_proc import SETTLE, OperatorProcess
from support.procs import wait_until

NS = "smg"  # the release namespace the chart renders for
CHECKSUM = "checksum/admin-token"
NO_JOBS = {"uninstallHook": {"enabled": False}}
"""Operator values of every release here: a pre-delete hook Job would never finish without a kubelet."""
DRY_RUN_CONFIGS = {
    "defaults": {},
    "regular": example_values("regular"),
    "pd": example_values("pd"),
    "sim": example_values("sim"),
    "network-policy-ha": {
        "networkPolicy": {"enabled": True, "adminNamespaces": ["platform"]},
        "operator": {"replicas": 2, "allowedEndpoints": ["10.0.0.0/8"]},
        "auth": {"existingSecret": "team-admin"},
        "sim": {"enabled": True},
    },
}


def _apply_crds(cp: ControlPlane) -> None:
    for crd in render().crds:  # CRDs for real: the custom resources in the chart need them
        cp.apply_yaml(json.dumps(crd))
    cp.wait_crd_established("smgworkers.smg.dev")


def _ensure_namespace(cp: ControlPlane, ns: str) -> None:
    if cp.request("GET", f"/api/v1/namespaces/{ns}")[0] == 404:
        cp.create_namespace(ns)


@pytest.mark.parametrize("config", sorted(DRY_RUN_CONFIGS))
def test_rendered_chart_passes_a_server_side_dry_run(control_plane: ControlPlane, config: str) -> None:
    """Rendered as Helm renders for this server (its version and discovery): no hand-made apiVersion fixes."""
    cp = control_plane
    kube_version, api_versions = server_capabilities(lambda path: cp.api("GET", path))
    assert kube_version.startswith("v1.20.") and "policy/v1" not in api_versions
    rendered = render(DRY_RUN_CONFIGS[config], namespace=NS, kube_version=kube_version, api_versions=api_versions)
    assert rendered.get("PodDisruptionBudget", "smg-router")["apiVersion"] == "policy/v1beta1"
    _apply_crds(cp)
    _ensure_namespace(cp, NS)
    docs = {"apiVersion": "v1", "kind": "List", "items": rendered.objects}
    out = cp.kubectl("apply", "--dry-run=server", "-n", NS, "-f", "-", input=json.dumps(docs)).stdout
    for obj in rendered.objects:
        assert f"{obj['kind'].lower()}" in out.lower() and obj["metadata"]["name"] in out, (obj["kind"], out)
    assert out.count("(server dry run)") == len(rendered.objects), out


# -- a real helm install / upgrade ----------------------------------------------------------------------------


class Release:
    """One release of the chart installed into its own namespace with the Helm SDK, as ``helm install`` would."""

    def __init__(self, cp: ControlPlane, namespace: str, name: str = "smg") -> None:
        self.cp, self.namespace, self.name = cp, namespace, name
        _apply_crds(cp)
        _ensure_namespace(cp, namespace)
        self.config = helm.Config(kubeconfig_path=str(cp.kubeconfig), namespace=namespace)

    def install(self, values: dict[str, Any]) -> dict[str, Any]:
        with helm.Chart.load(CHART) as chart:
            return self.config.install(chart, self.name, no_jobs(values), namespace=self.namespace, timeout=60)

    def upgrade(self, values: dict[str, Any], *, reuse_values: bool = False) -> dict[str, Any]:
        with helm.Chart.load(CHART) as chart:
            return self.config.upgrade(
                chart, self.name, no_jobs(values), namespace=self.namespace, timeout=60, reuse_values=reuse_values
            )

    def uninstall(self) -> None:
        self.config.uninstall(self.name)

    def get(self, path: str) -> tuple[int, Any]:
        return self.cp.request("GET", path)

    def deployment(self, name: str) -> dict[str, Any]:
        return self.cp.api("GET", f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{name}")

    def pods(self) -> dict[str, tuple[str | None, int]]:
        """Router and operator Deployments: (checksum annotation, generation)."""
        out = {}
        for name in ("smg-router", "smg-operator"):
            d = self.deployment(name)
            annotations = d["spec"]["template"]["metadata"].get("annotations") or {}
            out[name] = (annotations.get(CHECKSUM), d["metadata"]["generation"])
        return out

    def secret_data(self, name: str, key: str) -> str:
        return self.cp.api("GET", f"/api/v1/namespaces/{self.namespace}/secrets/{name}")["data"][key]

    def salted(self, data: str) -> str:
        """The checksum the chart writes for a Secret's value: salted with its salt Secret's, kept by lookup."""
        return sha256(f"{self.secret_data('smg-checksum-salt', 'salt')}\n{data}")


def no_jobs(values: dict[str, Any]) -> dict[str, Any]:
    return {**values, "operator": {**values.get("operator", {}), **NO_JOBS}}


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_helm_install_on_1_20_picks_policy_v1beta1_and_keeps_the_generated_token(control_plane: ControlPlane) -> None:
    release = Release(control_plane, "smg-install")
    installed = release.install({})
    ns = release.namespace
    # the chart's kubeVersion admits 1.20, and Helm chose the PDB API from the server's discovery
    assert "apiVersion: policy/v1beta1\nkind: PodDisruptionBudget" in installed["manifest"]
    assert release.get(f"/apis/policy/v1beta1/namespaces/{ns}/poddisruptionbudgets/smg-router")[0] == 200
    # by server-side apply, the way 1.20 rejects a Service port without protocol: TCP
    service = control_plane.api("GET", f"/api/v1/namespaces/{ns}/services/smg-router")
    assert {f["operation"] for f in service["metadata"]["managedFields"]} == {"Apply"}
    token = release.secret_data("smg-admin", "admin-api-key")
    assert len(base64.b64decode(token)) == 32
    first = release.pods()
    assert first["smg-router"][0] == first["smg-operator"][0] == release.salted(token) != sha256(token)

    release.upgrade({})  # lookup: the generated token stays, and nothing restarts
    assert release.secret_data("smg-admin", "admin-api-key") == token
    assert release.pods() == first

    release.upgrade({"auth": {"adminApiKey": "rotated-token"}})  # a new token: both pod templates change
    assert release.secret_data("smg-admin", "admin-api-key") == b64("rotated-token")
    rotated = release.pods()
    for name, (checksum, generation) in rotated.items():
        assert checksum == release.salted(b64("rotated-token")) and generation == first[name][1] + 1, name

    release.upgrade({})  # the value dropped again: lookup keeps the Secret's token, still no restart
    assert release.secret_data("smg-admin", "admin-api-key") == b64("rotated-token")
    assert release.pods() == rotated
    # the per-render token the templates keep in .Values.auth is no value of the release's: --reuse-values
    # passes the schema (no unknown auth key) and changes nothing
    kept = json.dumps(release.config.get_values(release.name, all_values=True))
    assert not [k for k in ("_tokenData", "_checksumSalt", "_secretData") if k in kept], kept
    release.upgrade({}, reuse_values=True)
    assert release.pods() == rotated

    release.uninstall()
    assert release.get(f"/apis/apps/v1/namespaces/{ns}/deployments/smg-router")[0] == 404
    assert release.get(f"/api/v1/namespaces/{ns}/secrets/smg-admin")[0] == 404


def test_with_an_existing_secret_the_checksum_follows_its_data(control_plane: ControlPlane) -> None:
    cp = control_plane
    release = Release(cp, "smg-existing")
    ns = release.namespace
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "team-admin"}, "data": {"token": b64("a")}}
    cp.api("POST", f"/api/v1/namespaces/{ns}/secrets", secret)
    values = {
        "auth": {"existingSecret": "team-admin", "secretKey": "token"},
        "networkPolicy": {"enabled": True},
        "operator": {"replicas": 2},
        "sim": {"enabled": True},
    }
    release.install(values)
    assert release.get(f"/api/v1/namespaces/{ns}/secrets/smg-admin")[0] == 404  # no Secret of its own
    assert release.get(f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies/smg-router")[0] == 200
    assert release.get(f"/apis/smg.dev/v1alpha1/namespaces/{ns}/smgworkers/smg-sim-regular")[0] == 200
    first = release.pods()
    assert {checksum for checksum, _ in first.values()} == {release.salted(b64("a"))}

    release.upgrade(values)
    assert release.pods() == first

    cp.api(
        "PATCH",
        f"/api/v1/namespaces/{ns}/secrets/team-admin",
        {"data": {"token": b64("b")}},
        content_type="application/merge-patch+json",
    )
    release.upgrade(values)  # lookup sees the new data: both pod templates change
    for name, (checksum, generation) in release.pods().items():
        assert checksum == release.salted(b64("b")) and generation == first[name][1] + 1, name
    release.uninstall()
    assert release.secret_data("team-admin", "token") == b64("b")  # not the chart's to delete


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
    # its only replica stopped: no router replica answers (docs/operator.md, Ready means ready)
    wait_until(lambda: "NoRouterReachable" in e.event_reasons("pool"), timeout=SETTLE, what="an Event posted")
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


def test_the_uninstall_hook_works_with_nothing_but_its_own_service_account(chart_env: Env) -> None:
    """``smg-operator-uninstall`` under the hook's ServiceAccount (list and delete SMGWorkers, nothing else):
    the release's SMGWorkers deleted and released by the operator, another one left alone."""
    e = chart_env
    rendered = render(namespace=NS)
    job = rendered.get("Job", "smg-operator-uninstall")["spec"]["template"]["spec"]
    token = e.cp.service_account_token(NS, job["serviceAccountName"])
    release_labels = {"app.kubernetes.io/instance": "smg", "app.kubernetes.io/managed-by": "Helm"}
    sim = e.add_worker_pod("w-hook", {"app": "hook"})
    for name, labels, selects in (("released", release_labels, "hook"), ("kept", {}, "nobody")):
        obj = json.loads(pool(name, {"app": selects}, port=e.worker_port, router_port=e.router_port))
        obj["metadata"]["labels"] = labels
        e.cp.apply_yaml(json.dumps(obj), NS)
    wait_until(lambda: sim.url in e.urls("router-0"), timeout=SETTLE, what="the hook's pool registered")
    args = job["containers"][0]["args"]
    assert args[: args.index("--timeout")] == [
        "--namespace",
        NS,
        "--selector",
        ",".join(f"{k}={v}" for k, v in release_labels.items()),
    ]
    env = {**os.environ, "KUBECONFIG": str(e.cp.kubeconfig_for_token(token)), "KUBERNETES_SERVICE_HOST": ""}
    done = subprocess.run(
        [sys.executable, "-m", "smg_operator.uninstall", *args[: args.index("--timeout")], "--timeout", str(SETTLE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=SETTLE + 30,
    )
    assert done.returncode == 0, done.stderr
    assert "Forbidden" not in done.stderr and "403" not in done.stderr, done.stderr
    assert e.smgw("released") is None and e.smgw("kept") is not None
    assert sim.url not in e.urls("router-0")  # deregistered before its finalizer went
    e.cp.kubectl("delete", "smgw", "kept", "-n", NS, "--wait=true")
