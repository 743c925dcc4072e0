"""The lifecycle REST API, used by people and by the operator alike.

Mutations need ``Authorization: Bearer <admin key>`` when a key is configured.  Every mutation goes
through the one lifecycle path; a body that fails validation changes nothing and gets a 400 naming
the field.  SGLang-router compatible aliases: ``POST /add_worker?url=``, ``POST /remove_worker?url=``,
``GET /list_workers``.  With ``--admin-port`` the mutations are served on that port only and the reads on
both (``app.py`` dispatches by the port a request came in on).
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Any

from smg_router import wire
from smg_router.core import Handler, Request, RouterCore
from smg_router.errors import BadRequest, NotFound
from smg_router.http_io import check_bearer, parse_json_object, read_body
from smg_router.http_io import json_response as _json
from smg_router.workers.declarations import Declaration, check_model
from smg_router.workers.worker import SpecError, Worker, WorkerSpec, normalize_url

ADMIN_BODY_LIMIT = 64 * 1024
_NUMBER = re.compile(r"-?[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?")
"""A JSON number, as the document's ``timeout`` query parameter says."""
PATCHABLE = frozenset({"labels", "priority", "draining", "kv_capacity_tokens"})


def _core(request: Request) -> RouterCore:
    return request.core


def _authorize(request: Request) -> RouterCore:
    core = _core(request)
    check_bearer(request, core.settings.server.admin_api_key, what="the admin API key")
    return core


def _worker_json(core: RouterCore, worker: Worker) -> dict[str, Any]:
    return worker.to_json(core.loads.backend(worker.id))


def _find(core: RouterCore, worker_id: str) -> Worker:
    worker = core.registry.get(worker_id)
    if worker is None:
        raise NotFound(f"no worker with id {worker_id!r}", code="worker_not_found")
    return worker


async def _spec_body(request: Request) -> dict[str, Any]:
    return parse_json_object(await read_body(request, ADMIN_BODY_LIMIT))


def _spec(data: object, base: WorkerSpec | None = None) -> WorkerSpec:
    try:
        return WorkerSpec.from_json(data, base=base)
    except SpecError as e:
        raise BadRequest(str(e), code="invalid_field") from None


async def _register(core: RouterCore, spec: WorkerSpec) -> wire.Response:
    worker, created = await core.fleet.register(spec)
    return _json(_worker_json(core, worker), 201 if created else 200)


async def create_worker(request: Request) -> wire.Response:
    core = _authorize(request)
    return await _register(core, _spec(await _spec_body(request)))


async def list_workers(request: Request) -> wire.Response:
    """The fleet, and the models declared with or without workers (what the operator compares its declarations to)."""
    core = _core(request)
    return _json(
        {
            "workers": [_worker_json(core, w) for w in core.registry],
            "declared_models": core.proxy.declarations.all_json(),
        }
    )


async def get_worker(request: Request) -> wire.Response:
    core = _core(request)
    return _json(_worker_json(core, _find(core, request.params["worker_id"])))


async def patch_worker(request: Request) -> wire.Response:
    core = _authorize(request)
    worker = _find(core, request.params["worker_id"])
    data = await _spec_body(request)
    bad = sorted(set(data) - PATCHABLE)
    if bad:
        raise BadRequest(
            f"{bad[0]}: cannot be patched (patchable: {', '.join(sorted(PATCHABLE))}); use PUT to replace the worker",
            code="invalid_field",
        )
    draining = data.pop("draining", None)
    if draining is not None and not isinstance(draining, bool):
        raise BadRequest("draining: must be true or false", code="invalid_field")
    spec = _spec(data, base=worker.spec)  # validate everything before changing anything
    core.fleet.lifecycle.update(worker, spec)
    if draining is not None:
        core.fleet.lifecycle.set_draining(worker, draining)
    return _json(_worker_json(core, worker))


async def put_worker(request: Request) -> wire.Response:
    core = _authorize(request)
    worker = _find(core, request.params["worker_id"])
    data = await _spec_body(request)
    if isinstance(data, dict):
        data.setdefault("url", worker.url)
    spec = _spec(data)
    if spec.model_id is None and worker.model_id is not None:
        spec = replace(spec, model_id=worker.model_id)
    core.fleet.lifecycle.update(worker, spec)
    return _json(_worker_json(core, worker))


async def delete_worker(request: Request) -> wire.Response:
    core = _authorize(request)
    worker = _find(core, request.params["worker_id"])
    timeout = _drain_timeout(request, core)
    drained = await core.fleet.remove(worker, drain_timeout=timeout)
    return _json({"removed": _worker_json(core, worker), "drained": drained})


def _drain_timeout(request: Request, core: RouterCore) -> float:
    raw = request.query.get("timeout")
    if raw is None:
        return core.settings.server.drain_timeout
    if not _NUMBER.fullmatch(raw):  # float() also takes "nan", "inf", " 5 " and "1_0"
        raise BadRequest("timeout: must be a number of seconds", code="invalid_field")
    value = float(raw)
    if value < 0:
        raise BadRequest("timeout: must not be negative", code="invalid_field")
    if not math.isfinite(value):
        raise BadRequest("timeout: must be a finite number of seconds", code="invalid_field")
    return value


# -- models declared with or without workers (scale from zero) ------------------------------------------------
def _model(request: Request) -> str:
    try:
        return check_model(request.params["model"])
    except SpecError as e:
        raise BadRequest(str(e), code="invalid_field") from None


async def declare_model(request: Request) -> wire.Response:
    """``PUT /models/{model}``: the model is known with or without workers (a request for it waits for one with
    ``--hold-when-empty``, else gets a 503, never a 404), as this owner's declaration (body ``{"role", "owner"}``,
    both optional); 201 for a new owner, 200 for one declaring it again."""
    core = _authorize(request)
    model = _model(request)
    raw = await read_body(request, ADMIN_BODY_LIMIT)
    try:
        declaration = Declaration.from_json(parse_json_object(raw) if raw.strip() else None)
    except SpecError as e:
        raise BadRequest(str(e), code="invalid_field") from None
    created = core.proxy.declarations.declare(model, declaration)
    return _json(core.proxy.declarations.to_json(model), 201 if created else 200)


async def withdraw_model(request: Request) -> wire.Response:
    """``DELETE /models/{model}``: withdraw the declaration of ``?owner=`` (without it: every owner's); 404 when there
    is none.  The model stays known while another owner declares it or a worker serves it."""
    core = _authorize(request)
    model = _model(request)
    owner = request.query.get("owner")
    if not core.proxy.declarations.withdraw(model, owner):
        whose = f" by owner {owner!r}" if owner is not None else ""
        raise NotFound(f"model {model!r} is not declared{whose}", code="model_not_declared")
    return _json(core.proxy.declarations.to_json(model))


# -- SGLang router compatibility ----------------------------------------------------------------
def _query_url(request: Request) -> str:
    try:
        return normalize_url(request.query.get("url"))
    except SpecError as e:
        raise BadRequest(str(e), code="invalid_field") from None


async def add_worker_compat(request: Request) -> wire.Response:
    core = _authorize(request)
    return await _register(core, _spec({"url": _query_url(request)}))


async def remove_worker_compat(request: Request) -> wire.Response:
    core = _authorize(request)
    url = _query_url(request)
    worker = core.registry.by_url(url)
    if worker is None:
        raise NotFound(f"no worker with url {url}", code="worker_not_found")
    drained = await core.fleet.remove(worker, drain_timeout=_drain_timeout(request, core))
    return _json({"removed": _worker_json(core, worker), "drained": drained})


async def list_workers_compat(request: Request) -> wire.Response:
    return _json({"urls": [w.url for w in _core(request).registry]})


# -- peer routers (``coordination``) ---------------------------------------------------------------
async def peer_routes(request: Request) -> wire.Response:
    """``POST /peers/routes``: a peer router's batch (``coordination.receiver``: from a peer's address only, signed with
    ``--peer-secret`` when there is one; not the admin key), its routes inserted as if this router had routed them,
    then the first prefills its requests lead.  The answer names this router and the starts told that it leads
    itself (the peer's claim then yields)."""
    return await _core(request).receiver.accept(request)


MUTATIONS = frozenset(
    {
        create_worker,
        patch_worker,
        put_worker,
        delete_worker,
        add_worker_compat,
        remove_worker_compat,
        peer_routes,
        declare_model,
        withdraw_model,
    }
)
"""The handlers that change the fleet (and the peers' routes): with ``--admin-port`` they answer only there
(``app.py``)."""
READS = frozenset({list_workers, get_worker, list_workers_compat})
"""The lifecycle reads: served on both ports."""


ROUTES: list[tuple[str, str, Handler]] = [
    ("POST", "/workers", create_worker),
    ("GET", "/workers", list_workers),
    ("GET", "/workers/{worker_id}", get_worker),
    ("PATCH", "/workers/{worker_id}", patch_worker),
    ("PUT", "/workers/{worker_id}", put_worker),
    ("DELETE", "/workers/{worker_id}", delete_worker),
    ("POST", "/add_worker", add_worker_compat),
    ("POST", "/remove_worker", remove_worker_compat),
    ("GET", "/list_workers", list_workers_compat),
    ("POST", "/peers/routes", peer_routes),
    ("PUT", "/models/{model}", declare_model),
    ("DELETE", "/models/{model}", withdraw_model),
]
"""(method, path, handler) of the lifecycle API, for ``app.Dispatcher``."""
SLASHED_PARAMETERS = frozenset({"model"})
"""Path parameters that may hold slashes (``PUT /models/org/name``: model names do), percent-encoded or not."""
