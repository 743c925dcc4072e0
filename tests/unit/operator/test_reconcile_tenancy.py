"""One reconcile pass under the tenancy allow-lists, with real router calls to a closed port: a refused router
gets no call at all, and a refused static endpoint empties the desired set."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiohttp
from smg_operator.desired import PodInfo
from smg_operator.metrics import OperatorMetrics
from smg_operator.reconciler import Runtime, reconcile
from smg_operator.routers import RouterClient
from smg_operator.settings import OperatorSettings
from smg_operator.tenancy import EndpointAllowList
from support.operator_pods import closed_port, ready_pod

NS = "team-a"
TENANT_ROUTER = {(NS, "my-router"): {"app": "my-router"}}
ROUTER = {("smg-system", "smg-router"): {"app": "smg-router"}}


class NoKube:
    """``reconcile`` itself writes nothing to Kubernetes."""

    def now_iso(self) -> str:
        return "2026-01-01T00:00:00Z"

    async def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> bool:
        raise AssertionError("reconcile wrote a status")

    async def post_event(self, *, namespace: str, name: str, uid: str, type: str, reason: str, message: str) -> None:
        raise AssertionError("reconcile posted an Event")


def router_pod(namespace: str, app: str) -> PodInfo:
    return ready_pod(namespace, f"{app}-0", {"app": app}, uid=f"uid-{app}")


def runtime(session: aiohttp.ClientSession, **settings: Any) -> Runtime:
    metrics = OperatorMetrics()
    return Runtime(
        settings=OperatorSettings(router_port=closed_port(), allowed_router_services=frozenset(ROUTER), **settings),
        metrics=metrics,
        kube=NoKube(),
        routers=RouterClient(session=session, token="admin-token", metrics=metrics, timeout=2.0),
    )


def router_calls(rt: Runtime) -> float:
    return sum(s.value for m in rt.metrics.registry.collect() if m.name == "smg_operator_hook_calls" for s in m.samples)


PODS = [router_pod(NS, "my-router"), router_pod("smg-system", "smg-router")]


async def test_a_router_service_outside_the_allow_list_gets_no_call(session: aiohttp.ClientSession) -> None:
    rt = runtime(session)
    spec = {"role": "regular", "model": "m", "endpoints": ["http://10.0.0.1:8000"], "router": {"service": "my-router"}}
    observed = await reconcile(
        rt, namespace=NS, name="w", uid="u", spec=spec, pods=PODS, services={**TENANT_ROUTER, **ROUTER}
    )
    assert observed.router_problem is not None and observed.router_problem[0] == "RouterNotAllowed"
    assert "team-a/my-router" in observed.router_problem[1]
    assert observed.replicas == [] and router_calls(rt) == 0
    # the allowed one is called (here: refused at the closed port), which shows the count above could move
    spec["router"] = {"service": "smg-router", "namespace": "smg-system"}
    observed = await reconcile(rt, namespace=NS, name="w", uid="u", spec=spec, pods=PODS, services=ROUTER)
    assert observed.router_problem is None and [r.reachable for r in observed.replicas] == [False]
    assert router_calls(rt) == 1


async def test_a_refused_static_endpoint_leaves_nothing_desired(session: aiohttp.ClientSession) -> None:
    rt = runtime(session, allowed_endpoints=EndpointAllowList.parse(["127.0.0.0/8"]))
    spec = {
        "role": "regular",
        "model": "m",
        "endpoints": ["http://127.0.0.9:8000", "http://169.254.169.254:80"],
        "router": {"service": "smg-router", "namespace": "smg-system"},
    }
    observed = await reconcile(rt, namespace=NS, name="w", uid="u", spec=spec, pods=PODS, services=ROUTER)
    assert observed.desired.workers == ()  # not even the allowed 127.0.0.9: no partial apply
    assert observed.endpoint_problem is not None and observed.endpoint_problem[0] == "EndpointNotAllowed"
    assert "http://169.254.169.254:80" in observed.endpoint_problem[1]
    assert "127.0.0.9" not in observed.endpoint_problem[1]
    spec["endpoints"] = ["http://127.0.0.9:8000"]
    observed = await reconcile(rt, namespace=NS, name="w", uid="u", spec=spec, pods=PODS, services=ROUTER)
    assert observed.endpoint_problem is None and [w.url for w in observed.desired.workers] == ["http://127.0.0.9:8000"]
