"""A worker's redirect is its answer, never followed: the router sends a request, or probes a worker, only where it
was told to (a worker that answers 307 to another host must not make the router post a client's upload there)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web
from smg_router.fleet.probes import ProbeClient
from smg_router.upstream.base import Timeouts
from smg_router.upstream.session import SessionUpstream
from support.procs import free_port

HOST = "127.0.0.6"


class Redirecting:
    """A worker that sends every request on to ``/elsewhere`` (307 keeps the method and the body), and counts what
    reaches there."""

    def __init__(self) -> None:
        self.elsewhere = 0

    async def redirect(self, request: web.Request) -> web.Response:
        await request.read()
        raise web.HTTPTemporaryRedirect(location="/elsewhere")

    async def arrived(self, request: web.Request) -> web.Response:
        self.elsewhere += 1
        return web.Response(body=b"followed")


async def _serve(worker: Redirecting) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/audio/transcriptions", worker.redirect)
    app.router.add_get("/health", worker.redirect)
    app.router.add_route("*", "/elsewhere", worker.arrived)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port(HOST)
    await web.TCPSite(runner, HOST, port).start()
    try:
        yield f"http://{HOST}:{port}"
    finally:
        await runner.cleanup()


async def test_an_upload_answered_with_a_redirect_is_relayed_not_sent_on() -> None:
    worker = Redirecting()
    async for url in _serve(worker):
        upstream = SessionUpstream(Timeouts(connect=2, total=5, first_byte=5))
        await upstream.start()
        try:

            async def upload() -> AsyncIterator[bytes]:
                yield b"--b\r\ncontent-disposition: form-data; name=file\r\n\r\naudio\r\n--b--\r\n"

            resp = await upstream.post(
                url + "/v1/audio/transcriptions", upload(), {"Content-Type": "multipart/form-data; boundary=b"}
            )
            assert resp.status == 307
            assert resp.headers["location"] == "/elsewhere"
            resp.release()
            resp = await upstream.post(url + "/v1/audio/transcriptions", b"whole body", {})
            assert resp.status == 307
            resp.release()
        finally:
            await upstream.close()
        assert worker.elsewhere == 0


async def test_a_probe_answered_with_a_redirect_sees_the_redirect() -> None:
    worker = Redirecting()
    async for url in _serve(worker):
        probes = ProbeClient()
        await probes.start()
        try:
            status, _ = await probes.fetch(url + "/health", seconds=2)
        finally:
            await probes.close()
        assert status == 307  # not healthy: the worker did not say so itself
        assert worker.elsewhere == 0
