"""The router's admin port and the optional NetworkPolicy that fences it off.

The router serves the worker lifecycle changes only on router.adminPort (its --admin-port, shown in
tests/integration/router/test_admin_port.py); the chart points the operator and the SMGWorkers at that port and,
with networkPolicy.enabled, lets only the operator pods and the configured peers reach it.  The rendered policy
is checked by evaluating it the way the NetworkPolicy API defines (a peer reaches a port when some ingress rule
lists the port and one of its `from` peers matches, or the rule has no `from`).
"""

from __future__ import annotations

from typing import Any

import pytest
from support.helm_chart import NAMESPACE, Rendered, render

ENABLED = {
    "networkPolicy": {
        "enabled": True,
        "adminNamespaces": ["platform"],
        "adminFrom": [
            {"namespaceSelector": {"matchLabels": {"team": "ops"}}, "podSelector": {"matchLabels": {"app": "ci"}}}
        ],
    },
    "sim": {"enabled": True},
}


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # the chart writes matchLabels only
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def _peer_matches(peer: dict[str, Any], ns: str, ns_labels: dict[str, str], pod_labels: dict[str, str]) -> bool:
    if "namespaceSelector" in peer:
        if not _matches(peer["namespaceSelector"], ns_labels):
            return False
    elif ns != NAMESPACE:  # a podSelector alone means pods of the policy's own namespace
        return False
    return "podSelector" not in peer or _matches(peer["podSelector"], pod_labels)


def allowed(
    policy: dict[str, Any], port: int, *, ns: str, pod: dict[str, str], ns_labels: dict[str, str] | None = None
) -> bool:
    ns_labels = {"kubernetes.io/metadata.name": ns, **(ns_labels or {})}
    for rule in policy["spec"]["ingress"]:
        if rule.get("ports") and not any(p["port"] == port and p["protocol"] == "TCP" for p in rule["ports"]):
            continue
        if "from" not in rule or any(_peer_matches(p, ns, ns_labels, pod) for p in rule["from"]):
            return True
    return False


def pod_labels(r: Rendered, deployment: str) -> dict[str, str]:
    return r.get("Deployment", deployment)["spec"]["template"]["metadata"]["labels"]


def container(r: Rendered, deployment: str) -> dict[str, Any]:
    return r.get("Deployment", deployment)["spec"]["template"]["spec"]["containers"][0]


@pytest.fixture(scope="module")
def enabled() -> Rendered:
    return render(ENABLED)


def test_the_router_gets_an_admin_port_and_everything_that_registers_uses_it(enabled: Rendered) -> None:
    router = container(enabled, "smg-router")
    assert {p["name"]: p["containerPort"] for p in router["ports"]} == {"http": 30000, "admin": 30001}
    env = {e["name"]: e.get("value") for e in router["env"]}
    assert env["SMG_PORT"] == "30000" and env["SMG_ADMIN_PORT"] == "30001"
    args = container(enabled, "smg-operator")["args"]
    assert args[args.index("--router-port") + 1] == "30001"
    assert enabled.get("SMGWorker", "smg-sim-regular")["spec"]["router"]["port"] == 30001
    admin = enabled.get("Service", "smg-router-admin")
    assert admin["spec"]["type"] == "ClusterIP"
    assert admin["spec"]["ports"] == [{"name": "admin", "port": 30001, "targetPort": "admin", "protocol": "TCP"}]
    assert admin["spec"]["selector"] == enabled.get("Service", "smg-router")["spec"]["selector"]
    # the data Service does not carry the admin port
    assert [p["port"] for p in enabled.get("Service", "smg-router")["spec"]["ports"]] == [30000]


def test_with_admin_port_zero_everything_stays_on_the_main_port() -> None:
    r = render({"router": {"adminPort": 0}, "networkPolicy": {"enabled": False}, "sim": {"enabled": True}})
    router = container(r, "smg-router")
    assert [p["name"] for p in router["ports"]] == ["http"]
    assert "SMG_ADMIN_PORT" not in {e["name"] for e in router["env"]}
    args = container(r, "smg-operator")["args"]
    assert args[args.index("--router-port") + 1] == "30000"
    assert r.get("SMGWorker", "smg-sim-regular")["spec"]["router"]["port"] == 30000
    assert "Service/smg-router-admin" not in r.names()


def test_the_network_policies_are_on_by_default_and_fence_off_the_admin_port_and_the_operator() -> None:
    """Without any values: the router's admin port (the lifecycle API, the replicas' batches) only from this
    release's operator and router pods; the operator's port from nobody but the peers listed (none)."""
    r = render({"sim": {"enabled": True}})
    policy = r.get("NetworkPolicy", "smg-router")
    operator, sim, router = (pod_labels(r, d) for d in ("smg-operator", "smg-sim-regular", "smg-router"))
    assert policy["spec"]["podSelector"]["matchLabels"] == router
    assert allowed(policy, 30000, ns=NAMESPACE, pod=sim)
    assert allowed(policy, 30001, ns=NAMESPACE, pod=operator) and allowed(policy, 30001, ns=NAMESPACE, pod=router)
    assert not allowed(policy, 30001, ns=NAMESPACE, pod=sim)
    assert not allowed(policy, 30001, ns=NAMESPACE, pod={**router, "app.kubernetes.io/instance": "other"})
    assert not allowed(policy, 30001, ns="elsewhere", pod=router)
    own = r.get("NetworkPolicy", "smg-operator")
    assert own["spec"]["podSelector"]["matchLabels"] == operator
    assert own["spec"]["policyTypes"] == ["Ingress"] and own["spec"]["ingress"] == []
    for pod in (router, sim, operator):
        assert not allowed(own, 8080, ns=NAMESPACE, pod=pod)
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    scraped = render({"networkPolicy": {"operatorFrom": [prometheus]}}).get("NetworkPolicy", "smg-operator")
    assert allowed(scraped, 8080, ns="monitoring", pod={})
    assert not allowed(scraped, 8080, ns=NAMESPACE, pod=router)
    assert not render({"networkPolicy": {"enabled": False}}).of_kind("NetworkPolicy")


def test_only_the_operator_and_the_configured_peers_reach_the_admin_port(enabled: Rendered) -> None:
    policy = enabled.get("NetworkPolicy", "smg-router")
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["podSelector"]["matchLabels"] == pod_labels(enabled, "smg-router")
    operator, sim, router = (pod_labels(enabled, d) for d in ("smg-operator", "smg-sim-regular", "smg-router"))
    ci = {"app": "ci"}
    # the data port: open to anyone
    for ns, pod in [(NAMESPACE, sim), (NAMESPACE, operator), ("elsewhere", {"app": "x"}), ("platform", {})]:
        assert allowed(policy, 30000, ns=ns, pod=pod), (ns, pod)
    # the admin port: the operator, pods of the listed namespace, the listed peers; nobody else
    assert allowed(policy, 30001, ns=NAMESPACE, pod=operator)
    assert allowed(policy, 30001, ns="platform", pod={"app": "anything"})
    assert allowed(policy, 30001, ns="ops-1", ns_labels={"team": "ops"}, pod=ci)
    assert not allowed(policy, 30001, ns="ops-1", ns_labels={"team": "ops"}, pod={"app": "other"})
    assert not allowed(policy, 30001, ns="dev", pod=ci)
    assert not allowed(policy, 30001, ns=NAMESPACE, pod=sim)
    assert allowed(policy, 30001, ns=NAMESPACE, pod=router)  # the other replicas, telling it their routes
    assert not allowed(policy, 30001, ns="elsewhere", pod=router)
    assert not allowed(policy, 30001, ns="elsewhere", pod=operator)  # operator labels in another namespace
    # any other port of the router pods: closed
    assert not allowed(policy, 8080, ns=NAMESPACE, pod=operator)
    # without router.peers the replicas do not talk: their pods are no admin client
    alone = render({**ENABLED, "router": {"peers": {"enabled": False}}})
    assert not allowed(alone.get("NetworkPolicy", "smg-router"), 30001, ns=NAMESPACE, pod=router)
    assert allowed(alone.get("NetworkPolicy", "smg-router"), 30001, ns=NAMESPACE, pod=operator)


def test_without_the_operator_only_the_configured_peers_reach_the_admin_port() -> None:
    r = render({"networkPolicy": {"enabled": True, "adminNamespaces": ["platform"]}, "operator": {"enabled": False}})
    policy = r.get("NetworkPolicy", "smg-router")
    assert allowed(policy, 30001, ns="platform", pod={})
    assert not allowed(policy, 30001, ns=NAMESPACE, pod={"app.kubernetes.io/component": "operator"})
    closed = render({"networkPolicy": {"enabled": True}, "operator": {"enabled": False}})
    assert not allowed(closed.get("NetworkPolicy", "smg-router"), 30001, ns=NAMESPACE, pod={})


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"networkPolicy": {"enabled": True}, "router": {"adminPort": 0}},
            "networkPolicy.enabled needs router.adminPort",
        ),
        ({"router": {"adminPort": 30000}}, "router.adminPort must differ from router.port"),
    ],
)
def test_a_policy_that_cannot_tell_the_ports_apart_is_refused(values: dict, message: str) -> None:
    with pytest.raises(Exception, match=message):
        render(values)


def test_notes_say_where_worker_changes_go(enabled: Rendered) -> None:
    assert "port-forward svc/smg-router-admin 30001:30001" in enabled.notes
    assert (
        "NetworkPolicy smg-router lets only the operator, the other router replicas and the configured peers reach "
        "that port" in enabled.notes
    )
    assert "smg-router-admin" not in render({"router": {"adminPort": 0}, "networkPolicy": {"enabled": False}}).notes
