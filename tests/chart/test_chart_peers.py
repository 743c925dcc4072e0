"""The chart's ``router.peers``: the replicas find each other through a headless Service and tell each other their
routes on the admin port (``smg_router.coordination``; the router side:
tests/integration/router/test_peer_routes.py)."""

from __future__ import annotations

from typing import Any

import pytest
from smg_router.settings import parse_settings
from support.helm_chart import NAMESPACE, Rendered, render


def _env(r: Rendered) -> dict[str, str | None]:
    container = r.get("Deployment", "smg-router")["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value") for e in container["env"]}


@pytest.mark.parametrize("admin_port, port_name", [(30001, "admin"), (0, "http")])
def test_the_replicas_find_each_other_by_a_headless_service_on_the_port_of_the_admin_api(
    admin_port: int, port_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = render({"router": {"adminPort": admin_port}, "networkPolicy": {"enabled": admin_port != 0}})
    port = admin_port or 30000
    peers = r.get("Service", "smg-router-peers")
    spec: dict[str, Any] = peers["spec"]
    assert spec["clusterIP"] == "None"
    assert spec["selector"] == r.get("Service", "smg-router")["spec"]["selector"]
    assert spec["ports"] == [{"name": port_name, "port": port, "targetPort": port_name, "protocol": "TCP"}]
    assert "publishNotReadyAddresses" not in spec  # only ready replicas: one that is not yet serving is no peer
    env = _env(r)
    assert env["SMG_PEERS_DNS"] == f"smg-router-peers.{NAMESPACE}.svc:{port}"
    for name, value in env.items():  # what the router parses from that environment
        if value is not None:
            monkeypatch.setenv(name, value)
    settings = parse_settings([])
    assert settings.peers.dns == f"smg-router-peers.{NAMESPACE}.svc:{port}"
    assert settings.peers.ready_grace == 5.0  # Ready once in sync with the peers, at most 5 s after the start


def test_the_grace_before_a_replica_is_ready_without_its_peers_is_a_value(monkeypatch: pytest.MonkeyPatch) -> None:
    env = _env(render({"router": {"peers": {"readyGraceSeconds": 12.5}}}))
    monkeypatch.setenv("SMG_PEERS_READY_GRACE", str(env["SMG_PEERS_READY_GRACE"]))
    assert parse_settings([]).peers.ready_grace == 12.5


def test_without_peers_the_replicas_do_not_talk() -> None:
    r = render({"router": {"peers": {"enabled": False}}})
    assert "Service/smg-router-peers" not in r.names()
    assert "SMG_PEERS_DNS" not in _env(r) and "SMG_PEERS_READY_GRACE" not in _env(r)
