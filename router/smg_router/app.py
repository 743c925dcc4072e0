"""The router's HTTP front: the server (``server``) and one dispatcher, no routing framework, no middleware.

Per request, top to bottom (``Dispatcher.__call__``): the route by a dict lookup on the path (the lifecycle
API's ``/workers/{worker_id}`` and ``/models/{model}`` by their prefixes; a model name may hold slashes), the
method (``HEAD`` answers as ``GET``; another one is a 405 naming those the path takes), the admin-port split,
``Expect: 100-continue``, the handler; every error leaves
as OpenAI-shaped JSON, whoever raised it, and an unknown path is a 404 naming it.  Nothing else runs per
request: aiohttp's ``Application`` resolved a route through its resources, froze a match-info object and
walked the middleware chain and the response signals for every request, none of which the router needs
(and its server built a message, a payload stream and a request object per request: ``server`` parses with
httptools into one ``core.Request``).

With ``--admin-port`` one server listens on two ports (``__main__`` opens both): the lifecycle mutations
answer only on the admin port, which serves nothing but the lifecycle API; the lifecycle reads on both, so a
NetworkPolicy can guard the admin port alone.  From SIGTERM on every answer says ``Connection: close``
(``Server.closing``).

A child of ``--processes`` (``pod``) hands its data port's lifecycle API and ``/metrics`` to its parent (``Parent``),
which answers them for the whole pod, and serves every route for itself alone on a private socket
(``build_private_server``); with one process nothing of this exists.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from urllib.parse import quote

import aiohttp

from smg_router import admin, handlers
from smg_router.coordination import auth, messages
from smg_router.core import Handler, Request, RouterCore
from smg_router.errors import NotFound, RouterError, error_response
from smg_router.http_io import read_body
from smg_router.server import Server
from smg_router.settings import Settings
from smg_router.wire import Response

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
    """The one request handler of the server (see the module docstring)."""

    def __init__(
        self,
        core: RouterCore,
        table: Iterable[Route],
        *,
        replace: Mapping[Handler, Handler] | None = None,
        admin_port: int | None = None,
    ) -> None:
        """``replace``: handlers served by others (a child of ``--processes`` hands the lifecycle API and ``/metrics``
        to its parent); ``admin_port``: the port of the admin split, when not the settings' (0: no split)."""
        swap = replace or {}
        self._exact: dict[str, dict[str, Handler]] = {}
        self._templated: dict[str, tuple[str, dict[str, Handler]]] = {}
        """prefix (``/workers/``) -> (parameter name, method -> handler): a path below it names one item."""
        for route in table:
            handler = swap.get(route.handler, route.handler)
            prefix, brace, rest = route.path.partition("{")
            if brace:
                name = rest.rstrip("}")
                self._templated.setdefault(prefix, (name, {}))[1][route.method] = handler
            else:
                self._exact.setdefault(route.path, {})[route.method] = handler
        self._core = core
        s = core.settings.server
        self._admin_port = s.admin_port if admin_port is None else admin_port
        self._data_port = s.port
        mutations = frozenset(swap.get(h, h) for h in admin.MUTATIONS)
        self._mutations, self._lifecycle = mutations, mutations | {swap.get(h, h) for h in admin.READS}

    def _resolve(self, path: str) -> tuple[dict[str, Handler] | None, dict[str, str]]:
        methods = self._exact.get(path)
        if methods is not None:
            return methods, {}
        for prefix, (name, templated) in self._templated.items():
            if (
                path.startswith(prefix)
                and (value := path[len(prefix) :])
                and ("/" not in value or name in admin.SLASHED_PARAMETERS)
            ):
                return templated, {name: value}
        return None, {}

    async def __call__(self, request: Request) -> Response:
        request.core = self._core
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
            if "Expect" in request.headers and request.version >= (1, 1):
                _continue(request)
            return await handler(request)
        except RouterError as e:
            if e.status >= 500:
                log.warning("%s %s -> %d %s", request.method, request.path, e.status, e.message)
            return e.response()
        except (asyncio.CancelledError, ConnectionError):
            raise  # the client went away: nothing to answer
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return error_response(500, "internal error in the router (logged)", type="server_error")

    def _split(self, request: Request, handler: Handler) -> None:
        """The admin port serves the lifecycle API only; the lifecycle mutations answer only there."""
        if request.local_port == self._admin_port:
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


def _continue(request: Request) -> None:
    """``Expect: 100-continue`` (curl sends it for bodies over 1 KiB): the go-ahead before the body is read."""
    expect = request.headers["Expect"]
    if expect.lower() != "100-continue":
        raise RouterError(f"Unknown Expect: {expect}", code="expectation_failed", status=417)
    request.send_continue()


FORWARDED = ("Authorization", "Content-Type", auth.TIME, auth.NONCE, auth.SIGNATURE)
"""The request headers a process of the pod hands on with a call (the peer's source is set, never passed on)."""
POD_SOCKET = "pod.sock"
"""The parent's private socket in ``--processes-dir`` (``pod``), which the children hand the pod's calls to."""


def child_socket(index: int) -> str:
    """The private socket of child ``index`` in ``--processes-dir``: its own lifecycle API, metrics and probes."""
    return f"child-{index}.sock"


class Parent:
    """A child's way to its parent (``--processes``): on the data port the lifecycle API and ``/metrics`` are the
    pod's, answered by the parent, which applies a change to every process and merges their metrics (``pod``)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._session: aiohttp.ClientSession | None = None

    async def forward(self, request: Request) -> Response:
        """The request as the parent answers it (its body read here first, up to the peers' batch limit)."""
        body = await read_body(request, messages.BODY_LIMIT) if request.method not in ("GET", "HEAD") else b""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self._path), timeout=aiohttp.ClientTimeout(total=None)
            )
        headers = {k: v for k in FORWARDED if (v := request.headers.get(k)) is not None}
        if request.remote is not None:  # a peer's batch is checked by where it came from (``coordination.receiver``)
            headers[auth.SOURCE] = request.remote
        target = "http://pod" + quote(request.path) + (f"?{request.query_string}" if request.query_string else "")
        try:
            async with self._session.request(request.method, target, data=body, headers=headers) as answer:
                raw = await answer.read()
                kept = {
                    k: v for k in ("Content-Type", "Allow", auth.SIGNATURE) if (v := answer.headers.get(k)) is not None
                }
                return Response(status=answer.status, body=raw, headers=kept)
        except aiohttp.ClientError as e:
            raise RouterError(
                f"the router's parent process did not answer ({e.__class__.__name__}: {e})",
                code="parent_unavailable",
                status=503,
            ) from None

    def handler(self) -> Handler:
        """A new handler that forwards (one per handler it replaces: the dispatcher tells them apart)."""

        async def forwarded(request: Request) -> Response:
            return await self.forward(request)

        return forwarded

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _server(core: RouterCore, dispatcher: Dispatcher) -> Server:
    s = core.settings.server
    return Server(
        dispatcher,
        make_request=Request,
        max_body=s.max_payload_size,
        body_timeout=s.body_timeout,
        closing=lambda: core.shutting_down,
        budget=core.budget,
        max_buffer=s.max_connection_buffer,
        head_timeout=s.head_timeout,
        body_min_rate=s.body_min_rate,
        max_connections=s.max_connections,
        max_connections_per_client=s.max_connections_per_client,
        rejected=core.admission.rejected,
    )


def build_server(core: RouterCore, parent: Parent | None = None) -> Server:
    """The server over the dispatcher; every request a ``core.Request`` (the dispatcher gives it the core).  A
    client that goes away cancels its handler, which aborts the upstream request.  ``parent``: a child of
    ``--processes``, whose lifecycle API and ``/metrics`` the parent answers for the whole pod."""
    if parent is None:
        return _server(core, Dispatcher(core, routes()))
    pod: dict[Handler, Handler] = {h: parent.handler() for h in (*admin.MUTATIONS, *admin.READS, handlers.metrics)}
    return _server(core, Dispatcher(core, routes(), replace=pod))


def build_private_server(core: RouterCore) -> Server:
    """A child's own endpoint (its private socket): every route answered by this process alone, no admin split (the
    parent applies each lifecycle change here, reads this process's ``/metrics``)."""
    return _server(core, Dispatcher(core, routes(), admin_port=0))


@asynccontextmanager
async def running(settings: Settings, *, shutdown_timeout: float = 60.0) -> AsyncIterator[tuple[RouterCore, Server]]:
    """The core started and its server made (the caller opens the ports: ``Server.listen``); both stopped on
    exit, the server first (``shutdown_timeout``: how long its connections get to finish), then the core.  A child of
    ``--processes`` (``settings.process.child``) hands the pod's calls to its parent's socket."""
    core = RouterCore(settings)
    p = settings.process
    parent = Parent(os.path.join(p.dir, POD_SOCKET)) if p.child and p.dir else None
    server = build_server(core, parent)
    await core.start()
    try:
        yield core, server
    finally:
        await server.shutdown(shutdown_timeout)
        if parent is not None:
            await parent.close()
        await core.stop()
