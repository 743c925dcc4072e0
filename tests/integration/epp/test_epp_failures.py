"""What a gateway sees when the picker refuses or is gone: 413 over the body cap, 429 when shedding, 501 in PD mode,
fail-open passing traffic to the pool, fail-closed answering an error; and the picker stops with the router."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Gateway, post, start_picker, wait_metric
from support.procs import MODEL, Router, Sim, free_port, metric_value


@pytest.fixture(scope="module")
def tight(logs: Path, fleet: list[Sim]) -> Iterator[Router]:
    """A picker with room for one request at a time and bodies up to 100,000 bytes."""
    router = start_picker(logs, fleet[:1], "--max-concurrent-requests", "1", "--max-payload-size", "100000")
    yield router
    router.stop()


def test_body_over_the_routers_cap_is_a_413(gateway: Gateway, tight: Router) -> None:
    envoy = gateway(router=tight)
    large = json.dumps({"model": MODEL, "prompt": "y" * 150_000}).encode()
    status, body, _ = post(envoy.url + "/v1/completions", large)
    assert status == 413, body
    assert body["error"]["code"] == "payload_too_large"
    status, body, _ = post(envoy.url + "/v1/completions", large, headers={"x-test": "1"})
    assert status == 413


def test_over_the_admission_limit_the_picker_sheds_with_a_429(gateway: Gateway, tight: Router) -> None:
    envoy = gateway(router=tight)
    rejected = metric_value(tight.metrics(), "smg_epp_streams_total", outcome="rejected")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hold"}], "max_tokens": 300, "stream": True}
    req = urllib.request.Request(
        envoy.url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:  # holds the one admission slot while it streams
        resp.readline()
        status, answer, headers = post(envoy.url + "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert status == 429, answer
        assert answer["error"]["code"] == "overloaded"
        assert headers["retry-after"] == "1"
        resp.read()
    wait_metric(tight, "smg_epp_streams_total", rejected + 1, outcome="rejected")
    status, _, _ = post(envoy.url + "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert status == 200  # the slot came back when the stream ended


@contextlib.contextmanager
def dying_picker(host: str, seconds: float = 0.3) -> Iterator[int]:
    """A port on ``host`` where a picker takes each connection, reads what Envoy sends for ``seconds`` without an
    answer, then goes (closes it)."""
    listener = socket.create_server((host, 0))
    listener.settimeout(0.05)  # so the loop sees ``stop``
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(0.05)
                until = time.monotonic() + seconds
                while time.monotonic() < until:
                    try:
                        if not conn.recv(65536):
                            break
                    except TimeoutError:
                        pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()


def test_picker_down_fail_open_passes_traffic_and_fail_closed_answers_an_error(
    gateway: Gateway, picker: Router
) -> None:
    closed = free_port()  # nothing listens there: the picker is down
    prompt = {"model": MODEL, "prompt": "open", "max_tokens": 1}
    for mode in ("BUFFERED", "STREAMED"):
        open_ = gateway(epp_port=closed, failure_mode_allow=True, request_body_mode=mode)
        status, body, _ = post(open_.url + "/v1/completions", prompt)
        assert status == 200, (mode, body)  # the gateway's own route without the header: round robin over the pool
        assert open_.stats()["http.gateway.ext_proc.failure_mode_allowed"] == 1
    # full duplex: once Envoy has handed the body to the picker it cannot pass it on, fail-open or not.  A picker
    # that goes while the request is in it shows that; a closed port does not always (a refusal seen before the
    # body was read leaves the body with Envoy, which then fails open).
    with dying_picker(picker.host) as port:
        duplex = gateway(epp_port=port, failure_mode_allow=True, request_body_mode="FULL_DUPLEX_STREAMED")
        status, _, _ = post(duplex.url + "/v1/completions", prompt)
    assert status == 500
    shut = gateway(epp_port=closed, failure_mode_allow=False, request_body_mode="BUFFERED")
    status, body, _ = post(shut.url + "/v1/completions", prompt)
    assert 500 <= status < 600, body


def test_pd_mode_is_answered_501(gateway: Gateway, logs: Path) -> None:
    pd = start_picker(logs, [], "--pd-disaggregation")
    try:
        envoy = gateway(router=pd)
        status, body, _ = post(envoy.url + "/v1/completions", {"model": MODEL, "prompt": "pd", "max_tokens": 1})
        assert status == 501, body
        assert body["error"]["code"] == "not_supported_in_pd_mode"
    finally:
        pd.stop()


def test_the_picker_stops_with_the_router_after_its_streams(gateway: Gateway, logs: Path, fleet: list[Sim]) -> None:
    router = start_picker(logs, fleet[:1], "--shutdown-timeout", "10")
    envoy = gateway(router=router)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "last"}], "max_tokens": 300, "stream": True}
    req = urllib.request.Request(
        envoy.url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    events: list[bytes] = []
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.readline()
        assert router.popen is not None
        router.popen.send_signal(signal.SIGTERM)  # mid-stream: the stream's request is over only at its end
        reader = threading.Thread(target=lambda: events.extend(line.strip() for line in resp if line.strip()))
        reader.start()
        reader.join(20)
    assert events and events[-1] == b"data: [DONE]"
    assert router.popen.wait(timeout=15) == 0
    log = router.log()
    assert "shut down (0 request(s) left)" in log, log[-2000:]
    router.stop()


def test_a_router_whose_picker_port_is_taken_exits_naming_it(logs: Path) -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = [sys.executable, "-m", "smg_router", "--port", str(free_port()), "--epp-port", str(port)]
        done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0
    assert f"--epp-port {port}: cannot listen on 127.0.0.1" in done.stderr
