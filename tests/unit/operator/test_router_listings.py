"""The passes of many SMGWorkers share one ``GET /workers`` per replica: joined while in flight, reused while
young, never after this client changed the replica, never when it failed (reconciles that scale)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from smg_operator.metrics import OperatorMetrics
from smg_operator.routers import RouterCallError, RouterClient


class Replica:
    """A router replica's lifecycle API, in process: counts its lists; ``fail`` answers the next list 500."""

    def __init__(self) -> None:
        self.lists = 0
        self.fail = False
        self.release = asyncio.Event()
        self.release.set()
        self.workers: list[dict[str, Any]] = []

    async def list_workers(self, _: web.Request) -> web.Response:
        self.lists += 1
        await self.release.wait()
        if self.fail:
            self.fail = False
            return web.json_response({"error": {"message": "boom"}}, status=500)
        return web.json_response({"workers": self.workers})

    async def register(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.workers.append({"id": f"w{len(self.workers)}", **body})
        return web.json_response(self.workers[-1], status=201)


@pytest.fixture
async def replica() -> AsyncIterator[tuple[Replica, str]]:
    r = Replica()
    app = web.Application()
    app.router.add_get("/workers", r.list_workers)
    app.router.add_post("/workers", r.register)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield r, f"http://127.0.0.1:{port}"
    await runner.cleanup()


def client(session: aiohttp.ClientSession, max_age: float) -> RouterClient:
    return RouterClient(session=session, token=None, metrics=OperatorMetrics(), list_max_age=max_age)


async def test_concurrent_passes_join_the_list_in_flight(
    replica: tuple[Replica, str], session: aiohttp.ClientSession
) -> None:
    r, url = replica
    routers = client(session, max_age=0)
    r.release.clear()
    pending = [asyncio.ensure_future(routers.list_workers(url)) for _ in range(5)]
    await asyncio.sleep(0.05)
    r.release.set()
    assert await asyncio.gather(*pending) == [[]] * 5
    assert r.lists == 1


async def test_a_young_list_is_reused_and_an_old_one_is_not(
    replica: tuple[Replica, str], session: aiohttp.ClientSession
) -> None:
    r, url = replica
    await client(session, max_age=60).list_workers(url)
    shared = client(session, max_age=60)
    for _ in range(3):
        await shared.list_workers(url)
    assert r.lists == 2  # one for the first client, one shared by the second client's three passes
    fresh = client(session, max_age=0)
    for _ in range(3):
        await fresh.list_workers(url)
    assert r.lists == 5


async def test_a_change_made_by_this_client_is_never_hidden_by_a_list_taken_before_it(
    replica: tuple[Replica, str], session: aiohttp.ClientSession
) -> None:
    r, url = replica
    routers = client(session, max_age=60)
    assert await routers.list_workers(url) == []
    assert await routers.register(url, {"url": "http://10.0.0.5:8000"}) == "w0"
    assert [w["url"] for w in await routers.list_workers(url)] == ["http://10.0.0.5:8000"]
    assert r.lists == 2


async def test_a_failed_list_is_not_shared(replica: tuple[Replica, str], session: aiohttp.ClientSession) -> None:
    r, url = replica
    routers = client(session, max_age=60)
    r.fail = True
    with pytest.raises(RouterCallError, match="500"):
        await routers.list_workers(url)
    assert await routers.list_workers(url) == []
    assert r.lists == 2


async def test_one_waiter_cancelled_does_not_cancel_the_others(
    replica: tuple[Replica, str], session: aiohttp.ClientSession
) -> None:
    r, url = replica
    routers = client(session, max_age=0)
    r.release.clear()
    first, second = (asyncio.ensure_future(routers.list_workers(url)) for _ in range(2))
    await asyncio.sleep(0.05)
    first.cancel()
    r.release.set()
    assert await second == []
    assert first.cancelled() and r.lists == 1
