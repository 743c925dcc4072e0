"""One chart for Kubernetes 1.20 through current: APIs chosen by capability, and pods that run anywhere.

* ``kubeVersion`` admits 1.20; the PodDisruptionBudget is policy/v1beta1 on 1.20 and policy/v1 from 1.21 on,
  whether Helm knows the cluster from its discovery (install, upgrade: shown on the real 1.20 API server in
  tests/kube/test_chart_on_apiserver.py) or only from ``--kube-version`` (``helm template``);
* no service links (``SMG_OPERATOR_METRICS_PORT=tcp://...`` crashed the operator), ``protocol: TCP`` on every
  port (Helm v4's server-side apply on 1.20 rejects a Service port without it);
* non-root, any uid, read-only root filesystem, no privilege escalation, no capabilities, /tmp an emptyDir.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from support.helm_chart import CHART, Rendered, render

EVERYTHING = {
    "sim": {"enabled": True},
    "operator": {"replicas": 2},
    "networkPolicy": {"enabled": True},
    "monitoring": {"serviceMonitor": {"enabled": True}},
}
SIM_PD = {"router": {"pd": {"enabled": True}}, "sim": {"enabled": True, "pd": {"enabled": True}}}


def pod_specs(r: Rendered) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in r.of_kind("Deployment")}


@pytest.fixture(scope="module", params=["everything", "sim-pd"])
def rendered(request: pytest.FixtureRequest) -> Rendered:
    return render(EVERYTHING if request.param == "everything" else SIM_PD)


def test_the_chart_admits_kubernetes_1_20() -> None:
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"] == ">=1.20.0-0"


@pytest.mark.parametrize(
    "kube_version, api",
    [
        ("v1.20.2", "policy/v1beta1"),
        ("v1.20.15", "policy/v1beta1"),
        ("v1.21.0", "policy/v1"),
        ("v1.25.3", "policy/v1"),
        ("v1.36.0", "policy/v1"),
        (None, "policy/v1"),  # Helm's own default version
    ],
)
def test_the_pod_disruption_budget_api_follows_the_kubernetes_version(kube_version: str | None, api: str) -> None:
    r = render(kube_version=kube_version) if kube_version else render()
    assert r.get("PodDisruptionBudget", "smg-router")["apiVersion"] == api


def test_every_pod_template_turns_service_links_off(rendered: Rendered) -> None:
    specs = pod_specs(rendered)
    assert len(specs) >= 3
    for name, spec in specs.items():
        assert spec["enableServiceLinks"] is False, name


def test_every_service_container_and_policy_port_says_tcp(rendered: Rendered) -> None:
    seen = 0
    for service in rendered.of_kind("Service"):
        for port in service["spec"]["ports"]:
            assert port["protocol"] == "TCP", (service["metadata"]["name"], port)
            seen += 1
    for name, spec in pod_specs(rendered).items():
        for c in spec["containers"]:
            for port in c.get("ports", []):
                assert port["protocol"] == "TCP", (name, port)
                seen += 1
    for policy in rendered.of_kind("NetworkPolicy"):
        for rule in policy["spec"]["ingress"]:
            for port in rule["ports"]:
                assert port["protocol"] == "TCP", port
    assert seen >= 6


def test_pods_run_non_root_read_only_without_privileges(rendered: Rendered) -> None:
    for name, spec in pod_specs(rendered).items():
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        tmp = [v for v in spec["volumes"] if v["name"] == "tmp"]
        assert tmp == [{"name": "tmp", "emptyDir": {}}], name
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, name
            assert sc["capabilities"] == {"drop": ["ALL"]}, name
            assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"], name


def test_any_uid_the_platform_picks_works() -> None:
    """OpenShift's restricted SCC assigns the uid: the chart can leave uid, gid and fsGroup out."""
    r = render(
        {"podSecurityContext": {"runAsUser": None, "runAsGroup": None, "fsGroup": None}, "sim": {"enabled": True}}
    )
    for name, spec in pod_specs(r).items():
        assert spec["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}, name
