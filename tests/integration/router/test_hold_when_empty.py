"""Scale from zero: a request for a known model with no routable worker waits (``--hold-when-empty``), bounded.

Real ``smg-router`` processes and real ``smg-sim`` workers on loopback.  A model is known when a worker of it is
registered (in any state) or when it was declared (``PUT /models/{model}``); a request for it waits in the model's
queue until a worker is registered or turns ready, and gets a 503 with ``Retry-After`` when the hold is off, expired or
full.  The queue depth is scraped from ``/metrics`` while requests wait.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from support.procs import (
    Router,
    Sim,
    free_port,
    http_json,
    http_json_headers,
    metric_value,
    next_host,
    start_router,
    start_sim,
    wait_until,
)

WORKER_DELAY = 3.0
"""Seconds after the request that its worker comes (registered, or ready)."""


class Call(threading.Thread):
    """One completion request in the background: its status, body, headers and how long it took."""

    def __init__(self, router: Router, model: str, *, timeout: float = 30.0) -> None:
        super().__init__(daemon=True)
        self._router, self._model, self._timeout = router, model, timeout
        self.status: int | None = None
        self.body: Any = None
        self.headers: Any = None
        self.seconds = 0.0
        self.start()

    def run(self) -> None:
        t0 = time.monotonic()
        self.status, self.body, self.headers = http_json_headers(
            "POST",
            self._router.url + "/v1/completions",
            {"model": self._model, "prompt": "hello from zero", "max_tokens": 1},
            timeout=self._timeout,
        )
        self.seconds = time.monotonic() - t0

    def result(self) -> tuple[int | None, Any]:
        self.join(self._timeout + 5)
        assert not self.is_alive(), "the request never finished"
        return self.status, self.body


def _waiting(router: Router, model: str, role: str = "regular") -> float:
    return metric_value(router.metrics(), "smg_model_requests_waiting", model=model, role=role)


def _holds(router: Router, model: str, outcome: str) -> float:
    return metric_value(router.metrics(), "smg_model_holds_total", model=model, outcome=outcome)


def _declare(router: Router, model: str, **body: Any) -> None:
    status, answer = router.admin("PUT", f"/models/{model}", body or None)
    assert status in (200, 201), answer


@pytest.fixture(scope="module")
def holding(logs: Path) -> Iterator[Router]:
    """A router with no workers at start that holds requests up to 20 s."""
    router = start_router(logs, args=["--hold-when-empty", "20"])
    yield router
    router.stop()


@pytest.fixture(scope="module")
def not_holding(logs: Path) -> Iterator[Router]:
    """A router with the hold off (the default)."""
    router = start_router(logs)
    yield router
    router.stop()


@pytest.fixture(scope="module")
def short(logs: Path) -> Iterator[Router]:
    """A router that holds 1.5 s, one request per model."""
    router = start_router(logs, args=["--hold-when-empty", "1.5", "--hold-queue-size", "1"])
    yield router
    router.stop()


@pytest.fixture
def sims(logs: Path) -> Iterator[list[Sim]]:
    started: list[Sim] = []
    yield started
    for sim in started:
        sim.stop()


def test_a_held_request_is_sent_once_a_worker_of_its_declared_model_registers(
    holding: Router, logs: Path, sims: list[Sim]
) -> None:
    model = "zero-registered"
    _declare(holding, model)
    call = Call(holding, model)
    wait_until(lambda: _waiting(holding, model) == 1, what="the request held")
    time.sleep(WORKER_DELAY - 0.5)
    assert call.is_alive() and _waiting(holding, model) == 1, "still held while no worker exists"
    sims.append(start_sim(logs, model=model))
    status, body = holding.admin("POST", "/workers", {"url": sims[0].url, "model_id": model})
    assert status == 201, body
    assert call.result()[0] == 200, call.body
    assert call.body["choices"], call.body
    assert call.seconds >= WORKER_DELAY - 0.5
    assert _waiting(holding, model) == 0
    assert _holds(holding, model, "sent") == 1


def test_a_held_request_is_sent_once_an_unready_worker_turns_ready(
    holding: Router, logs: Path, sims: list[Sim]
) -> None:
    model = "zero-unready"
    host = next_host()
    port = free_port(host)
    url = f"http://{host}:{port}"
    status, body = holding.admin("POST", "/workers", {"url": url, "model_id": model})  # nothing listens there yet
    assert status == 201 and not body["routable"], body
    call = Call(holding, model)
    wait_until(lambda: _waiting(holding, model) == 1, what="the request held")
    time.sleep(WORKER_DELAY)
    assert call.is_alive(), "held while its worker is not ready"
    sims.append(start_sim(logs, model=model, host=host, port=port))  # the health checker finds it ready
    assert call.result()[0] == 200, call.body
    assert call.seconds >= WORKER_DELAY
    assert _waiting(holding, model) == 0


def test_a_held_request_is_sent_once_its_drained_worker_is_undrained(
    holding: Router, logs: Path, sims: list[Sim]
) -> None:
    model = "zero-drained"
    sims.append(start_sim(logs, model=model))
    status, worker = holding.admin("POST", "/workers", {"url": sims[0].url, "model_id": model})
    assert status == 201 and worker["routable"], worker
    status, worker = holding.admin("PATCH", f"/workers/{worker['id']}", {"draining": True})
    assert status == 200 and not worker["routable"], worker
    call = Call(holding, model)
    wait_until(lambda: _waiting(holding, model) == 1, what="the request held")
    assert holding.admin("PATCH", f"/workers/{worker['id']}", {"draining": False})[0] == 200
    assert call.result()[0] == 200, call.body
    assert _waiting(holding, model) == 0


def test_a_holding_router_is_ready_without_a_routable_worker_and_one_that_does_not_hold_is_not(
    holding: Router, not_holding: Router
) -> None:
    assert http_json("GET", holding.url + "/readiness")[0] == 200  # else its Service would send it nothing to hold
    _declare(not_holding, "zero-ready")
    status, body = http_json("GET", not_holding.url + "/readiness")
    assert status == 503 and body["routable"] == 0, body


def test_held_requests_go_in_arrival_order_and_the_queue_depth_is_a_gauge(
    holding: Router, logs: Path, sims: list[Sim]
) -> None:
    model = "zero-order"
    _declare(holding, model)
    calls = []
    for n in range(3):
        calls.append(Call(holding, model))
        wait_until(lambda n=n: _waiting(holding, model) == n + 1, what=f"{n + 1} requests held")
    sims.append(start_sim(logs, model=model))
    assert holding.admin("POST", "/workers", {"url": sims[0].url, "model_id": model})[0] == 201
    for call in calls:
        assert call.result()[0] == 200, call.body
    assert _waiting(holding, model) == 0
    assert _holds(holding, model, "sent") == 3


def test_a_client_that_goes_away_leaves_the_queue(holding: Router) -> None:
    model = "zero-cancelled"
    _declare(holding, model)
    body = orjson.dumps({"model": model, "prompt": "bye", "max_tokens": 1})
    with socket.create_connection((holding.host, holding.port), timeout=5) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_until(lambda: _waiting(holding, model) == 1, what="the request held")
    wait_until(lambda: _waiting(holding, model) == 0, what="the request out of the queue")
    wait_until(lambda: _holds(holding, model, "cancelled") == 1, what="counted cancelled")
    assert _holds(holding, model, "sent") == 0


def test_with_the_hold_off_a_request_for_a_declared_model_gets_a_503_with_retry_after_at_once(
    not_holding: Router,
) -> None:
    model = "zero-off"
    _declare(not_holding, model)
    t0 = time.monotonic()
    status, body, headers = http_json_headers(
        "POST", not_holding.url + "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 1}
    )
    assert time.monotonic() - t0 < 1.0
    assert status == 503, body
    assert headers["Retry-After"] == "5"
    assert model in body["error"]["message"] and body["error"]["code"] == "no_available_workers", body


def test_a_declared_model_is_known_and_an_undeclared_one_is_not(not_holding: Router) -> None:
    model = "org/zero-declared"  # a model name may hold a slash
    status, answer = not_holding.admin("PUT", f"/models/{model}", {"role": "regular", "owner": "me"})
    assert status == 201, answer
    assert answer == {"model": model, "declarations": [{"owner": "me", "role": "regular"}]}
    assert not_holding.admin("PUT", f"/models/{model}", {"owner": "me"})[0] == 200  # again: no new owner
    status, listed = http_json("GET", not_holding.url + "/v1/models")
    (entry,) = [m for m in listed["data"] if m["id"] == model]
    assert entry["smg"]["workers"] == 0 and entry["smg"]["declared"] == [{"owner": "me", "role": "regular"}]
    assert not_holding.complete("x", model=model).status == 503
    assert not_holding.complete("x", model="zero-never-declared").status == 404
    status, answer = not_holding.admin("DELETE", f"/models/{model}?owner=someone-else")
    assert status == 404 and answer["error"]["code"] == "model_not_declared", answer
    status, answer = not_holding.admin("DELETE", f"/models/{model}?owner=me")
    assert status == 200 and answer["declarations"] == [], answer
    assert not_holding.complete("x", model=model).status == 404


def test_declarations_refuse_bad_fields_by_name(not_holding: Router) -> None:
    for body, field in (({"role": "leader"}, "role"), ({"owner": 5}, "owner"), ({"size": 1}, "size")):
        status, answer = not_holding.admin("PUT", "/models/zero-bad", body)
        assert status == 400 and answer["error"]["message"].startswith(f"{field}:"), answer
    status, answer = not_holding.admin("PUT", "/models/" + "m" * 257)
    assert status == 400 and answer["error"]["message"].startswith("model:"), answer
    assert not_holding.complete("x", model="zero-bad").status == 404  # nothing half applied


def test_past_the_hold_a_503_with_retry_after(short: Router) -> None:
    model = "zero-expired"
    _declare(short, model)
    call = Call(short, model)
    status, body = call.result()
    assert status == 503, body
    assert 1.4 <= call.seconds < 4.0, call.seconds
    assert call.headers["Retry-After"] == "5"
    assert body["error"]["code"] == "hold_expired" and model in body["error"]["message"], body
    assert _holds(short, model, "expired") == 1
    assert _waiting(short, model) == 0


def test_a_full_queue_answers_503_at_once(short: Router) -> None:
    model = "zero-full"
    _declare(short, model)
    first = Call(short, model)
    wait_until(lambda: _waiting(short, model) == 1, what="the first request held")
    t0 = time.monotonic()
    status, body, headers = http_json_headers(
        "POST", short.url + "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 1}
    )
    assert time.monotonic() - t0 < 1.0
    assert status == 503 and body["error"]["code"] == "hold_queue_full", body
    assert headers["Retry-After"] == "5"
    assert _holds(short, model, "full") == 1
    assert first.result()[0] == 503  # expired meanwhile
