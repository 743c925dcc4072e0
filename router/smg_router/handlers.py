"""Thin data-plane handlers: read and parse the body, hand it to the proxy, answer.

Also the probes (``/health``, ``/liveness``, ``/readiness``), ``/v1/models`` and ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from smg_router.core import ROUTER, RouterCore
from smg_router.http_io import check_bearer, json_response
from smg_router.metrics import CONTENT_TYPE
from smg_router.openapi import DOCUMENT_PATH, openapi_json
from smg_router.request import parse_request

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _generation(kind: str) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        core = request.app[ROUTER]
        check_bearer(request, core.settings.server.api_key, what="the API key")
        raw = await core.admission.enter(request)  # 413 too large, 503 over the router's limits
        try:
            return await core.proxy.handle(request, parse_request(kind, raw, request.headers, core.forward_headers))
        finally:
            core.admission.leave(len(raw))

    handler.__name__ = f"{kind}_handler"
    return handler


chat_completions = _generation("chat")
completions = _generation("completions")
generate = _generation("generate")


async def models(request: web.Request) -> web.Response:
    core: RouterCore = request.app[ROUTER]
    check_bearer(request, core.settings.server.api_key, what="the API key")
    names = sorted({w.model_id for w in core.registry if w.model_id is not None and w.routable})
    return json_response(
        {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "smg"} for m in names]}
    )


async def liveness(request: web.Request) -> web.Response:
    return json_response({"status": "alive"})


async def readiness(request: web.Request) -> web.Response:
    core: RouterCore = request.app[ROUTER]
    ready, detail = core.readiness()
    return json_response({"status": "ready" if ready else "not_ready", **detail}, 200 if ready else 503)


async def health(request: web.Request) -> web.Response:
    return await readiness(request)


async def metrics(request: web.Request) -> web.Response:
    core: RouterCore = request.app[ROUTER]
    return web.Response(body=core.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/generate", generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/liveness", liveness)
    app.router.add_get("/readiness", readiness)
    app.router.add_get("/metrics", metrics)
    app.router.add_get(DOCUMENT_PATH, openapi_json)
