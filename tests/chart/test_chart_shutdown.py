"""Router settings the chart passes on: graceful shutdown (preStop, grace period, timeout), timeouts, the API key."""

from __future__ import annotations

import pytest
from support.helm_chart import render


@pytest.mark.parametrize(("delay", "close", "timeout"), [(5, 2, 30), (0, 0, 120)])
def test_prestop_and_grace_period_follow_the_shutdown_values(delay: int, close: int, timeout: int) -> None:
    out = render({"router": {"shutdownDelay": delay, "closeDelay": close, "shutdownTimeout": timeout}})
    deployment = out.get("Deployment", "smg-router")
    pod = deployment["spec"]["template"]["spec"]
    router = pod["containers"][0]
    assert router["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(delay)]
    env = {e["name"]: e.get("value") for e in router["env"]}
    assert env["SMG_SHUTDOWN_TIMEOUT"] == str(timeout)
    assert env["SMG_SHUTDOWN_DELAY"] == str(close)  # after preStop's wait: Connection: close answers only
    assert pod["terminationGracePeriodSeconds"] == delay + close + timeout + 10


def test_the_upstream_and_body_timeouts_reach_the_router() -> None:
    out = render({"router": {"firstByteTimeout": 45, "streamIdleTimeout": 30, "bodyTimeout": 20}})
    router = out.get("Deployment", "smg-router")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in router["env"]}
    assert env["SMG_FIRST_BYTE_TIMEOUT"] == "45" and env["SMG_STREAM_IDLE_TIMEOUT"] == "30"
    assert env["SMG_BODY_TIMEOUT"] == "20"
    default = render({}).get("Deployment", "smg-router")["spec"]["template"]["spec"]["containers"][0]
    assert {e["name"]: e.get("value") for e in default["env"]}["SMG_BODY_TIMEOUT"] == "60"


def test_the_data_plane_key_comes_from_the_named_secret_only_when_one_is_named() -> None:
    def env(values: dict) -> dict:
        router = render(values).get("Deployment", "smg-router")["spec"]["template"]["spec"]["containers"][0]
        return {e["name"]: e for e in router["env"]}

    assert "SMG_API_KEY" not in env({})
    key = env({"auth": {"apiKeySecret": {"name": "clients", "key": "token"}}})["SMG_API_KEY"]
    assert key["valueFrom"]["secretKeyRef"] == {"name": "clients", "key": "token"}
