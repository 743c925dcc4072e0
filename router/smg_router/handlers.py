"""Thin data-plane handlers: read and parse the body, hand it to the proxy, answer.

One handler per row of ``request.ENDPOINT_TABLE`` (generation and pass-through endpoints alike), made by
``_forwarded``; a multipart row streams its body through (``upload``) instead of reading it.

Also the probes (``/health``, ``/liveness``, ``/readiness``), ``/v1/models`` and ``/metrics``.
"""

from __future__ import annotations

from typing import Any

from smg_router import wire
from smg_router.core import Handler, Request, RouterCore
from smg_router.errors import BadRequest, Overloaded, PayloadTooLarge, RequestTimeout
from smg_router.http_io import check_bearer, json_response
from smg_router.metrics import CONTENT_TYPE
from smg_router.openapi import DOCUMENT_PATH, openapi_json
from smg_router.request import ENDPOINT_TABLE, Endpoint, parse_endpoint, upload_request
from smg_router.upload import StreamedUpload, boundary_of


def _forwarded(endpoint: Endpoint) -> Handler:
    """The handler of one row of ``ENDPOINT_TABLE``: admission, parse, the proxy; the same for every row."""

    async def handler(request: Request) -> wire.Response:
        core = request.core
        check_bearer(request, core.settings.server.api_key, what="the API key", key_header=endpoint.key_header)
        if endpoint.multipart:
            return await _streamed(request, core, endpoint)
        raw = await core.admission.enter(request)  # 413 too large, 503 over the router's limits
        try:
            req = parse_endpoint(endpoint, raw, request.headers, core.forward_headers)
            return await core.proxy.handle(request, req)
        finally:
            core.admission.leave()

    handler.__name__ = f"{endpoint.path.strip('/').replace('/', '_')}_handler"
    return handler


async def _streamed(request: Request, core: RouterCore, endpoint: Endpoint) -> wire.Response:
    """A multipart upload: its head read for the model, the rest streamed to the worker (``upload``)."""
    boundary = boundary_of(request.headers.get("content-type", ""))
    core.admission.enter_streaming(request)
    try:
        upload = StreamedUpload(request.content, limit=core.settings.server.max_payload_size)
        await upload.read_head(boundary)
        req = upload_request(endpoint, upload, request.headers, core.forward_headers)
        if req.requested_model is None:
            try:
                core.proxy.resolve_model(None)
            except BadRequest as e:
                raise BadRequest(
                    f"{e.message}; put the model field before the file part (the router streams the upload and "
                    "routes by the fields before the file)",
                    code=e.code,
                ) from None
        return await core.proxy.handle(request, req)
    except (PayloadTooLarge, RequestTimeout, Overloaded) as e:  # the upload's body refused as it was read
        core.admission.refused(e)
        raise
    finally:
        core.admission.leave()


async def models(request: Request) -> wire.Response:
    """Every model a registered worker serves or someone declared (``PUT /models/{model}``), in OpenAI's list shape,
    with the fleet behind it under ``smg``: ``workers`` and ``routable`` counts, ``roles`` (role → number of
    workers) and a declared model's ``declared`` (owner and role of each declaration); then every alias of one of
    them (``--model-alias``), its ``smg`` naming the model it routes to (``alias_of``)."""
    core = request.core
    check_bearer(request, core.settings.server.api_key, what="the API key")
    fleet: dict[str, dict[str, Any]] = {}
    for w in core.registry:
        if w.model_id is None:
            continue
        entry = fleet.setdefault(w.model_id, {"roles": {}, "workers": 0, "routable": 0})
        entry["roles"][w.role] = entry["roles"].get(w.role, 0) + 1
        entry["workers"] += 1
        entry["routable"] += w.routable
    declarations = core.proxy.declarations
    for model in declarations.models():  # known with or without workers: a request for it waits or gets a 503
        entry = fleet.setdefault(model, {"roles": {}, "workers": 0, "routable": 0})
        entry["declared"] = [d.to_json() for d in declarations.of(model)]
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "smg", "smg": fleet[m]} for m in sorted(fleet)]
    data += [  # --model-alias: the public name, with the fleet of the model it routes to
        {"id": a, "object": "model", "created": 0, "owned_by": "smg", "smg": {**fleet[s], "alias_of": s}}
        for a, s in sorted(core.proxy.aliases.items())
        if s in fleet and a not in fleet
    ]
    return json_response({"object": "list", "data": data})


async def liveness(request: Request) -> wire.Response:
    return json_response({"status": "alive"})


async def readiness(request: Request) -> wire.Response:
    core = request.core
    ready, detail = core.readiness()
    return json_response({"status": "ready" if ready else "not_ready", **detail}, 200 if ready else 503)


async def health(request: Request) -> wire.Response:
    return await readiness(request)


async def metrics(request: Request) -> wire.Response:
    core = request.core
    return wire.Response(body=core.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})


ROUTES: list[tuple[str, str, Handler]] = [
    *(("POST", endpoint.path, _forwarded(endpoint)) for endpoint in ENDPOINT_TABLE.values()),
    ("GET", "/v1/models", models),
    ("GET", "/health", health),
    ("GET", "/liveness", liveness),
    ("GET", "/readiness", readiness),
    ("GET", "/metrics", metrics),
    ("GET", DOCUMENT_PATH, openapi_json),
]
"""(method, path, handler) of the data plane and the probes, for ``app.Dispatcher``."""
