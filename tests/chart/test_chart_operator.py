"""The operator's Deployment: probes that let a standby live, leader election with several replicas, the
allow-lists, and a command line and environment the real smg-operator parses into the settings meant."""

from __future__ import annotations

from typing import Any

import pytest
from support.helm_chart import Rendered, render


def operator_container(r: Rendered) -> dict[str, Any]:
    return r.get("Deployment", "smg-operator")["spec"]["template"]["spec"]["containers"][0]


def literal_env(r: Rendered) -> dict[str, str]:
    return {e["name"]: e["value"] for e in operator_container(r)["env"] if "value" in e}


def test_operator_probes_and_leader_election_with_several_replicas() -> None:
    single = render().get("Deployment", "smg-operator")
    assert single["spec"]["strategy"] == {"type": "Recreate"}
    ha = render({"operator": {"replicas": 3}}).get("Deployment", "smg-operator")
    c = ha["spec"]["template"]["spec"]["containers"][0]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}  # any live replica
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}  # the leader only
    assert "--leader-election" in c["args"] and ha["spec"]["replicas"] == 3
    # standbys never become Ready while the old leader lives: a rollout must not wait for them
    assert ha["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "100%"}}


def test_allow_lists_reach_the_operator_as_its_environment() -> None:
    default = literal_env(render())
    assert default["SMG_OPERATOR_ALLOWED_ROUTER_SERVICE"] == "smg/smg-router"
    assert "SMG_OPERATOR_ALLOWED_ENDPOINT" not in default
    listed = literal_env(
        render(
            {
                "operator": {
                    "allowedRouterServices": ["team-a/router", "smg/smg-router"],
                    "allowedEndpoints": ["10.0.0.0/8", "gpu-1.example.com", "*.example.com"],
                }
            }
        )
    )
    assert listed["SMG_OPERATOR_ALLOWED_ROUTER_SERVICE"] == "smg/smg-router,team-a/router"
    assert listed["SMG_OPERATOR_ALLOWED_ENDPOINT"] == "10.0.0.0/8,gpu-1.example.com,*.example.com"


@pytest.mark.parametrize(
    "values",
    [{}, {"operator": {"replicas": 2, "allowedRouterServices": ["team-a/router"], "allowedEndpoints": ["10.0.0.0/8"]}}],
)
def test_the_real_operator_parses_what_the_chart_passes(values: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chart's args and SMG_OPERATOR_* variables are the operator's own: parsed, they give the settings meant
    (a renamed flag or variable fails here, not silently in a cluster)."""
    from smg_operator.settings import parse_settings

    r = render(values)
    for name, value in literal_env(r).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("POD_NAMESPACE", "smg")
    settings = parse_settings(operator_container(r)["args"])
    assert settings.router_service == "smg-router" and settings.router_namespace == "smg"
    assert settings.router_port == 30001
    routers = {
        ("smg", "smg-router"),
        *(tuple(s.split("/")) for s in values.get("operator", {}).get("allowedRouterServices", [])),
    }
    assert settings.allowed_router_services == routers
    assert settings.leader_election is ("replicas" in values.get("operator", {}))
    endpoints = values.get("operator", {}).get("allowedEndpoints")
    if endpoints:
        from smg_operator.tenancy import EndpointAllowList

        assert settings.allowed_endpoints == EndpointAllowList.parse(endpoints)
