"""The leadership gate: a closed gate refuses every write before anything is sent, and cancels the calls in
flight when it closes; the router client (reads included: they carry the token) and the Kubernetes writes
go through it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from smg_operator import k8s
from smg_operator.leadership import Gate, GateClosed
from smg_operator.metrics import OperatorMetrics
from smg_operator.routers import NotLeading, RouterClient


# -- the gate ------------------------------------------------------------------------------------------
async def test_a_closed_gate_refuses_without_starting_the_call() -> None:
    started = []

    async def call() -> int:
        started.append(1)
        return 1

    gate = Gate()
    assert await gate.run(call()) == 1
    gate.close("lost the lease")
    with pytest.raises(GateClosed, match="lost the lease"):
        await gate.run(call())
    assert started == [1]


async def test_closing_the_gate_cancels_the_calls_in_flight() -> None:
    gate = Gate()
    entered, cancelled = asyncio.Event(), asyncio.Event()

    async def slow() -> None:
        entered.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    task = asyncio.create_task(gate.run(slow()))
    await entered.wait()
    gate.close("renew deadline passed")
    with pytest.raises(GateClosed):
        await task
    assert cancelled.is_set()


async def test_cancelling_the_caller_stays_a_cancellation_not_a_refusal() -> None:
    gate = Gate()
    entered = asyncio.Event()

    async def slow() -> None:
        entered.set()
        await asyncio.sleep(3600)

    task = asyncio.create_task(gate.run(slow()))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gate.is_open


async def test_a_gate_made_closed_opens_when_leadership_is_won() -> None:
    gate = Gate(open=False)
    with pytest.raises(GateClosed):
        gate.check()
    gate.open()
    gate.check()


# -- the router client ---------------------------------------------------------------------------------
class Router:
    """A loopback router that records what reaches it; ``/hang`` answers only at teardown."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None]] = []
        self.entered, self.release = asyncio.Event(), asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append((request.method, request.headers.get("Authorization")))
        if request.path.startswith("/hang"):
            self.entered.set()
            await self.release.wait()  # until teardown
        return web.json_response({"workers": []})


@pytest.fixture
async def router() -> AsyncIterator[tuple[Router, str]]:
    r = Router()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", r.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # bound above
    yield r, f"http://127.0.0.1:{port}"
    r.release.set()
    await runner.cleanup()


def hook_calls(metrics: OperatorMetrics) -> float:
    return sum(s.value for m in metrics.registry.collect() for s in m.samples if s.name.startswith("smg_operator_hook"))


async def test_a_closed_gate_sends_no_router_call_not_even_a_list_and_counts_none(router: tuple[Router, str]) -> None:
    r, url = router
    gate, metrics = Gate(), OperatorMetrics()
    async with aiohttp.ClientSession() as session:
        client = RouterClient(session=session, token="secret", metrics=metrics, gate=gate)
        assert await client.list_workers(url) == []
        assert r.seen == [("GET", "Bearer secret")]
        gate.close("lost the lease")
        calls: list[Any] = [
            client.list_workers(url),
            client.register(url, {"url": "http://127.0.0.9:8000"}),
            client.replace(url, "w1", {"url": "http://127.0.0.9:8000"}),
            client.remove(url, "w1", drain_timeout=30),
        ]
        for call in calls:
            with pytest.raises(NotLeading) as refused:
                await call
            assert not refused.value.reachable  # the reconciler's RouterCallError path
    assert r.seen == [("GET", "Bearer secret")]
    assert hook_calls(metrics) == 1


async def test_a_router_call_in_flight_is_cancelled_when_the_gate_closes(router: tuple[Router, str]) -> None:
    r, url = router
    gate = Gate()
    async with aiohttp.ClientSession() as session:
        client = RouterClient(session=session, token=None, metrics=OperatorMetrics(), gate=gate, timeout=3600)
        drain = asyncio.create_task(client.remove(url + "/hang", "w", drain_timeout=3600))
        await r.entered.wait()
        gate.close("renew deadline passed")
        async with asyncio.timeout(5):  # not the hour of the drain timeout
            with pytest.raises(NotLeading):
                await drain


# -- the Kubernetes writes -----------------------------------------------------------------------------
async def test_a_closed_gate_makes_no_status_patch_or_event(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []

    class Api:
        def __init__(self, *_: Any) -> None:
            pass

        def patch_namespaced_custom_object_status(self, *args: Any, **kw: Any) -> None:
            made.append(f"patch timeout={kw.get('_request_timeout')}")

        def create_namespaced_event(self, *args: Any, **kw: Any) -> None:
            made.append(f"event timeout={kw.get('_request_timeout')}")

    monkeypatch.setattr(k8s.client, "CustomObjectsApi", Api)
    monkeypatch.setattr(k8s.client, "CoreV1Api", Api)
    gate = Gate()
    kube = k8s.KubeWrites(gate=gate, timeout=2.5)
    event = {"namespace": "ns", "name": "pool", "uid": "u", "type": "Normal", "reason": "Registered", "message": "m"}
    assert await kube.patch_status("ns", "pool", {"ready": "1/1"})
    await kube.post_event(**event)
    assert made == ["patch timeout=2.5", "event timeout=2.5"]  # every call carries the request timeout
    gate.close("lost the lease")
    with pytest.raises(GateClosed):
        await kube.patch_status("ns", "pool", {"ready": "1/1"})
    with pytest.raises(GateClosed):  # events are best effort, but a refusal is not swallowed as an API error
        await kube.post_event(**event)
    assert len(made) == 2
