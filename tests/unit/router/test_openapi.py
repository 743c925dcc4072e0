"""GET /openapi.json stays true to the code: the routes, the fields the validators read, the bearer checks."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import schemathesis
from smg_router import admin
from smg_router.app import routes, running
from smg_router.openapi import DOCUMENT_PATH, document
from smg_router.settings import parse_settings
from smg_router.workers.breaker import CircuitBreaker
from smg_router.workers.worker import ROLES, SpecError, Worker, WorkerSpec, WorkerStatus
from support.procs import free_port

METHODS = ("get", "put", "post", "delete", "patch", "head", "options", "trace")
ADMIN_KEY, API_KEY = "admin-secret", "api-secret"
VALID_VALUES = {
    "url": "http://127.0.0.2:8000",
    "role": "prefill",
    "model_id": "m",
    "bootstrap_port": 8998,
    "labels": {"a": "b"},
    "priority": 3,
    "owner": "smg-operator",
    "kv_capacity_tokens": 4096,
    "kv_events": {"endpoint": "tcp://127.0.0.2:5557", "replay_endpoint": "tcp://127.0.0.2:5558", "topic": ""},
    "draining": True,
}


@contextlib.asynccontextmanager
async def _served() -> AsyncIterator[aiohttp.ClientSession]:
    """The router's own server on a free loopback port, and a client session pointed at it."""
    port = free_port()
    settings = parse_settings(["--admin-api-key", ADMIN_KEY, "--api-key", API_KEY, "--port", str(port)])
    async with running(settings) as (_, server):
        await server.listen("127.0.0.1", port)
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as session:
            yield session


def _documented() -> set[tuple[str, str]]:
    return {
        (method.upper(), path) for path, item in document()["paths"].items() for method in item if method in METHODS
    }


def _schema(name: str) -> dict[str, Any]:
    return document()["components"]["schemas"][name]


def test_every_registered_route_is_documented_and_every_documented_one_is_registered() -> None:
    registered = {(route.method, route.path) for route in routes()}
    assert len(registered) == len(routes())  # no route registered twice
    assert registered == _documented()
    # the dispatcher answers HEAD beside every GET on its own; nothing registers a HEAD of its own
    assert not {method for method, _ in registered} & {"HEAD"}


def test_the_document_is_valid_openapi_3_1_and_loads_in_schemathesis() -> None:
    doc = document()
    assert doc["openapi"].startswith("3.1")
    schema = schemathesis.openapi.from_dict(doc)
    schema.validate()  # against the OpenAPI 3.1 meta-schema
    operations = [op.ok() for op in schema.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in operations} == _documented()


def test_worker_spec_fields_are_the_ones_from_json_reads() -> None:
    props = set(_schema("WorkerSpec")["properties"])
    for name in props:  # every documented field is accepted with a valid value...
        WorkerSpec.from_json({"url": VALID_VALUES["url"], name: VALID_VALUES[name]})
    try:  # ...and one more is refused, naming it (the schema says additionalProperties: false)
        WorkerSpec.from_json({"url": VALID_VALUES["url"], "undocumented": 1})
    except SpecError as e:
        assert e.field == "undocumented"
    else:
        raise AssertionError("an unknown field was accepted")
    assert _schema("WorkerSpec")["additionalProperties"] is False
    assert set(_schema("WorkerReplacement")["properties"]) == props
    assert set(_schema("WorkerPatch")["properties"]) == set(admin.PATCHABLE)
    role = _schema("WorkerSpec")["properties"]["role"]["anyOf"][0]
    assert tuple(role["enum"]) == ROLES


def test_the_worker_schema_is_what_to_json_returns() -> None:
    worker = Worker(WorkerSpec(url="http://127.0.0.2:8000"), CircuitBreaker(failure_threshold=3, cooldown=1.0))
    assert set(_schema("Worker")["required"]) == set(worker.to_json()) == set(_schema("Worker")["properties"])
    assert _schema("Worker")["properties"]["status"]["enum"] == [s.value for s in WorkerStatus]


def _request_without_key(client: aiohttp.ClientSession, method: str, path: str) -> Any:
    return client.request(method, path.replace("{worker_id}", "w-000000000000"), data=b"{}")


async def test_documented_security_is_the_bearer_check_the_handlers_make() -> None:
    """Without a token, an operation with a security requirement answers 401 and one without does not."""
    async with _served() as client:
        for method, path in sorted(_documented()):
            operation = document()["paths"][path][method.lower()]
            async with _request_without_key(client, method, path) as response:
                body = await response.read()
                needs = operation["security"]
                if needs == [{"peerSignature": []}]:  # the replica channel: a router without peers takes no batch
                    assert response.status == 404, (method, path, response.status, body)
                    continue
                assert (response.status == 401) == bool(needs), (method, path, response.status, body)
                if needs:
                    key = API_KEY if needs == [{"apiKey": []}] else ADMIN_KEY
                    wrong = ADMIN_KEY if key == API_KEY else API_KEY
                    headers = {"Authorization": f"Bearer {wrong}"}
                    async with client.request(
                        method, path.replace("{worker_id}", "w-0"), data=b"{}", headers=headers
                    ) as other:
                        assert other.status == 401, (method, path, "the other key was accepted")


async def test_the_router_serves_the_document() -> None:
    async with _served() as client, client.get(DOCUMENT_PATH) as response:
        assert response.status == 200 and response.content_type == "application/json"
        assert await response.json() == document()
