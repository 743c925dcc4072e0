"""The router's HTTP server: aiohttp's low-level server and one dispatcher, no ``Application``, no middleware.

Per request, top to bottom (``Dispatcher.__call__``): the route by a dict lookup on the path (the lifecycle
API's ``/workers/{worker_id}`` by its prefix), the method (``HEAD`` answers as ``GET``; another one is a 405
naming those the path takes), the admin-port split, ``Expect: 100-continue``, the handler; every error leaves
as OpenAI-shaped JSON, whoever raised it, and an unknown path is a 404 naming it.  Nothing else runs per
request: aiohttp's ``Application`` resolved a route through its resources, froze a match-info object and
walked the middleware chain and the response signals for every request, none of which the router needs.

With ``--admin-port`` one server listens on two ports (``__main__`` opens both): the lifecycle mutations
answer only on the admin port, which serves nothing but the lifecycle API; the lifecycle reads on both, so a
NetworkPolicy can guard the admin port alone.  From SIGTERM on every answer says ``Connection: close``
(``core.Request``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http import HttpVersion11

from smg_router import admin, handlers
from smg_router.core import Handler, Request, RouterCore
from smg_router.errors import NotFound, RouterError, error_response
from smg_router.settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str
    """As the OpenAPI document writes it: ``/workers/{worker_id}`` for the one templated path."""
    handler: Handler


def routes() -> list[Route]:
    """Every route the router serves: the data plane and probes (``handlers``), the lifecycle API (``admin``)."""
    return [Route(m, p, h) for m, p, h in (*handlers.ROUTES, *admin.ROUTES)]


class Dispatcher:
    """The one request handler of the low-level server (see the module docstring)."""

    def __init__(self, core: RouterCore, table: Iterable[Route]) -> None:
        self._exact: dict[str, dict[str, Handler]] = {}
        self._templated: dict[str, tuple[str, dict[str, Handler]]] = {}
        """prefix (``/workers/``) -> (parameter name, method -> handler): a path below it names one item."""
        for route in table:
            prefix, brace, rest = route.path.partition("{")
            if brace:
                name = rest.rstrip("}")
                self._templated.setdefault(prefix, (name, {}))[1][route.method] = route.handler
            else:
                self._exact.setdefault(route.path, {})[route.method] = route.handler
        s = core.settings.server
        self._admin_port, self._data_port = s.admin_port, s.port
        self._mutations, self._lifecycle = admin.MUTATIONS, admin.MUTATIONS | admin.READS

    def _resolve(self, path: str) -> tuple[dict[str, Handler] | None, dict[str, str]]:
        methods = self._exact.get(path)
        if methods is not None:
            return methods, {}
        for prefix, (name, templated) in self._templated.items():
            if path.startswith(prefix) and (value := path[len(prefix) :]) and "/" not in value:
                return templated, {name: value}
        return None, {}

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        assert isinstance(request, Request)  # the server's request factory makes every one
        try:
            methods, request.params = self._resolve(request.path)
            if methods is None:
                raise NotFound(f"Unknown endpoint: {request.method} {request.path}", code="unknown_endpoint")
            handler = methods.get(request.method) or (methods.get("GET") if request.method == "HEAD" else None)
            if handler is None:
                allowed = ",".join(sorted({*methods, *(("HEAD",) if "GET" in methods else ())}))
                response = error_response(
                    405,
                    f"{request.method} is not allowed on {request.path} (allowed: {allowed})",
                    type="invalid_request_error",
                )
                response.headers["Allow"] = allowed
                return response
            if self._admin_port:
                self._split(request, handler)
            if request.version >= HttpVersion11 and "Expect" in request.headers:
                await _continue(request)
            return await handler(request)
        except RouterError as e:
            if e.status >= 500:
                log.warning("%s %s -> %d %s", request.method, request.path, e.status, e.message)
            return e.response()
        except web.HTTPException as e:  # aiohttp's own, e.g. a body past client_max_size
            if e.status < 400:
                raise
            kind = "not_found_error" if e.status == 404 else "invalid_request_error"
            return error_response(e.status, e.reason if e.text is None else e.text, type=kind)
        except (asyncio.CancelledError, ConnectionError):
            raise  # the client went away: nothing to answer
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return error_response(500, "internal error in the router (logged)", type="server_error")

    def _split(self, request: Request, handler: Handler) -> None:
        """The admin port serves the lifecycle API only; the lifecycle mutations answer only there."""
        if _local_port(request) == self._admin_port:
            if handler not in self._lifecycle:
                raise NotFound(
                    f"port {self._admin_port} serves only the worker lifecycle API; {request.path} is on port "
                    f"{self._data_port}",
                    code="not_on_admin_port",
                )
        elif handler in self._mutations:
            raise NotFound(
                f"{request.method} {request.path}: worker lifecycle changes are served on the admin port "
                f"{self._admin_port} only (--admin-port)",
                code="admin_port_only",
            )


async def _continue(request: Request) -> None:
    """``Expect: 100-continue`` (curl sends it for bodies over 1 KiB): the go-ahead before the body is read."""
    if request.headers["Expect"].lower() != "100-continue":
        raise web.HTTPExpectationFailed(text=f"Unknown Expect: {request.headers['Expect']}")
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")


def _local_port(request: web.BaseRequest) -> int | None:
    """The port this connection was accepted on (the socket's, not the client's Host header)."""
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    return sockname[1] if isinstance(sockname, tuple) else None


def build_server(core: RouterCore, **kwargs: Any) -> web.Server:
    """aiohttp's low-level server over the dispatcher; every request a ``core.Request`` that knows the core.

    ``handler_cancellation``: a client that goes away cancels its handler, which aborts the upstream request."""
    loop = asyncio.get_running_loop()
    max_size = core.settings.server.max_payload_size

    def make_request(message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> Request:
        return Request(message, payload, protocol, writer, task, loop, client_max_size=max_size, core=core)

    return web.Server(
        Dispatcher(core, routes()), request_factory=make_request, handler_cancellation=True, access_log=None, **kwargs
    )


@asynccontextmanager
async def running(
    settings: Settings, *, shutdown_timeout: float = 60.0, **server_kwargs: Any
) -> AsyncIterator[tuple[RouterCore, web.ServerRunner]]:
    """The core started and a runner of its server set up (the caller opens the sites); both stopped on exit,
    the server first (``shutdown_timeout``: how long its connections get to finish), then the core."""
    core = RouterCore(settings)
    runner = web.ServerRunner(
        build_server(core, **server_kwargs), handle_signals=False, shutdown_timeout=shutdown_timeout
    )
    await core.start()
    try:
        await runner.setup()
        yield core, runner
    finally:
        await runner.cleanup()
        await core.stop()
