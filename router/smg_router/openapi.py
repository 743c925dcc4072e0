"""``GET /openapi.json``: the OpenAPI 3.1 document of the data plane and the lifecycle API.

Written by hand, next to what it describes: ``request.py`` (what a generation body must carry),
``workers/worker.py`` (``WorkerSpec.from_json``), ``admin.py`` (PATCH fields, queries) and ``errors.py``
(the error body).  A schema here says what the router, or the worker it forwards to, refuses with a 4xx;
what only the worker checks is passed through unchanged and says so.  ``tests/unit/router/test_openapi.py``
checks that every route the app registers is in the document and the other way round;
``tests/integration/router/test_openapi_fuzz.py`` fuzzes a live router from the document it serves.
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from smg_router import wire
from smg_router.http_io import json_response
from smg_router.request import ENDPOINT_TABLE, Endpoint

__all__ = ["DOCUMENT_PATH", "document", "openapi_json"]

DOCUMENT_PATH = "/openapi.json"
JSON = "application/json"
Schema = dict[str, Any]

ERROR_STATUSES = {
    400: "Malformed JSON, a missing field or a field of the wrong type (the message names it)",
    401: "The bearer token is missing or wrong (only when the router has a key configured)",
    403: "The peer batch came from an address that is no peer of this router",
    404: "No worker serves the model, or no worker has that id (the replica channel: the router has no peers)",
    408: "The client stopped sending the body for --body-timeout seconds",
    409: "The URL is registered already with another spec, or the worker is being removed (a DELETE drains it)",
    413: "The body is larger than the router accepts (--max-payload-size; 64 KiB on the lifecycle API)",
    501: "In PD mode: a generation endpoint prefill/decode dispatch does not cover",
    502: "The worker failed (refused the connection, broke off its answer) on every attempt",
    503: "No routable worker, or the router is at its admission limits (with Retry-After)",
    504: "No worker answered in time",
}


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def _json_content(schema: Schema) -> dict[str, Any]:
    return {JSON: {"schema": schema}}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): {"description": ERROR_STATUSES[s], "content": _json_content(_ref("Error"))} for s in statuses}


def _ok(description: str, schema: Schema, status: int = 200) -> dict[str, Any]:
    return {str(status): {"description": description, "content": _json_content(schema)}}


def _body(schema: Schema) -> dict[str, Any]:
    return {"required": True, "content": _json_content(schema)}


TOKEN_ID: Schema = {"type": "integer", "minimum": 0}
TOKEN_IDS: Schema = {"type": "array", "minItems": 1, "items": TOKEN_ID}
PASSED_THROUGH = "Passed to the worker unchanged; the worker validates it."
STREAM = _nullable({"type": "boolean", "description": "true: the answer is Server-Sent Events."})

SCHEMAS: dict[str, Schema] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "description": "Every error the router answers, and the OpenAI-shaped errors of the workers it relays.",
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "code"],
                "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "code": {"type": "string"}},
            }
        },
    },
    "Model": {
        "anyOf": [{"type": "string", "minLength": 1}, {"type": "null"}],
        "description": "The model to route by; absent or null picks the fleet's only model.",
    },
    "ContentPart": {
        "type": "object",
        "description": "An OpenAI content part; the text of `text` parts is the routing text, others are passed "
        "to the worker as they are.",
        "properties": {"type": {"description": "`text`, `image_url`, ..."}, "text": {}},
    },
    "Message": {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"type": "string"},
            "content": {
                "oneOf": [{"type": "string"}, {"type": "array", "items": _ref("ContentPart")}, {"type": "null"}]
            },
        },
    },
    "ChatCompletionRequest": {
        "type": "object",
        "required": ["messages"],
        "description": "Any other field is passed to the worker unchanged (the bytes are forwarded as sent).",
        "properties": {
            "model": _ref("Model"),
            "messages": {
                "type": "array",
                "minItems": 1,
                "items": _ref("Message"),
                "description": "The whole conversation, in order, is the routing text.",
            },
            "stream": STREAM,
            "max_tokens": _nullable({"type": "integer", "minimum": 1, "description": PASSED_THROUGH}),
        },
    },
    "CompletionRequest": {
        "type": "object",
        "required": ["prompt"],
        "description": "Any other field is passed to the worker unchanged.",
        "properties": {
            "model": _ref("Model"),
            "prompt": {
                "description": "A string, a batch of strings, token ids or a batch of token id lists.",
                "oneOf": [
                    {"type": "string"},
                    {"type": "array", "minItems": 1, "items": {"type": "string"}},
                    TOKEN_IDS,
                    {"type": "array", "minItems": 1, "items": {"type": "array", "items": TOKEN_ID}},
                ],
            },
            "stream": STREAM,
            "max_tokens": _nullable({"type": "integer", "minimum": 1, "description": PASSED_THROUGH}),
        },
    },
    "GenerateRequest": {
        "type": "object",
        "description": "SGLang's native request: `text` or `input_ids` (not null; the worker takes exactly one). "
        "Any other field is passed to the worker unchanged.",
        "anyOf": [
            {"required": ["text"], "properties": {"text": {"not": {"type": "null"}}}},
            {"required": ["input_ids"], "properties": {"input_ids": {"not": {"type": "null"}}}},
        ],
        "properties": {
            "model": _ref("Model"),
            "text": {
                "oneOf": [
                    {"type": "string"},
                    {"type": "array", "minItems": 1, "items": {"type": "string"}},
                    {"type": "null"},
                ]
            },
            "input_ids": {
                "oneOf": [
                    TOKEN_IDS,
                    {"type": "array", "minItems": 1, "items": {"type": "array", "items": TOKEN_ID}},
                    {"type": "null"},
                ]
            },
            "stream": STREAM,
            "sampling_params": {
                "description": "An object (max_new_tokens, temperature, stop, ...). " + PASSED_THROUGH,
                "properties": {"max_new_tokens": _nullable({"type": "integer", "minimum": 0})},
            },
        },
    },
    "MessagesRequest": {
        "type": "object",
        "required": ["messages"],
        "description": "Anthropic Messages; the system prompt and the conversation are the routing text. Any "
        "other field is passed to the worker unchanged.",
        "properties": {
            "model": _ref("Model"),
            "system": {
                "oneOf": [{"type": "string"}, {"type": "array", "items": _ref("ContentPart")}, {"type": "null"}]
            },
            "messages": {"type": "array", "minItems": 1, "items": _ref("Message")},
            "stream": STREAM,
            "max_tokens": _nullable({"type": "integer", "minimum": 1, "description": PASSED_THROUGH}),
        },
    },
    "ResponsesRequest": {
        "type": "object",
        "required": ["input"],
        "description": "OpenAI Responses, stateless (the body is forwarded; `previous_response_id` is the "
        "worker's business). `instructions` and `input` are the routing text.",
        "properties": {
            "model": _ref("Model"),
            "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
            "instructions": _nullable({"type": "string"}),
            "stream": STREAM,
            "max_output_tokens": _nullable({"type": "integer", "minimum": 1, "description": PASSED_THROUGH}),
        },
    },
    "PassThroughRequest": {
        "type": "object",
        "description": "Routed by load to a worker of the model and passed to it unchanged; the worker validates "
        "every field but `model` and `stream`.",
        "properties": {"model": _ref("Model"), "stream": STREAM},
    },
    "TranscriptionRequest": {
        "type": "object",
        "required": ["file"],
        "description": "Streamed through to the worker as it arrives; give `model` before `file` (the router "
        "routes by the fields before the file part; without one, by the fleet's only model). The router reads "
        "`stream` (true or false) there too; any other field, and any after the file, is the worker's to check.",
        "properties": {
            "model": {"type": "string", "minLength": 1},
            "file": {"type": "string", "format": "binary"},
        },
    },
    "WorkerSpec": {
        "type": "object",
        "required": ["url"],
        "additionalProperties": False,
        "description": "A registration (POST /workers); the same URL with the same spec again is a no-op.",
        "properties": {
            "url": {
                "type": "string",
                "minLength": 1,
                "description": "http(s)://host[:port], without credentials, path, query or fragment.",
            },
            "role": _nullable({"type": "string", "enum": ["regular", "prefill", "decode"], "default": "regular"}),
            "model_id": _nullable(
                {
                    "type": "string",
                    "minLength": 1,
                    "description": "Discovered from the worker's /v1/models when absent.",
                }
            ),
            "bootstrap_port": _nullable(
                {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": 65535,
                    "description": "A prefill worker's PD bootstrap port.",
                }
            ),
            "labels": _nullable(
                {
                    "type": "object",
                    "additionalProperties": {"type": "string"},
                    "description": "`policy=<name>` chooses the policy of the worker's model.",
                }
            ),
            "priority": {"type": "integer", "default": 50},
            "owner": _nullable(
                {
                    "type": "string",
                    "default": "user",
                    "description": "Who registered it (the operator writes its own name).",
                }
            ),
            "kv_capacity_tokens": _nullable(
                {
                    "type": "integer",
                    "minimum": 1,
                    "description": "The engine's usable KV cache in tokens.  When set, the worker's share of the "
                    "cache-aware tree is capped at it times `--tree-chars-per-token`, in place of what the engine "
                    "reports (`max_total_num_tokens`, llama.cpp's `/props`); set it for an engine that reports none "
                    "or reports more than it keeps for the cache.  Absent or null: the engine's report, if any.",
                }
            ),
            "kv_events": _nullable(
                {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["endpoint"],
                    "properties": {
                        "endpoint": {"type": "string", "pattern": "^tcp://"},
                        "replay_endpoint": _nullable({"type": "string", "pattern": "^tcp://"}),
                        "topic": _nullable({"type": "string"}),
                    },
                    "description": "Where the worker's engine publishes its KV events (a ZMQ PUB socket, "
                    "`tcp://HOST:PORT`) and replays them (its ROUTER socket, optional); `topic` filters the stream. "
                    "With a `--tokenizer` for the worker's model, the router matches prompts on what the events say "
                    "the engine caches.  Absent or null: none (the router's tree).",
                }
            ),
            "draining": {"description": "Ignored here; PATCH sets it."},
        },
    },
    "WorkerPatch": {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "labels": _nullable({"type": "object", "additionalProperties": {"type": "string"}}),
            "priority": {"type": "integer"},
            "kv_capacity_tokens": _nullable(
                {"type": "integer", "minimum": 1, "description": "null: back to the engine's report."}
            ),
            "draining": _nullable({"type": "boolean", "description": "true: stop routing to it, in-flight finish."}),
        },
    },
    "Worker": {
        "type": "object",
        "required": [
            "id",
            "url",
            "role",
            "model_id",
            "bootstrap_port",
            "labels",
            "priority",
            "owner",
            "kv_capacity_tokens",
            "kv_events",
            "status",
            "routable",
            "breaker",
            "load",
        ],
        "properties": {
            "id": {"type": "string"},
            "url": {"type": "string"},
            "role": {"type": "string", "enum": ["regular", "prefill", "decode"]},
            "model_id": _nullable({"type": "string"}),
            "bootstrap_port": _nullable({"type": "integer"}),
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "priority": {"type": "integer"},
            "owner": {"type": "string"},
            "kv_capacity_tokens": _nullable({"type": "integer"}),
            "kv_events": _nullable({"type": "object"}),
            "status": {"type": "string", "enum": ["pending", "ready", "not_ready", "draining", "failed"]},
            "routable": {"type": "boolean"},
            "breaker": {"type": "string"},
            "load": {
                "type": "object",
                "required": ["inflight", "prefilling", "prefill_chars", "backend", "processed"],
                "properties": {
                    "inflight": {"type": "integer"},
                    "prefilling": {"type": "integer"},
                    "prefill_chars": {"type": "integer"},
                    "backend": _nullable({"type": "integer"}),
                    "processed": {"type": "integer"},
                },
            },
        },
    },
    "Removed": {
        "type": "object",
        "required": ["removed", "drained"],
        "properties": {
            "removed": _ref("Worker"),
            "drained": {"type": "boolean", "description": "false: the drain timed out first"},
        },
    },
    "Event": {
        "type": "object",
        "required": ["data"],
        "description": "One Server-Sent Event of a stream (OpenAPI 3.1: the schema of each event).",
        "properties": {
            "data": {
                "type": "string",
                "description": "A JSON chunk of the worker's stream as it sent "
                'it; {"error": {...}} when the stream fails after its first byte; then [DONE].',
            },
            "event": {"type": "string"},
        },
    },
    "Probe": {
        "type": "object",
        "required": ["status"],
        "properties": {"status": {"type": "string"}, "workers": {"type": "integer"}, "routable": {"type": "integer"}},
    },
}

SCHEMAS["PeerRoutes"] = {
    "type": "object",
    "required": ["from", "records"],
    "description": "What a peer router routed (--peer, --peers-dns): each record is inserted in this router's "
    "tree for its worker, as if this router had routed it (a worker it does not serve is ignored), then its "
    "prefills are held behind.  The whole batch is checked first: a bad record changes nothing.",
    "properties": {
        "from": {"type": "string", "description": "The sender's id: a router's own id answers {self: true}."},
        "records": {
            "type": "array",
            "items": {
                "type": "array",
                "description": "[role, model, worker url, routing text, head]; head is at most the text's length.",
                "prefixItems": [
                    {"enum": ["regular", "prefill", "decode"]},
                    {"type": "string"},
                    {"type": "string"},
                    {"type": "string"},
                    {"type": "integer", "minimum": 0},
                ],
                "minItems": 5,
                "maxItems": 5,
            },
        },
        "prefills": {
            "type": "array",
            "description": "The first prefills of a new prefix that the peer's requests lead (done false) or that "
            "ended (done true): this router's requests with the same leading chars wait for them on that worker.",
            "items": {
                "type": "array",
                "description": "[worker url, leading chars, done].",
                "prefixItems": [{"type": "string"}, {"type": "string", "minLength": 1}, {"type": "boolean"}],
                "minItems": 3,
                "maxItems": 3,
            },
        },
    },
}
_DECLARATION: Schema = {
    "type": "object",
    "required": ["owner", "role"],
    "properties": {
        "owner": {"type": "string", "description": "Who declared it (the operator: its SMGWorker)."},
        "role": {"type": "string", "enum": ["regular", "prefill", "decode"]},
    },
}
SCHEMAS["DeclaredModel"] = {
    "type": "object",
    "required": ["model", "declarations"],
    "description": "A model known with or without workers, and who declared it.",
    "properties": {"model": {"type": "string"}, "declarations": {"type": "array", "items": _DECLARATION}},
}
SCHEMAS["ModelDeclaration"] = {
    "type": "object",
    "additionalProperties": False,
    "description": "PUT /models/{model}: both fields optional (an empty body too).",
    "properties": {
        "role": _nullable(
            {
                "type": "string",
                "enum": ["regular", "prefill", "decode"],
                "default": "regular",
                "description": "The role of the workers it will bring (informative).",
            }
        ),
        "owner": _nullable(
            {
                "type": "string",
                "maxLength": 256,
                "default": "user",
                "description": "Whose declaration: the model stays known until every owner withdrew.",
            }
        ),
    },
}
SCHEMAS["WorkerReplacement"] = {
    **{k: v for k, v in SCHEMAS["WorkerSpec"].items() if k != "required"},
    "description": "A whole new spec (PUT): what it leaves out takes its default; `url` may be left out but "
    "cannot change, and a missing `model_id` keeps the known one.",
}

Security = list[dict[str, list[str]]]
ADMIN: Security = [{"adminKey": []}]
DATA: Security = [{"apiKey": []}]
OPEN: Security = []
WORKER_ID = {
    "name": "worker_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
    "description": "`w-` and 12 hex digits of the URL's SHA-1 (GET /workers lists them).",
}
DRAIN_TIMEOUT = {
    "name": "timeout",
    "in": "query",
    "required": False,
    "schema": {"type": "number", "minimum": 0},
    "description": "Seconds to wait for in-flight requests (default --drain-timeout).",
}
MODEL = {
    "name": "model",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "minLength": 1, "maxLength": 256, "pattern": "^[^\\x00-\\x1f\\x7f]+$"},
    "description": "The model's name as clients send it (it may hold slashes: `org/name`); no control characters.",
}
OWNER = {
    "name": "owner",
    "in": "query",
    "required": False,
    "schema": {"type": "string"},
    "description": "Withdraw this owner's declaration only (default: every owner's).",
}
QUERY_URL = {"name": "url", "in": "query", "required": True, "schema": {"type": "string", "minLength": 1}}


REQUEST_SCHEMAS = {
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/completions": "CompletionRequest",
    "/generate": "GenerateRequest",
    "/v1/messages": "MessagesRequest",
    "/v1/responses": "ResponsesRequest",
    "/v1/audio/transcriptions": "TranscriptionRequest",
}
"""The request schema of a forwarded path; the others take ``PassThroughRequest`` plus their required fields."""


def _request_schema(endpoint: Endpoint) -> Schema:
    named = REQUEST_SCHEMAS.get(endpoint.path)
    if named is not None:
        return _ref(named)
    schema: Schema = {"allOf": [_ref("PassThroughRequest")]}
    for group in endpoint.required:  # each group: one of its fields, not null (what parse_endpoint checks)
        schema["allOf"].append(
            {"anyOf": [{"required": [f], "properties": {f: {"not": {"type": "null"}}}} for f in group]}
        )
    return schema


def _forwarded(endpoint: Endpoint) -> dict[str, Any]:
    how = "routed by load (least-loaded worker of the model)" if endpoint.by_load else "routed by the model's policy"
    kind = "multipart/form-data" if endpoint.multipart else JSON
    return {
        "post": {
            "summary": f"{endpoint.summary}, {how}",
            "security": DATA,
            "requestBody": {"required": True, "content": {kind: {"schema": _request_schema(endpoint)}}},
            "responses": {
                "200": {
                    "description": "The worker's answer, relayed (Server-Sent Events when `stream` is true)",
                    "content": {JSON: {"schema": {}}, "text/event-stream": {"schema": _ref("Event")}},
                },
                **_errors(400, 401, 404, 408, 413, 501, 502, 503, 504),
                "default": {
                    "description": "Any other error the worker answered, relayed",
                    "content": _json_content(_ref("Error")),
                },
            },
        }
    }


def _probe(summary: str, *, can_fail: bool) -> dict[str, Any]:
    responses = _ok("Ready" if can_fail else "Alive", _ref("Probe"))
    if can_fail:
        responses |= _ok("Not ready: no routable worker, or shutting down", _ref("Probe"), 503)
    return {"get": {"summary": summary, "security": OPEN, "responses": responses}}


def _paths() -> dict[str, Any]:
    worker = _ref("Worker")
    return {
        **{path: _forwarded(endpoint) for path, endpoint in ENDPOINT_TABLE.items()},
        "/v1/models": {
            "get": {
                "summary": "Every model a registered worker serves or someone declared, with its workers by role "
                "(`smg`)",
                "security": DATA,
                "responses": {
                    **_ok(
                        "Models",
                        {
                            "type": "object",
                            "required": ["object", "data"],
                            "properties": {
                                "object": {"type": "string"},
                                "data": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "required": ["id", "smg"],
                                        "properties": {
                                            "id": {"type": "string"},
                                            "smg": {
                                                "type": "object",
                                                "required": ["roles", "workers", "routable"],
                                                "properties": {
                                                    "roles": {
                                                        "type": "object",
                                                        "additionalProperties": {"type": "integer"},
                                                        "description": "role -> number of workers",
                                                    },
                                                    "workers": {"type": "integer"},
                                                    "routable": {"type": "integer"},
                                                    "declared": {
                                                        "type": "array",
                                                        "items": _DECLARATION,
                                                        "description": "A declared model's declarations "
                                                        "(PUT /models/{model}); absent when nobody declared it.",
                                                    },
                                                },
                                            },
                                        },
                                    },
                                },
                            },
                        },
                    ),
                    **_errors(401),
                },
            }
        },
        "/health": _probe("Same as /readiness", can_fail=True),
        "/liveness": _probe("The process serves", can_fail=False),
        "/readiness": _probe(
            "At least one routable worker (PD: a prefill and a decode one; none needed with --hold-when-empty); with"
            " peers, in sync with them (at most --peers-ready-grace seconds after the start)",
            can_fail=True,
        ),
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics (docs/metrics.md)",
                "security": OPEN,
                "responses": {
                    "200": {
                        "description": "Text exposition format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        DOCUMENT_PATH: {
            "get": {
                "summary": "This document",
                "security": OPEN,
                "responses": _ok("OpenAPI 3.1 document", {"type": "object"}),
            }
        },
        "/workers": {
            "post": {
                "summary": "Register a worker",
                "security": ADMIN,
                "requestBody": _body(_ref("WorkerSpec")),
                "responses": {
                    **_ok("Already registered with this spec", worker),
                    **_ok("Registered", worker, 201),
                    **_errors(400, 401, 408, 409, 413),
                },
            },
            "get": {
                "summary": "Every registered worker",
                "security": OPEN,
                "responses": _ok(
                    "The fleet",
                    {
                        "type": "object",
                        "required": ["workers"],
                        "properties": {
                            "workers": {"type": "array", "items": worker},
                            "declared_models": {"type": "array", "items": _ref("DeclaredModel")},
                        },
                    },
                ),
            },
        },
        "/workers/{worker_id}": {
            "parameters": [WORKER_ID],
            "get": {
                "summary": "One worker",
                "security": OPEN,
                "responses": {**_ok("The worker", worker), **_errors(404)},
            },
            "patch": {
                "summary": "Change labels, priority or draining",
                "security": ADMIN,
                "requestBody": _body(_ref("WorkerPatch")),
                "responses": {**_ok("The worker", worker), **_errors(400, 401, 404, 408, 409, 413)},
            },
            "put": {
                "summary": "Replace the spec (url may be left out: it cannot change)",
                "security": ADMIN,
                "requestBody": _body(_ref("WorkerReplacement")),
                "responses": {**_ok("The worker", worker), **_errors(400, 401, 404, 408, 409, 413)},
            },
            "delete": {
                "summary": "Drain, then remove",
                "security": ADMIN,
                "parameters": [DRAIN_TIMEOUT],
                "responses": {**_ok("Removed", _ref("Removed")), **_errors(400, 401, 404)},
            },
        },
        "/models/{model}": {
            "parameters": [MODEL],
            "put": {
                "summary": "Declare a model with or without workers: a request for it waits for a worker "
                "(--hold-when-empty) or gets a 503, never a 404",
                "security": ADMIN,
                "requestBody": {"required": False, "content": _json_content(_ref("ModelDeclaration"))},
                "responses": {
                    **_ok("Declared again by this owner", _ref("DeclaredModel")),
                    **_ok("Declared by a new owner", _ref("DeclaredModel"), 201),
                    **_errors(400, 401, 404, 408, 413),
                },
            },
            "delete": {
                "summary": "Withdraw a declaration (the model stays known while a worker serves it or another "
                "owner declares it)",
                "security": ADMIN,
                "parameters": [OWNER],
                "responses": {
                    **_ok("Withdrawn: the declarations left", _ref("DeclaredModel")),
                    **_errors(400, 401, 404),
                },
            },
        },
        "/add_worker": {
            "post": {
                "summary": "SGLang router compatible: register a worker by URL",
                "security": ADMIN,
                "parameters": [QUERY_URL],
                "responses": {
                    **_ok("Already registered", worker),
                    **_ok("Registered", worker, 201),
                    **_errors(400, 401, 409),
                },
            }
        },
        "/remove_worker": {
            "post": {
                "summary": "SGLang router compatible: drain and remove a worker by URL",
                "security": ADMIN,
                "parameters": [QUERY_URL, DRAIN_TIMEOUT],
                "responses": {**_ok("Removed", _ref("Removed")), **_errors(400, 401, 404)},
            }
        },
        "/peers/routes": {
            "post": {
                "summary": "What a peer router routed, for this router's tree (router to router)",
                "description": "Taken only by a router with peers (else 404), only from a peer's address (else 403), "
                "signed with --peer-secret when one is set (else 401): the X-SMG-Peer-Time, X-SMG-Peer-Nonce and "
                "X-SMG-Peer-Signature headers (HMAC-SHA256; the answer carries X-SMG-Peer-Signature too).  Not the "
                "admin key.",
                "security": [{"peerSignature": []}],
                "requestBody": _body(_ref("PeerRoutes")),
                "responses": {
                    **_ok(
                        "Taken in: how many records were applied and ignored, this router's id and the starts told "
                        "that it leads itself (a claim on one of them yields); or self: the sender is this router",
                        {
                            "type": "object",
                            "properties": {
                                "applied": {"type": "integer", "minimum": 0},
                                "ignored": {"type": "integer", "minimum": 0},
                                "id": {"type": "string"},
                                "leads": {
                                    "type": "array",
                                    "items": {
                                        "type": "array",
                                        "description": "[worker url, leading chars].",
                                        "items": {"type": "string"},
                                        "minItems": 2,
                                        "maxItems": 2,
                                    },
                                },
                                "self": {"type": "boolean"},
                            },
                        },
                    ),
                    **_errors(400, 401, 403, 404, 408, 413),
                },
            }
        },
        "/list_workers": {
            "get": {
                "summary": "SGLang router compatible: the registered URLs",
                "security": OPEN,
                "responses": _ok(
                    "URLs",
                    {
                        "type": "object",
                        "required": ["urls"],
                        "properties": {"urls": {"type": "array", "items": {"type": "string"}}},
                    },
                ),
            }
        },
    }


def _version() -> str:
    try:
        return version("smg-router-py")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0.0.0"


@cache
def document() -> dict[str, Any]:
    """The whole document (built once; callers must not change it)."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "SMG router",
            "version": _version(),
            "description": "OpenAI-compatible data plane and lifecycle API of a cache-aware LLM router. "
            'Errors are `{"error": {"message", "type", "code"}}`.',
        },
        "paths": _paths(),
        "components": {
            "schemas": SCHEMAS,
            "securitySchemes": {
                "adminKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "--admin-api-key; lifecycle mutations need it when one is set",
                },
                "apiKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "--api-key; the data plane needs it when one is set",
                },
                "peerSignature": {
                    "type": "apiKey",
                    "in": "header",
                    "name": "X-SMG-Peer-Signature",
                    "description": "--peer-secret: an HMAC-SHA256 of the batch (with X-SMG-Peer-Time and "
                    "X-SMG-Peer-Nonce); the replica channel only, from a peer's address only",
                },
            },
        },
    }


async def openapi_json(request: wire.Request) -> wire.Response:
    return json_response(document())
