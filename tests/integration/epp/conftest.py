"""The Endpoint Picker behind a real Envoy: three smg-sim workers, a router picking for the gateway (``--epp-port``),
and one Envoy gateway per test (``support.envoy``), each a real process on loopback."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from support.envoy import Envoy, start_envoy
from support.procs import Router, Sim, free_port, metric_value, start_router, start_sim


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("epp-logs")


@pytest.fixture(scope="module")
def fleet(logs: Path) -> Iterator[list[Sim]]:
    sims = [start_sim(logs) for _ in range(3)]
    yield sims
    for s in sims:
        s.stop()


def start_picker(logs: Path, workers: list[Sim], *args: str) -> Router:
    """A router that picks for a gateway (``--epp-port``, ``--epp-health-port``), its workers routable."""
    epp, health = free_port(), free_port()
    router = start_router(
        logs,
        workers=[s.url for s in workers],
        args=["--epp-port", str(epp), "--epp-health-port", str(health), "--model-id", "sim-model", *args],
    )
    router.epp_port, router.epp_health_port = epp, health
    if workers:
        router.wait_routable(len(workers))
    return router


@pytest.fixture(scope="module")
def picker(logs: Path, fleet: list[Sim]) -> Iterator[Router]:
    router = start_picker(logs, fleet, "--model-alias", f"{ALIAS}=sim-model")
    yield router
    router.stop()


Gateway = Callable[..., Envoy]
ALIAS = "public-name"
"""A model alias of the picker: the body the worker gets names the served model (rewritten, a new length)."""


@pytest.fixture
def gateway(logs: Path, fleet: list[Sim], picker: Router) -> Iterator[Gateway]:
    """Starts Envoy gateways in front of ``picker`` (``support.envoy.gateway_config`` options); stopped after the
    test."""
    started: list[Envoy] = []

    def start(router: Router | None = None, epp_port: int | None = None, **options: Any) -> Envoy:
        r = router or picker
        port = epp_port if epp_port is not None else r.epp_port
        envoy = start_envoy(logs, epp=(r.host, port), pool=[(s.host, s.port) for s in fleet], **options)
        started.append(envoy)
        return envoy

    yield start
    for envoy in started:
        envoy.stop()


def post(url: str, body: Any, *, headers: dict[str, str] | None = None, timeout: float = 30) -> tuple[int, Any, Any]:
    """POST JSON (or bytes); (status, parsed JSON or text, headers)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method="POST", headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw, status, got = resp.read(), resp.status, resp.headers
    except urllib.error.HTTPError as e:
        raw, status, got = e.read(), e.code, e.headers
    try:
        return status, json.loads(raw), got
    except ValueError:
        return status, raw.decode(errors="replace"), got


def sim_requests(sims: list[Sim]) -> list[float]:
    """Each sim's own count of generation requests (``sglang:num_requests_total``)."""
    out = []
    for s in sims:
        with urllib.request.urlopen(s.url + "/metrics", timeout=5) as resp:
            out.append(metric_value(resp.read().decode(), "sglang:num_requests_total"))
    return out


def wait_metric(router: Router, name: str, value: float, timeout: float = 5.0, **labels: str) -> None:
    deadline = time.monotonic() + timeout
    while (got := metric_value(router.metrics(), name, **labels)) != value:
        assert time.monotonic() < deadline, f"{name}{labels} = {got}, expected {value}"
        time.sleep(0.05)


@contextmanager
def timed(what: str) -> Iterator[None]:
    t0 = time.monotonic()
    yield
    print(f"{what}: {time.monotonic() - t0:.2f} s")
