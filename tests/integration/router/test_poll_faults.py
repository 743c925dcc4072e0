"""Workers that answer garbage or never answer cost the router nothing but their own polls.

A real router process polls three workers: a real ``smg-sim`` with a backlog, a server whose load reports
are hostile numbers (``1e309`` in ``/v1/loads``, ``+Inf`` in ``/metrics``) and a black hole that accepts
connections and never answers.  The healthy worker's backlog must stay fresh and follow every change, the
poll errors must be counted by worker and kind, and both background loops must outlive the bad rounds.
The probe client is also tested on its own against real sockets: a black hole holding many requests must
not delay a healthy worker's probe, and each kind of failure is named.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from smg_router.fleet.probes import ProbeClient, ProbeError
from support.procs import MODEL, Router, free_port, metric_value, next_host, start_router, start_sim, wait_until

GARBAGE_LOADS = b'{"timestamp": "now", "dp_rank_count": 1, "loads": [{"dp_rank": 0, "num_running_reqs": 1e309}]}'
GARBAGE_METRICS = b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running +Inf\n"


class BlackHole:
    """Accepts every connection and never answers (after answering the first ``GET /health``, if asked to)."""

    def __init__(self, *, answer_first_health: bool = False) -> None:
        self.host = next_host()
        self.port = free_port(self.host)
        self._answer_health = answer_first_health
        self._held: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None
        self.connections = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def __aenter__(self) -> BlackHole:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._held:
            writer.close()
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._held.append(writer)  # kept open, never written to: the connection hangs until the client gives up
        if self._answer_health:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"GET /health "):
                    self._answer_health = False
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
                    await writer.drain()
                    writer.close()


class HttpServer:
    """An aiohttp server on its own loopback address, serving fixed answers by path."""

    def __init__(self, answers: dict[str, tuple[int, bytes]]) -> None:
        self.host = next_host()
        self.port = free_port(self.host)
        self.answers = answers
        self.asked: dict[str, int] = {}
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def _handle(self, request: web.Request) -> web.Response:
        self.asked[request.path] = self.asked.get(request.path, 0) + 1
        status, body = self.answers.get(request.path, (404, b"not found"))
        return web.Response(status=status, body=body)

    async def __aenter__(self) -> HttpServer:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


# --- the probe client against real sockets ------------------------------------------------------------------


async def test_a_black_hole_holding_many_requests_does_not_delay_a_healthy_workers_probe() -> None:
    async with BlackHole() as hole, HttpServer({"/health": (200, b"{}")}) as healthy:
        client = ProbeClient()
        await client.start()
        stuck = [asyncio.create_task(client.get(hole.url + f"/v1/loads?n={i}", seconds=5)) for i in range(80)]
        try:
            await asyncio.sleep(0.3)  # let the black hole take what connections it is given
            loop = asyncio.get_running_loop()
            start = loop.time()
            assert await client.get(healthy.url + "/health", seconds=1.0) == (200, b"{}")
            assert loop.time() - start < 0.5
            assert hole.connections <= 2  # the black hole's own budget, not the pool's
        finally:
            for task in stuck:
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
            await client.close()


async def test_each_failed_probe_names_its_kind() -> None:
    big = b"x" * 5000
    async with BlackHole() as hole, HttpServer({"/big": (200, big), "/ok": (200, b"ok")}) as server:
        client = ProbeClient(max_body=4096)
        await client.start()
        try:
            kinds: dict[str, str] = {}
            for name, url in (
                ("hole", hole.url + "/health"),
                ("refused", f"http://{next_host()}:{free_port()}/x"),
                ("big", server.url + "/big"),
            ):
                try:
                    await client.fetch(url, seconds=0.3)
                except ProbeError as e:
                    kinds[name] = e.kind
            assert kinds == {"hole": "timeout", "refused": "connect", "big": "bad_payload"}
            assert await client.fetch(server.url + "/ok", seconds=1) == (200, b"ok")
            assert await client.get(hole.url + "/health", seconds=0.1) is None
        finally:
            await client.close()
    async with _raw_server(b"this is not HTTP\r\n\r\n") as url:
        client = ProbeClient()
        await client.start()
        try:
            try:
                await client.fetch(url + "/v1/loads", seconds=1)
            except ProbeError as e:
                assert e.kind == "bad_payload", e
            else:
                raise AssertionError("a non-HTTP answer was taken for one")
        finally:
            await client.close()


@contextlib.asynccontextmanager
async def _raw_server(answer: bytes) -> AsyncIterator[str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            await writer.drain()
        writer.close()

    host = next_host()
    server = await asyncio.start_server(handle, host, 0)
    try:
        yield f"http://{host}:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


# --- a real router, a real backlog, a garbage worker and a black hole --------------------------------------


def _worker(r: Router, url: str) -> dict[str, Any]:
    return next(w for w in r.workers() if w["url"] == url)


def _errors(r: Router, url: str, kind: str) -> float:
    return metric_value(r.metrics(), "smg_worker_poll_errors_total", worker=url, kind=kind)


async def test_garbage_and_hanging_workers_do_not_stop_or_delay_the_polls_of_a_healthy_one(logs: Path) -> None:
    sim = start_sim(logs, time_scale=1.0, extra=["--max-running", "1"])
    garbage = HttpServer(
        {"/health": (200, b"{}"), "/v1/loads": (200, GARBAGE_LOADS), "/metrics": (200, GARBAGE_METRICS)}
    )
    hogs: list[asyncio.Task[None]] = []
    r = start_router(logs, args=["--health-failure-threshold", "1", "--shutdown-delay", "0"])
    try:
        async with garbage, BlackHole(answer_first_health=True) as hung, aiohttp.ClientSession() as s:
            for url in (sim.url, garbage.url, hung.url):
                status, body = await asyncio.to_thread(r.admin, "POST", "/workers", {"url": url, "model_id": MODEL})
                assert status == 201 and body["status"] == "ready", body

            async def hog() -> None:  # straight to the sim: with --max-running 1 one runs, the rest wait
                with contextlib.suppress(aiohttp.ClientError, asyncio.CancelledError):
                    async with s.post(
                        sim.url + "/v1/completions", json={"model": MODEL, "prompt": "hog", "max_tokens": 5000}
                    ) as resp:
                        await resp.read()

            def backend() -> int | None:
                return _worker(r, sim.url)["load"]["backend"]

            def backend_is(expected: int) -> bool:
                return backend() == expected

            def add_hogs(n: int) -> None:
                hogs.extend(asyncio.get_running_loop().create_task(hog()) for _ in range(n))

            add_hogs(4)
            await asyncio.to_thread(wait_until, lambda: backend() == 4, what="the sim's backlog of 4")

            # Bad rounds: the garbage worker's reports are refused each poll, the black hole's polls time out
            # (2 s each).  All along, the healthy worker's figure stays fresh (None would mean stale).
            seen: list[int | None] = []

            def bad_rounds_done() -> bool:
                seen.append(backend())
                return _errors(r, garbage.url, "bad_payload") >= 10 and _errors(r, hung.url, "timeout") >= 2

            await asyncio.to_thread(
                wait_until,
                bad_rounds_done,
                timeout=30,
                interval=0.1,
                what="bad_payload polls of the garbage worker and timeouts of the black hole",
            )
            assert set(seen) == {4}, seen
            assert garbage.asked.get("/v1/loads", 0) >= 10 and garbage.asked.get("/metrics", 0) >= 10

            # After the bad rounds the monitor is alive and every interval fresh: a change shows within a few.
            for expected in (7, 9):
                add_hogs(expected - len(hogs))
                await asyncio.to_thread(
                    wait_until,
                    functools.partial(backend_is, expected),
                    timeout=1.5,
                    interval=0.05,
                    what=f"the sim's backlog of {expected} within a few intervals",
                )
            metrics = r.metrics()
            assert metric_value(metrics, "smg_worker_backend_load", worker=sim.url) == 9
            assert metric_value(metrics, "smg_worker_poll_errors_total", worker=sim.url) == 0

            # The health checker is alive too: the black hole fails its probes, the others stay ready.
            await asyncio.to_thread(
                wait_until,
                lambda: _worker(r, hung.url)["status"] == "not_ready",
                timeout=15,
                what="the black hole to fail its health check",
            )
            assert _worker(r, sim.url)["status"] == "ready" and _worker(r, garbage.url)["status"] == "ready"
            # ... and still probing after all that: the garbage worker goes away and is noticed.
            await garbage.close()
            await asyncio.to_thread(
                wait_until,
                lambda: _worker(r, garbage.url)["status"] == "not_ready",
                timeout=10,
                what="the stopped garbage worker to fail its health check",
            )
            await asyncio.to_thread(
                wait_until,
                lambda: _errors(r, garbage.url, "connect") >= 1,
                what="connect errors of the stopped garbage worker",
            )
            add_hogs(1)
            await asyncio.to_thread(
                wait_until,
                functools.partial(backend_is, 10),
                timeout=1.5,
                interval=0.05,
                what="the sim's backlog of 10",
            )
            assert _worker(r, sim.url)["status"] == "ready"

            # One log line per change of state, not one per poll.
            log = r.log()
            assert log.count(f"worker {garbage.url} load poll failing: bad_payload") == 1, log
            assert log.count(f"worker {garbage.url} load poll failing: connect") == 1, log
            assert log.count(f"worker {hung.url} load poll failing: timeout") == 1, log
            assert "Traceback" not in log, log
            assert r.alive()
            for task in hogs:
                task.cancel()
            await asyncio.gather(*hogs, return_exceptions=True)
    finally:
        for task in hogs:
            task.cancel()
        r.stop()
        sim.stop()
