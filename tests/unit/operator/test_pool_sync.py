"""The InferencePool loop's reporting without kopf or an API server: a fake ``Kube`` records Events, and a router
replica on a closed port stands for one that cannot be reached."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiohttp
from smg_operator.inference_pools import pool_info
from smg_operator.metrics import OperatorMetrics
from smg_operator.pool_sync import Indexes, PoolSync
from smg_operator.reconciler import Runtime
from smg_operator.routers import RouterClient
from smg_operator.settings import OperatorSettings
from support.operator_pods import closed_port, ready_pod

NS = "ns"


class EventsOnly:
    """A ``Kube`` that records Events; a status write would fail the test (the gateway owns the pool)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def now_iso(self) -> str:
        return "2026-01-01T00:00:00Z"

    async def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> bool:
        raise AssertionError(f"status written on {namespace}/{name}")

    async def post_event(self, **event: Any) -> None:
        self.events.append(event)


def _indexes(annotations: dict[str, str]) -> Indexes:
    body = {
        "metadata": {"namespace": NS, "name": "llama", "uid": "pool-uid", "annotations": annotations},
        "spec": {"selector": {"matchLabels": {"app": "llama"}}, "targetPorts": [{"number": 8000}]},
    }
    router = ready_pod(NS, "router-0", {"app": "router"}, ip="127.0.0.1")
    worker = ready_pod(NS, "llama-a", {"app": "llama"}, ip="127.0.0.1")
    return Indexes(
        pools={(NS, "llama"): [pool_info(body)]},
        pods={NS: [router, worker]},
        services={(NS, "smg-router"): [{"app": "router"}]},
    )


async def test_a_pool_without_a_model_gets_one_warning_event_naming_the_annotation_and_no_status(
    session: aiohttp.ClientSession,
) -> None:
    kube = EventsOnly()
    metrics = OperatorMetrics()
    settings = OperatorSettings(
        router_service="smg-router",
        router_namespace=NS,
        router_port=closed_port(),
        allowed_router_services=frozenset({(NS, "smg-router")}),
        inference_pools="annotated",
    )
    rt = Runtime(
        settings=settings,
        metrics=metrics,
        kube=kube,
        routers=RouterClient(session=session, token=None, metrics=metrics, timeout=2.0),
    )
    sync = PoolSync(rt=rt, mode="annotated")
    indexes = _indexes({"smg.dev/router": "smg-router"})
    await sync.sync_once(indexes)
    await sync.sync_once(indexes)  # the same problem again: no second Event
    assert len(kube.events) == 1, kube.events
    (event,) = kube.events
    assert (event["kind"], event["api_version"], event["name"], event["uid"]) == (
        "InferencePool",
        "inference.networking.k8s.io/v1",
        "llama",
        "pool-uid",
    )
    assert (event["type"], event["reason"]) == ("Warning", "ModelMissing")
    assert "smg.dev/model" in event["message"]
    await rt.close()


async def test_a_pool_that_does_not_name_the_router_is_left_alone(session: aiohttp.ClientSession) -> None:
    kube = EventsOnly()
    metrics = OperatorMetrics()
    rt = Runtime(
        settings=OperatorSettings(router_service="smg-router", router_port=closed_port()),
        metrics=metrics,
        kube=kube,
        routers=RouterClient(session=session, token=None, metrics=metrics, timeout=2.0),
    )
    sync = PoolSync(rt=rt, mode="annotated")
    await sync.sync_once(_indexes({"smg.dev/router": "another-router"}))
    assert kube.events == [] and sync.interests == {}
