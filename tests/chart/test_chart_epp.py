"""EPP mode (``epp.enabled``): the router replicas as the Endpoint Picker of a Gateway API Inference Extension
gateway.  What renders and how it is wired (EPP Service -> router pods, InferencePool -> EPP Service, HTTPRoute ->
InferencePool, the operator taking the pool with read-only RBAC), that every rendered InferencePool and HTTPRoute
validates against the upstream CRDs' schemas (vendored under tests/data/crds), and that nothing of it renders by
default."""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from smg_operator.inference_pools import pool_info, takes
from smg_operator.settings import parse_settings
from support.helm_chart import REPO, Rendered, example_values, lint, render

CRDS = REPO / "tests" / "data" / "crds"
POOL_CRD = yaml.safe_load((CRDS / "inference.networking.k8s.io_inferencepools.yaml").read_text())
HTTPROUTE = json.loads((CRDS / "httproute-v1.schema.json").read_text())
EPP = {
    "epp": {
        "enabled": True,
        "inferencePool": {"selector": {"app": "llama"}, "model": "meta/llama-3", "targetPorts": [8000, 8001]},
        "httpRoute": {"enabled": True, "parentRefs": [{"name": "inference-gateway"}], "requestTimeout": "300s"},
    }
}


def closed(schema: Any) -> Any:
    """Every schema node with ``properties`` closed to unknown fields (the API server would prune them silently)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items() if k != "x-kubernetes-validations"}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


POOL_SCHEMA = closed(next(v for v in POOL_CRD["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"])
ROUTE_SCHEMA = closed(HTTPROUTE["openAPIV3Schema"])


def schema_errors(obj: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in jsonschema.Draft7Validator(schema).iter_errors(obj)]


@pytest.fixture(scope="module")
def epp() -> Rendered:
    return render(EPP)


def container(r: Rendered, deployment: str) -> dict[str, Any]:
    return r.get("Deployment", deployment)["spec"]["template"]["spec"]["containers"][0]


def operator_rules(r: Rendered) -> list[dict[str, Any]]:
    return [rule for role in [*r.of_kind("Role"), *r.of_kind("ClusterRole")] for rule in role["rules"]]


def pool_rules(r: Rendered) -> list[dict[str, Any]]:
    return [rule for rule in operator_rules(r) if "inference.networking.k8s.io" in rule["apiGroups"]]


def test_off_by_default_none_of_it_renders() -> None:
    r = render({})
    assert not r.of_kind("InferencePool") and not r.of_kind("HTTPRoute")
    assert all(not s["metadata"]["name"].endswith("-epp") for s in r.of_kind("Service"))
    router = container(r, "smg-router")
    assert not {e["name"] for e in router["env"]} & {"SMG_EPP_PORT", "SMG_EPP_HEALTH_PORT"}
    assert {p["name"] for p in router["ports"]} == {"http", "admin"}
    assert "--inference-pools" not in container(r, "smg-operator")["args"]
    assert pool_rules(r) == []


def test_the_epp_service_is_grpc_over_http2_to_the_very_router_pods_the_operator_registers_on(epp: Rendered) -> None:
    service = epp.get("Service", "smg-router-epp")
    assert service["spec"]["selector"] == epp.get("Service", "smg-router")["spec"]["selector"]
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert (grpc["port"], grpc["targetPort"], grpc["appProtocol"]) == (9002, "epp", "http2")
    router = container(epp, "smg-router")
    env = {e["name"]: e.get("value") for e in router["env"]}
    assert (env["SMG_EPP_PORT"], env["SMG_EPP_HEALTH_PORT"]) == ("9002", "9003")
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    assert (ports["epp"], ports["epp-health"]) == (9002, 9003)


def test_the_pool_points_at_the_epp_service_and_the_real_operator_takes_it(
    epp: Rendered, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = epp.get("InferencePool", "smg")
    ref = pool["spec"]["endpointPickerRef"]
    assert (ref["kind"], ref["name"], ref["port"]["number"]) == ("Service", "smg-router-epp", 9002)
    assert pool["spec"]["selector"] == {"matchLabels": {"app": "llama"}}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}, {"number": 8001}]
    route = epp.get("HTTPRoute", "smg")
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "smg"}]
    assert route["spec"]["parentRefs"] == [{"name": "inference-gateway"}]
    # the operator as the chart starts it takes this very pool, under its model
    for var in [v for v in os.environ if v.startswith("SMG_OPERATOR_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("POD_NAMESPACE", "smg")
    settings = parse_settings(container(epp, "smg-operator")["args"])
    assert settings.inference_pools == "annotated"
    info = pool_info(pool)
    assert takes(info, mode=settings.inference_pools, router_service=settings.router_service)
    assert info.annotations["smg.dev/model"] == "meta/llama-3"


def test_the_operator_may_only_read_pools_and_only_when_it_takes_them(epp: Rendered) -> None:
    assert pool_rules(epp) == [
        {
            "apiGroups": ["inference.networking.k8s.io"],
            "resources": ["inferencepools"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    # without a rendered pool: only when asked for
    own_pool_elsewhere = copy.deepcopy(EPP)
    own_pool_elsewhere["epp"]["inferencePool"]["create"] = False
    own_pool_elsewhere["epp"]["httpRoute"]["enabled"] = False
    assert pool_rules(render(own_pool_elsewhere)) == []
    asked = render({"operator": {"inferencePools": {"enabled": True, "mode": "all"}, "clusterWide": True}})
    assert [r["verbs"] for r in pool_rules(asked)] == [["get", "list", "watch"]]
    assert asked.of_kind("ClusterRole")
    args = container(asked, "smg-operator")["args"]
    assert args[args.index("--inference-pools") + 1] == "all"


@pytest.mark.parametrize("config", ["values", "example"])
def test_every_rendered_pool_and_route_validates_against_the_upstream_crd_schemas(config: str) -> None:
    r = render(EPP if config == "values" else example_values("epp"))
    pools, routes = r.of_kind("InferencePool"), r.of_kind("HTTPRoute")
    assert len(pools) == 1 and len(routes) == 1
    for pool in pools:
        assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
        assert not schema_errors(pool, POOL_SCHEMA), schema_errors(pool, POOL_SCHEMA)
    for route in routes:
        assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
        assert not schema_errors(route, ROUTE_SCHEMA), schema_errors(route, ROUTE_SCHEMA)
    for obj in r.all:
        if obj["kind"] not in {"InferencePool", "HTTPRoute"}:
            kubernetes_validate.validate(obj, "1.30", strict=True)


def test_the_schema_checks_are_not_rubber_stamps(epp: Rendered) -> None:
    pool = copy.deepcopy(epp.get("InferencePool", "smg"))
    pool["spec"]["endpointPickerRef"]["failureMode"] = "FailSometimes"
    pool["spec"]["targetPort"] = pool["spec"].pop("targetPorts")
    errors = schema_errors(pool, POOL_SCHEMA)
    assert any("FailSometimes" in e for e in errors) and any("targetPort" in e for e in errors), errors
    route = copy.deepcopy(epp.get("HTTPRoute", "smg"))
    route["spec"]["rules"][0]["backendRef"] = route["spec"]["rules"][0].pop("backendRefs")
    assert schema_errors(route, ROUTE_SCHEMA)


def test_epp_mode_lints_for_old_and_recent_kubernetes() -> None:
    for kube_version in ("v1.20.2", "v1.30.0"):
        assert not lint(EPP, kube_version=kube_version)


def test_the_notes_say_where_the_gateway_asks(epp: Rendered) -> None:
    assert "smg-router-epp.smg.svc:9002" in epp.notes
    assert "InferencePool smg" in epp.notes and "HTTPRoute smg" in epp.notes
    assert "EPP mode" not in render({}).notes


def test_the_network_policy_opens_the_epp_ports_to_the_gateway() -> None:
    def epp_rule(r: Rendered) -> dict[str, Any]:
        policy = r.get("NetworkPolicy", "smg-router")
        (rule,) = [i for i in policy["spec"]["ingress"] if {p["port"] for p in i["ports"]} == {9002, 9003}]
        return rule

    assert "from" not in epp_rule(render(EPP))  # like the data port: from anywhere
    gateway = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "istio-system"}}}]
    assert epp_rule(render({**EPP, "networkPolicy": {"eppFrom": gateway}}))["from"] == gateway
    policy = render({}).get("NetworkPolicy", "smg-router")
    assert all(9002 not in {p["port"] for p in i["ports"]} for i in policy["spec"]["ingress"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"inferencePool": {"selector": {}}}, "needs epp.inferencePool.selector"),
        ({"inferencePool": {"model": ""}}, "needs epp.inferencePool.model"),
        ({"httpRoute": {"parentRefs": []}}, "needs epp.httpRoute.parentRefs"),
        ({"port": 30000}, "epp.port and epp.healthPort must differ"),
    ],
)
def test_an_epp_mode_that_cannot_work_is_refused(change: dict[str, Any], message: str) -> None:
    values = copy.deepcopy(EPP)
    for key, value in change.items():
        if isinstance(value, dict):
            values["epp"][key].update(value)
        else:
            values["epp"][key] = value
    with pytest.raises(Exception, match=message):
        render(values)


def test_the_values_schema_refuses_a_failure_mode_gateways_do_not_know() -> None:
    values = copy.deepcopy(EPP)
    values["epp"]["inferencePool"]["failureMode"] = "FailSometimes"
    with pytest.raises(Exception, match="failureMode"):
        render(values)
