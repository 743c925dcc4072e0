"""The InferencePool loop against two router replicas' lifecycle API in process: a pool's workers reach both, the
sweep takes those of a pool that went and leaves everyone else's, a router Service missing for a moment strips
nothing, and a replica the Service no longer selects loses its pool workers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from smg_operator.desired import OWNER_UID, PodInfo
from smg_operator.inference_pools import POOL_LABEL, PoolInfo, pool_info
from smg_operator.metrics import OperatorMetrics
from smg_operator.pool_sync import Indexes, PoolSync
from smg_operator.reconciler import Runtime
from smg_operator.routers import RouterClient
from smg_operator.settings import OperatorSettings
from support.operator_env import port_free_on
from support.operator_pods import ready_pod
from support.procs import next_host

NS = "ns"
SERVICE = (NS, "smg-router")


class Replica:
    """One router replica's worker registry behind its lifecycle API."""

    def __init__(self) -> None:
        self.workers: dict[str, dict[str, Any]] = {}
        self.next = 0

    async def list_workers(self, _: web.Request) -> web.Response:
        return web.json_response({"workers": list(self.workers.values())})

    async def register(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.next += 1
        worker = {"id": f"w{self.next}", "status": "ready", **body}
        self.workers[worker["id"]] = worker
        return web.json_response(worker, status=201)

    async def remove(self, request: web.Request) -> web.Response:
        found = self.workers.pop(request.match_info["id"], None)
        return web.json_response({"removed": found is not None}, status=200 if found else 404)

    def urls(self) -> set[str]:
        return {w["url"] for w in self.workers.values()}


class NoEvents:
    def now_iso(self) -> str:
        return "2026-01-01T00:00:00Z"

    async def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> bool:
        raise AssertionError("the pool source writes no status")

    async def post_event(self, **event: Any) -> None:
        pass


@pytest.fixture
async def replicas() -> AsyncIterator[tuple[int, dict[str, tuple[str, Replica]]]]:
    hosts = {"router-0": next_host(), "router-1": next_host()}
    port = port_free_on(list(hosts.values()))
    out: dict[str, tuple[str, Replica]] = {}
    runners = []
    for pod, host in hosts.items():
        replica = Replica()
        app = web.Application()
        app.router.add_get("/workers", replica.list_workers)
        app.router.add_post("/workers", replica.register)
        app.router.add_delete("/workers/{id}", replica.remove)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        runners.append(runner)
        out[pod] = (host, replica)
    yield port, out
    for runner in runners:
        await runner.cleanup()


def llama_pool() -> PoolInfo:
    return pool_info(
        {
            "metadata": {
                "namespace": NS,
                "name": "llama",
                "uid": "pool-uid",
                "annotations": {"smg.dev/router": "smg-router", "smg.dev/model": "m"},
            },
            "spec": {"selector": {"matchLabels": {"app": "llama"}}, "targetPorts": [{"number": 8000}]},
        }
    )


def setup(
    session: aiohttp.ClientSession, port: int, hosts: dict[str, str]
) -> tuple[PoolSync, dict[Any, list[PoolInfo]], dict[str, list[PodInfo]], dict[Any, list[dict[str, str]]]]:
    metrics = OperatorMetrics()
    rt = Runtime(
        settings=OperatorSettings(
            router_service="smg-router",
            router_namespace=NS,
            router_port=port,
            allowed_router_services=frozenset({SERVICE}),
            inference_pools="annotated",
        ),
        metrics=metrics,
        kube=NoEvents(),
        routers=RouterClient(session=session, token=None, metrics=metrics, timeout=2.0, list_max_age=0),
    )
    pools: dict[Any, list[PoolInfo]] = {(NS, "llama"): [llama_pool()]}
    pods = {
        NS: [
            *(ready_pod(NS, pod, {"app": "router"}, ip=host, uid=pod) for pod, host in hosts.items()),
            ready_pod(NS, "llama-a", {"app": "llama"}, ip="10.0.0.1"),
        ]
    }
    services: dict[Any, list[dict[str, str]]] = {SERVICE: [{"app": "router"}]}
    return PoolSync(rt=rt, mode="annotated"), pools, pods, services


async def settle(sync: PoolSync) -> None:
    """Run the removals the pass started in the background to their end."""
    for task in list(sync.rt.removals.values()):
        await task


POOL_WORKER = "http://10.0.0.1:8000"


async def test_a_pool_that_went_loses_its_workers_and_nobody_elses(
    replicas: tuple[int, dict[str, tuple[str, Replica]]], session: aiohttp.ClientSession
) -> None:
    port, reps = replicas
    sync, pools, pods, services = setup(session, port, {pod: host for pod, (host, _) in reps.items()})
    indexes = Indexes(pools=pools, pods=pods, services=services)
    await sync.sync_once(indexes)
    assert all(r.urls() == {POOL_WORKER} for _, r in reps.values())
    (worker,) = reps["router-0"][1].workers.values()
    assert worker["labels"][POOL_LABEL] == "ns.llama" and worker["labels"][OWNER_UID] == "pool-uid"
    others = {
        "by-hand": {"id": "by-hand", "url": "http://10.0.0.9:8000", "labels": {}},
        "smgw": {"id": "smgw", "url": "http://10.0.0.8:8000", "labels": {OWNER_UID: "smgworker-uid"}},
    }
    reps["router-0"][1].workers.update(others)

    pools.clear()  # the pool is deleted
    await sync.sync_once(indexes)
    await settle(sync)
    assert reps["router-0"][1].urls() == {"http://10.0.0.9:8000", "http://10.0.0.8:8000"}
    assert reps["router-1"][1].urls() == set()
    await sync.rt.close()


async def test_a_missing_service_strips_nothing_and_a_replica_left_out_of_it_loses_the_pool(
    replicas: tuple[int, dict[str, tuple[str, Replica]]], session: aiohttp.ClientSession
) -> None:
    port, reps = replicas
    sync, pools, pods, services = setup(session, port, {pod: host for pod, (host, _) in reps.items()})
    indexes = Indexes(pools=pools, pods=pods, services=services)
    await sync.sync_once(indexes)
    assert all(r.urls() == {POOL_WORKER} for _, r in reps.values())

    saved = services.pop(SERVICE)  # the router Service gone for a moment: the replicas keep serving the pool
    await sync.sync_once(indexes)
    await settle(sync)
    assert all(r.urls() == {POOL_WORKER} for _, r in reps.values())

    services[SERVICE] = saved
    host1 = reps["router-1"][0]
    pods[NS] = [p for p in pods[NS] if p.name != "router-1"]
    pods[NS].append(ready_pod(NS, "router-1", {"app": "elsewhere"}, ip=host1, uid="router-1"))  # relabelled away
    await sync.sync_once(indexes)
    await settle(sync)
    assert reps["router-0"][1].urls() == {POOL_WORKER}
    assert reps["router-1"][1].urls() == set()
    await sync.rt.close()
