"""A live router fuzzed from its own ``GET /openapi.json`` (schemathesis 4, hypothesis underneath).

A real ``smg-router`` (admin key and data-plane key set) in front of real ``smg-sim`` workers gets
schema-valid and schema-invalid requests for every documented operation, with the right key, no key or
the other key.  Every answer must be:

- documented (status, content type and body schema: schemathesis' conformance checks), and a request
  that breaks the schema must be refused (``negative_data_rejection``): the document is no looser than
  the router and its workers;
- never a 5xx of the router's own making.  Accepted: 502, 503 and 504 on the data plane only, as
  OpenAI-shaped JSON, because they describe the fleet, not a router fault: 503 when no routable worker
  serves the model (the fuzzer registers unreachable workers, drains and deletes real ones), 502/504 when
  a worker fails or times out.  Never a 500 (a crash, ours or a worker's) and never a 5xx from the
  lifecycle API;
- OpenAI-shaped JSON whenever it is an error (``{"error": {"message", "type", "code"}}``);
- 401 exactly when an operation that needs a key went without the right one.

Then the fleet must be what the successful calls made of it (nothing a refused call tried stays behind,
every listed worker has a valid spec), the router's log holds no unhandled exception, and it still serves
a normal chat completion.  Not checked here: that schema-valid requests are accepted; on the data plane
that is the worker's call, on the lifecycle API it depends on state (409 for a URL registered with another
spec, PUT's url must be the worker's own).

Safety and bounds: a URL the router would accept is replaced by one of a fixed pool on loopback (the real
workers and a few closed ports), so the router never probes an address the fuzzer made up; generation
lengths are capped.  Deterministic: hypothesis derandomized, no example database, no shrinking (a failure
is reported as generated).  The examples are fixed for a given set of collected tests (collecting other
modules in the same run was seen to shift them); eight runs with random seeds passed too.

The last test records a bug this fuzzer found outside the files of its change (a client hanging up
mid-stream), as an expected failure.
"""

from __future__ import annotations

import socket
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)
from smg_router.request import ENDPOINT_TABLE
from smg_router.workers.worker import SpecError, WorkerSpec, normalize_url, worker_id_for
from support.procs import MODEL, Router, Sim, http_json, metric_value, start_router, start_sim, wait_until

ADMIN_KEY, API_KEY = "fuzz-admin-key", "fuzz-api-key"
EXAMPLES = 100
"""Examples per operation and mode (31 operations, 23 with a parameter or body to break): about 4,500 calls."""
MAX_TOKENS = 3
SPEC_FIELDS = ("url", "role", "model_id", "bootstrap_port", "labels", "priority", "owner")
FLEET_STATUSES = {502, 503, 504}
"""The 5xx the data plane may answer, as OpenAI-shaped JSON: the fleet's state, not a router fault."""
GHOSTS = [f"http://127.0.0.{host}:9" for host in (250, 251)]
"""Registered by the fuzzer, never reachable: nothing listens there (support.procs hands out .2 - .249)."""
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance, negative_data_rejection]


@dataclass
class Fleet:
    """What the successful lifecycle calls made of the registry: URL -> spec fields."""

    specs: dict[str, dict[str, Any]] = field(default_factory=dict)

    def record(self, method: str, path: str, status: int, body: Any) -> None:
        if not 200 <= status < 300 or method == "GET":
            return
        if path in ("/workers", "/add_worker") or (method in ("PUT", "PATCH") and path == "/workers/{worker_id}"):
            self.specs[body["url"]] = {k: body[k] for k in SPEC_FIELDS}
        elif path in ("/workers/{worker_id}", "/remove_worker"):  # DELETE, remove_worker
            del self.specs[body["removed"]["url"]]


@pytest.fixture(scope="module")
def sims(logs: Path) -> Iterator[list[Sim]]:
    """The first serves the final check (the fuzzer never learns its URL or id); the others are fuzz targets."""
    started = [start_sim(logs, time_scale=0.01, extra=["--max-tokens-default", str(MAX_TOKENS)]) for _ in range(3)]
    yield started
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def fuzzed(logs: Path, sims: list[Sim]) -> Iterator[Router]:
    router = start_router(
        logs, workers=[sims[0].url], admin_key=ADMIN_KEY, args=["--api-key", API_KEY, "--request-timeout", "10"]
    )
    router.wait_routable(1)
    for sim in sims[1:]:
        status, body = router.admin("POST", "/workers", {"url": sim.url, "model_id": MODEL})
        assert status == 201, body
    yield router
    router.stop()


def _pick(pool: list[str], value: Any, *, keep: int = 0) -> str | None:
    """A stable choice from ``pool`` by the value's bytes (None for ``keep`` of every len(pool) + keep)."""
    index = zlib.crc32(repr(value).encode()) % (len(pool) + keep)
    return pool[index] if index < len(pool) else None


def _cap(body: dict[str, Any], key: str) -> None:
    value = body.get(key)
    if type(value) is int and value > MAX_TOKENS:
        body[key] = MAX_TOKENS


def _tame(case: Any, mode: GenerationMode, urls: list[str], ids: list[str]) -> None:
    """Keep the router's traffic on our loopback addresses and generation short.

    A URL the router would accept becomes one of ``urls``; one it refuses stays as generated (refused the
    same way, nothing is probed), except that half of the schema-valid cases get one of ``urls`` too: a
    schema cannot state the URL grammar, and random strings would almost never register a worker.
    A ``worker_id`` becomes one of ``ids`` (the pool's) four times in five.
    """
    body = case.body if isinstance(case.body, dict) else None
    for container, key in ((body, "url"), (case.query, "url")):
        if container is not None and key in container:
            try:
                normalize_url(container[key])
            except SpecError:
                if mode is GenerationMode.NEGATIVE or _pick(urls, container[key], keep=len(urls)) is None:
                    continue
            container[key] = _pick(urls, container[key])
    if case.path_parameters and "worker_id" in case.path_parameters:
        case.path_parameters["worker_id"] = (
            _pick(ids, case.path_parameters["worker_id"], keep=1) or case.path_parameters["worker_id"]
        )
    if body is not None:
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            _cap(body, key)
        if isinstance(body.get("sampling_params"), dict):
            _cap(body["sampling_params"], "max_new_tokens")


def _is_openai_error(body: Any) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and all(isinstance(error.get(k), str) for k in ("message", "type", "code"))


def _check_answer(operation: Any, case: Any, response: Any, *, auth: str, secured: bool) -> None:
    where = f"{case.method} {case.formatted_path} -> {response.status_code}\n{case.as_curl_command()}"
    status = response.status_code
    data_plane = operation.path in ENDPOINT_TABLE
    assert status < 500 or (data_plane and status in FLEET_STATUSES), f"a server error: {where}\n{response.text}"
    if status >= 400:
        try:
            body = orjson.loads(response.content)
        except orjson.JSONDecodeError:
            body = None
        assert _is_openai_error(body), f"not an OpenAI-shaped error: {where}\n{response.text[:500]}"
    if secured and auth != "right":
        assert status == 401, f"{auth} key accepted: {where}"
    elif status == 401:
        raise AssertionError(f"the right key (or none needed) refused: {where}\n{response.text}")


def _fuzz(
    router: Router,
    operation: Any,
    mode: GenerationMode,
    *,
    needs: list[Any],
    fleet: Fleet,
    urls: list[str],
    ids: list[str],
    outcomes: Counter[tuple[str, int]],
) -> int:
    right = ADMIN_KEY if needs == [{"adminKey": []}] else API_KEY
    peer_channel = needs == [{"peerSignature": []}]
    """Router to router, signed with the peers' secret, not a bearer key: this router has no peers, so none exists."""
    calls = 0

    @SETTINGS
    @given(case=operation.as_strategy(generation_mode=mode), auth=st.sampled_from(["right"] * 4 + ["none", "wrong"]))
    def run(case: Any, auth: str) -> None:
        nonlocal calls
        note(f"{operation.label}, {mode.value} case")
        _tame(case, mode, urls, ids)
        case.headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
        if auth != "none":
            key = right if auth == "right" else (API_KEY if right == ADMIN_KEY else ADMIN_KEY)
            case.headers["Authorization"] = f"Bearer {key}"
        response = case.call(base_url=router.url, timeout=30)
        calls += 1
        outcomes[operation.label, response.status_code] += 1
        _check_answer(operation, case, response, auth=auth, secured=bool(needs) and not peer_channel)
        if peer_channel:
            assert response.status_code == 404, f"a router without peers took a peer batch: {response.text[:300]}"
            assert response.json()["error"]["code"] == "peers_disabled"
        case.validate_response(response, checks=CHECKS)
        content_type = {k.lower(): v for k, v in response.headers.items()}.get("content-type", [""])[0]
        if 200 <= response.status_code < 300 and content_type.startswith("application/json"):
            fleet.record(case.method.upper(), operation.path, response.status_code, response.json())

    run()
    return calls


def _check_fleet(router: Router, fleet: Fleet, control: Sim) -> None:
    listed = {w["url"]: w for w in router.workers()}
    assert set(listed) == set(fleet.specs) | {control.url}, "the registry is not what the accepted calls made"
    for url, worker in listed.items():
        assert worker["id"] == worker_id_for(url)
        spec = WorkerSpec.from_json({k: worker[k] for k in SPEC_FIELDS})  # a valid spec, whole
        assert spec.url == url
        if url == control.url:
            continue
        want = fleet.specs[url]
        got = {k: worker[k] for k in SPEC_FIELDS}
        if want["model_id"] is None:  # discovered by the health checker since
            got["model_id"] = None
        assert got == want, f"{url}: the spec differs from what the last accepted call answered"


def test_every_operation_fuzzed_from_the_document_leaves_a_sound_router(fuzzed: Router, sims: list[Sim]) -> None:
    started = time.monotonic()
    status, document = http_json("GET", fuzzed.url + "/openapi.json")
    assert status == 200, document
    # the fuzzer sends the key itself (right, wrong or none), so schemathesis generates no Authorization; it
    # reads every stream to its end (generation is capped): hanging up mid-stream is another test's concern
    config = schemathesis.Config.from_dict(
        {"generation": {"with-security-parameters": False}, "max-stream-events": 100_000}
    )
    schema = schemathesis.openapi.from_dict(document, config=config)
    urls = [s.url for s in sims[1:]] + GHOSTS
    ids = [worker_id_for(u) for u in urls]
    fleet = Fleet(specs={w["url"]: {k: w[k] for k in SPEC_FIELDS} for w in fuzzed.workers() if w["url"] != sims[0].url})
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 18
    calls = 0
    unbreakable: set[str] = set()
    outcomes: Counter[tuple[str, int]] = Counter()
    for operation in operations:
        needs = document["paths"][operation.path][operation.method.lower()]["security"]
        calls += _fuzz(
            fuzzed, operation, GenerationMode.POSITIVE, needs=needs, fleet=fleet, urls=urls, ids=ids, outcomes=outcomes
        )
        try:
            calls += _fuzz(
                fuzzed,
                operation,
                GenerationMode.NEGATIVE,
                needs=needs,
                fleet=fleet,
                urls=urls,
                ids=ids,
                outcomes=outcomes,
            )
        except Unsatisfiable:
            unbreakable.add(operation.label)
    # a string path parameter cannot break the schema, nor can an operation that takes nothing
    assert unbreakable == {"GET /workers/{worker_id}"} | {
        op.label for op in operations if not (op.body or op.query or op.path_parameters)
    }
    # the run reached what it is for: answers, registrations, changes, removals and refusals of every kind
    answered = {label for label, status in outcomes if 200 <= status < 300}
    assert {
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "POST /generate",
        "PATCH /workers/{worker_id}",
        "PUT /workers/{worker_id}",
        "DELETE /workers/{worker_id}",
        "POST /remove_worker",
    } <= answered
    assert outcomes["POST /workers", 201] + outcomes["POST /add_worker", 201] > 0
    bearer = {
        op.label
        for op in operations
        if document["paths"][op.path][op.method]["security"] not in ([], [{"peerSignature": []}])
    }
    assert bearer == {label for label, status in outcomes if status == 401}
    assert {status for label, status in outcomes if label == "POST /peers/routes"} == {404}  # no peers here
    assert {label for label, status in outcomes if status == 400} >= {
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "POST /generate",
        "POST /workers",
        "POST /add_worker",
        "PATCH /workers/{worker_id}",
        "PUT /workers/{worker_id}",
    }
    assert fuzzed.alive(), fuzzed.log()[-3000:]
    log = fuzzed.log()
    assert "Traceback" not in log and "Error handling request" not in log, log[-5000:]
    _check_fleet(fuzzed, fleet, sims[0])
    status, answer = http_json(
        "POST",
        fuzzed.url + "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert status == 200 and isinstance(answer["choices"][0]["message"]["content"], str), answer
    statuses = Counter(status for (_, status), n in outcomes.items() for _ in range(n))
    print(
        f"{calls} calls over {len(operations)} operations in {time.monotonic() - started:.1f} s: "
        f"{dict(sorted(statuses.items()))}"
    )


def test_a_client_hanging_up_mid_stream_is_counted_499_and_logs_no_error(logs: Path, sims: list[Sim]) -> None:
    router = start_router(logs, workers=[sims[0].url])
    try:
        router.wait_routable(1)
        body = orjson.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000, "stream": True}
        )
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {router.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        hangups = 30
        for i in range(hangups):
            with socket.create_connection((router.host, router.port), timeout=10) as conn:
                conn.sendall(head + body)
                received = 0
                while received < 3000 * (i % 5 + 1):  # hang up after a few events, at different points
                    received += len(conn.recv(65536))
        wait_until(
            lambda: metric_value(router.metrics(), "smg_requests_total") >= hangups,
            what="every hung-up request counted",
        )
        text = router.metrics()
        assert metric_value(text, "smg_requests_total", status="500") == 0
        assert metric_value(text, "smg_requests_total", status="499") == hangups
        assert "Error handling request" not in router.log()
    finally:
        router.stop()
