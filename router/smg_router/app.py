"""Build the router's aiohttp application: routes, the error middleware, the core under an AppKey.

With ``--admin-port`` one application listens on two ports (``__main__`` opens both) and a middleware splits
them by the port each connection came in on: the lifecycle mutations only on the admin port, which serves
nothing but the lifecycle API; the lifecycle reads on both.  A NetworkPolicy can then guard the admin port alone.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from smg_router import admin, handlers
from smg_router.core import ROUTER, RouterCore
from smg_router.errors import NotFound, RouterError, error_response
from smg_router.settings import ServerSettings, Settings

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
        if e.status == 404 and request.match_info.http_exception is e:  # no route: name the path asked for
            return error_response(
                404,
                f"Unknown endpoint: {request.method} {request.path}",
                type="not_found_error",
                code="unknown_endpoint",
            )
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        response = error_response(e.status, e.reason if e.text is None else e.text, type=kind)
        if "Allow" in e.headers:  # a 405 says which methods the path takes
            response.headers["Allow"] = e.headers["Allow"]
        return response


def _local_port(request: web.Request) -> int | None:
    """The port this connection was accepted on (the socket's, not the client's Host header)."""
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    return sockname[1] if isinstance(sockname, tuple) else None


def admin_port_split(server: ServerSettings) -> Middleware:
    admin_port, data_port = server.admin_port, server.port
    lifecycle = admin.MUTATIONS | admin.READS

    @web.middleware
    async def split(request: web.Request, handler: Handler) -> web.StreamResponse:
        route = request.match_info.handler
        if _local_port(request) == admin_port:
            if request.match_info.http_exception is None and route not in lifecycle:
                raise NotFound(
                    f"port {admin_port} serves only the worker lifecycle API; {request.path} is on port {data_port}",
                    code="not_on_admin_port",
                )
        elif route in admin.MUTATIONS:
            raise NotFound(
                f"{request.method} {request.path}: worker lifecycle changes are served on the admin port "
                f"{admin_port} only (--admin-port)",
                code="admin_port_only",
            )
        return await handler(request)

    return split


async def _close_connections_when_shutting_down(request: web.Request, response: web.StreamResponse) -> None:
    """From SIGTERM on, every answer says ``Connection: close`` and closes its connection.  A client's pooled
    keep-alive connection to this pod is retired by its next answer, instead of being closed under a request the
    client sends on it at the instant the router stops (seen in a rolling restart: 'Server disconnected')."""
    if request.app[ROUTER].shutting_down:
        response.force_close()  # the server closes the connection after this answer
        response.headers["Connection"] = "close"  # and says so (aiohttp has decided its headers by this hook)


def build_app(settings: Settings) -> web.Application:
    middlewares: list[Middleware] = [errors_as_json]
    if settings.server.admin_port:
        middlewares.append(admin_port_split(settings.server))
    app = web.Application(middlewares=middlewares, client_max_size=settings.server.max_payload_size)
    core = RouterCore(settings)
    app[ROUTER] = core

    async def lifespan(_: web.Application) -> AsyncIterator[None]:
        await core.start()
        yield
        await core.stop()

    app.cleanup_ctx.append(lifespan)
    app.on_response_prepare.append(_close_connections_when_shutting_down)
    handlers.add_routes(app)
    admin.add_routes(app)
    return app
