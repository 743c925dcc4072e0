"""A scripted worker inside the test's own event loop: /health, /v1/models and the routes a test adds.

For faults smg-sim has no knob for (a status on demand, recording what the router forwarded).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from support.procs import MODEL

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _health(_: web.Request) -> web.Response:
    return web.json_response({})


async def _models(_: web.Request) -> web.Response:
    return web.json_response({"data": [{"id": MODEL}]})


@contextlib.asynccontextmanager
async def serving(host: str, posts: dict[str, Handler]) -> AsyncIterator[str]:
    """Serve on ``host`` (a free port) with ``posts`` as POST routes; yields the worker's URL."""
    app = web.Application()
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    for path, handler in posts.items():
        app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()
