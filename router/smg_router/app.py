"""Build the router's aiohttp application: routes, the error middleware, the core under an AppKey."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from smg_router import admin, handlers
from smg_router.core import ROUTER, RouterCore
from smg_router.errors import RouterError, error_response
from smg_router.settings import Settings

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as OpenAI-shaped JSON, whoever raised it."""
    try:
        return await handler(request)
    except RouterError as e:
        if e.status >= 500:
            log.warning("%s %s -> %d %s", request.method, request.path, e.status, e.message)
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        response = error_response(e.status, e.reason if e.text is None else e.text, type=kind)
        if "Allow" in e.headers:  # a 405 says which methods the path takes
            response.headers["Allow"] = e.headers["Allow"]
        return response


def build_app(settings: Settings) -> web.Application:
    app = web.Application(middlewares=[errors_as_json], client_max_size=settings.server.max_payload_size)
    core = RouterCore(settings)
    app[ROUTER] = core

    async def lifespan(_: web.Application) -> AsyncIterator[None]:
        await core.start()
        yield
        await core.stop()

    app.cleanup_ctx.append(lifespan)
    handlers.add_routes(app)
    admin.add_routes(app)
    return app
