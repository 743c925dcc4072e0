"""The chart's admin-port wiring with real processes on the real API server: a router started with the admin
port the chart gives it, the operator with the command line the chart renders, and the SMGWorker the chart's
simulated fleet declares.  The operator registers through the admin port; the data port refuses changes."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from support.helm_chart import Rendered, render
from support.kube import ControlPlane
from support.operator_env import KEY, Env, new_env
from support.operator_proc import SETTLE, OperatorProcess
from support.procs import MODEL, free_port, http_json, wait_until

NS = "smg-wiring"


def _args_without_metrics(args: list[str]) -> list[str]:
    """The chart's operator args less the metrics address (OperatorProcess gives its own loopback one)."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("--metrics-host", "--metrics-port"):
            skip = True
        else:
            out.append(arg)
    return out


@pytest.fixture(scope="module")
def wired(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Env, Rendered]]:
    e = new_env(control_plane, tmp_path_factory.mktemp("chart-admin-port"), NS, replicas=1)
    host = e.router_hosts["router-0"]
    admin_port = next(p for p in iter(lambda: free_port(host), None) if p != e.router_port)
    rendered = render(
        {
            "router": {"port": e.router_port, "adminPort": admin_port},
            "sim": {"enabled": True, "model": MODEL, "port": e.worker_port, "regular": {"replicas": 1}},
        },
        namespace=NS,
    )
    router_env = {
        v["name"]: v["value"]
        for v in rendered.get("Deployment", "smg-router")["spec"]["template"]["spec"]["containers"][0]["env"]
        if "value" in v
    }
    assert router_env["SMG_ADMIN_PORT"] == str(admin_port)
    e.add_service("smg-router", "smg-router")
    e.add_router_pod("router-0", args=["--admin-port", router_env["SMG_ADMIN_PORT"]])
    operator_args = rendered.get("Deployment", "smg-operator")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert control_plane.kubeconfig is not None
    e.operator = OperatorProcess(
        e.logs, control_plane.kubeconfig, admin_key=KEY, args=_args_without_metrics(operator_args)
    ).start()
    yield e, rendered
    e.operator.stop()
    for proc in [*e.routers.values(), *e.sims.values()]:
        proc.stop()


def test_the_operator_registers_through_the_admin_port_the_chart_wires(wired: tuple[Env, Rendered]) -> None:
    e, rendered = wired
    worker = rendered.get("SMGWorker", "smg-sim-regular")
    admin_port = worker["spec"]["router"]["port"]
    assert admin_port != e.router_port
    labels = rendered.get("Deployment", "smg-sim-regular")["spec"]["template"]["metadata"]["labels"]
    sim = e.add_worker_pod("sim-0", labels)
    e.cp.apply_yaml(json.dumps(worker), NS)
    wait_until(lambda: sim.url in e.urls("router-0"), timeout=SETTLE, what="registration through the admin port")
    router = e.routers["router-0"]
    admin = f"http://{router.host}:{admin_port}"
    assert sim.url in {w["url"] for w in http_json("GET", admin + "/workers")[1]["workers"]}
    # a change on the data port, even with the token, is refused and names the admin port
    status, body = http_json(
        "POST", router.url + "/workers", {"url": "http://10.0.0.9:8000"}, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert status == 404 and str(admin_port) in body["error"]["message"], body
