"""``--processes 2``: two serving processes on the one port, one parent; real processes on loopback.

Which process served what is read from each child's private socket (``--processes-dir``: ``child-N.sock``), the
socket the parent itself uses: its ``GET /workers`` counts what that process sent each worker (``processed``), its
``/metrics`` is that process's alone.  Every request here goes over a fresh connection, so the kernel's SO_REUSEPORT
hash spreads them over both processes.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from support.procs import (
    MODEL,
    Router,
    Sim,
    free_port,
    http_json,
    metric_value,
    start_router,
    start_sim,
    wait_until,
)

KEY = "processes-admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
REQUESTS = 40


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def on_child(pod: Path, index: int, method: str, target: str, timeout: float = 10.0) -> tuple[int, Any]:
    """A request to one process alone, on its private socket."""
    conn = _UnixConnection(str(pod / f"child-{index}.sock"), timeout)
    try:
        conn.request(method, target)
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, (
            json.loads(raw) if resp.getheader("Content-Type", "").startswith("application/json") else raw.decode()
        )
    finally:
        conn.close()


def child_workers(pod: Path, index: int) -> dict[str, dict[str, Any]]:
    status, body = on_child(pod, index, "GET", "/workers")
    assert status == 200, body
    return {w["url"]: w for w in body["workers"]}


def alive(pid: int) -> bool:
    """The process runs (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def children_of(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def start_pod(
    logs: Path, name: str, *, workers: list[str] = (), admin_port: int | None = None, args: list[str] | None = None
) -> tuple[Router, Path]:
    pod = logs / name
    flags = ["--processes", "2", "--processes-dir", str(pod), *(args or [])]
    if admin_port:
        flags += ["--admin-port", str(admin_port)]
    router = start_router(logs, workers=list(workers), admin_key=KEY, args=flags)
    wait_until(lambda: all((pod / f"child-{i}.sock").exists() for i in range(2)), what="both processes' sockets")
    if admin_port:
        admin = f"http://{router.host}:{admin_port}"
        wait_until(lambda: http_json("GET", admin + "/workers", timeout=1)[0] == 200, what="the parent's admin port")
    wait_until(lambda: "with 2 processes" in router.log(), what="the parent serving (both processes started)")
    assert router.popen is not None and len(children_of(router.popen.pid)) == 2, router.log()
    return router, pod


def _complete_fresh(url: str, prompt: str) -> tuple[int, Any]:
    """One completion over a connection of its own (urllib: a new one per request)."""
    return http_json("POST", url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})


@pytest.fixture(scope="module")
def sim(logs: Path) -> Any:
    s = start_sim(logs)
    yield s
    s.stop()


def test_a_worker_registered_on_the_admin_port_is_routed_to_by_every_process_then_removed_from_each(
    logs: Path, sim: Sim
) -> None:
    admin_port = free_port()
    router, pod = start_pod(logs, "pod-admin", admin_port=admin_port)
    admin = f"http://{router.host}:{admin_port}"
    try:
        status, worker = http_json("POST", admin + "/workers", {"url": sim.url}, headers=AUTH)
        assert status == 201, worker
        for i in range(2):  # applied by each before the answer: each process knows it at once
            assert sim.url in child_workers(pod, i), (i, router.log())
        wait_until(
            lambda: all(child_workers(pod, i)[sim.url]["routable"] for i in range(2)), what="routable everywhere"
        )
        status, listed = http_json("GET", router.url + "/workers")  # a read on the data port: the pod's answer
        assert status == 200 and [w["id"] for w in listed["workers"]] == [worker["id"]], listed

        answers = [_complete_fresh(router.url, f"{uuid.uuid4()} hello") for _ in range(REQUESTS)]
        assert all(status == 200 for status, _ in answers), answers
        processed = [child_workers(pod, i)[sim.url]["load"]["processed"] for i in range(2)]
        assert sum(processed) == REQUESTS
        assert all(n > 0 for n in processed), f"one process served no request: {processed}"  # each routed to it

        own = [on_child(pod, i, "GET", "/metrics")[1] for i in range(2)]  # each process's own count
        counted = [metric_value(text, "smg_requests_total", endpoint="/v1/completions", status="200") for text in own]
        assert counted == processed, (counted, processed)
        for _ in range(6):  # the pod's /metrics, whichever process the connection reached: the sum
            text = router.metrics()
            assert metric_value(text, "smg_requests_total", endpoint="/v1/completions", status="200") == REQUESTS
            assert metric_value(text, "smg_worker_lifecycle_events_total", event="added") == 1  # one change
            assert text.count("# TYPE smg_requests_total counter") == 1

        status, removed = http_json("DELETE", admin + f"/workers/{worker['id']}", headers=AUTH)
        assert status == 200 and removed["drained"] is True, removed
        for i in range(2):
            assert child_workers(pod, i) == {}, i
        answers = [_complete_fresh(router.url, f"{uuid.uuid4()} gone") for _ in range(10)]
        assert all(status == 503 for status, _ in answers), answers
        status, again = http_json("DELETE", admin + f"/workers/{worker['id']}", headers=AUTH)
        assert status == 404 and again["error"]["code"] == "worker_not_found", again  # refused alike by both
    finally:
        router.stop()
    assert router.popen is None


def test_without_an_admin_port_a_change_sent_to_the_data_port_reaches_every_process(logs: Path, sim: Sim) -> None:
    router, pod = start_pod(logs, "pod-data")
    try:
        status, bad = http_json("POST", router.url + "/workers", {"url": sim.url, "priority": "high"}, headers=AUTH)
        assert status == 400 and "priority" in bad["error"]["message"], bad
        assert child_workers(pod, 0) == child_workers(pod, 1) == {}
        status, denied = http_json("POST", router.url + "/workers", {"url": sim.url})
        assert status == 401, denied
        for attempt in range(6):  # over fresh connections: each process hands it to the parent
            status, worker = http_json("POST", router.url + "/workers", {"url": sim.url}, headers=AUTH)
            assert status == (201 if attempt == 0 else 200), worker
        status, patched = http_json(
            "PATCH", router.url + f"/workers/{worker['id']}", {"labels": {"zone": "b"}}, headers=AUTH
        )
        assert status == 200, patched
        for i in range(2):
            assert child_workers(pod, i)[sim.url]["labels"] == {"zone": "b"}, i
    finally:
        router.stop()


async def _stream(url: str) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": f"{uuid.uuid4()} a story", "max_tokens": 60, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as resp:  # its own connection
        raw = await resp.read()
    events = [line[len("data: ") :] for line in raw.decode().splitlines() if line.startswith("data: ")]
    return {"status": resp.status, "events": events}


def _inflight(pod: Path, index: int) -> int:
    return sum(w["load"]["inflight"] for w in child_workers(pod, index).values())


async def test_sigterm_drains_every_process_then_the_parent_exits_0(logs: Path) -> None:
    sims = [start_sim(logs, time_scale=1.0) for _ in range(2)]  # ~15 ms a token: a 60-token stream takes ~1 s
    router, pod = start_pod(
        logs, "pod-drain", workers=[s.url for s in sims], args=["--shutdown-delay", "1", "--shutdown-timeout", "20"]
    )
    try:
        wait_until(lambda: all(_inflight(pod, i) == 0 and len(child_workers(pod, i)) == 2 for i in range(2)))
        wait_until(
            lambda: all(all(w["routable"] for w in child_workers(pod, i).values()) for i in range(2)),
            what="routable in both processes",
        )
        jobs: list[asyncio.Future[dict[str, Any]]] = []
        deadline = time.monotonic() + 20
        while not all(_inflight(pod, i) > 0 for i in range(2)):  # a stream in flight through each process
            assert time.monotonic() < deadline, [_inflight(pod, i) for i in range(2)]
            jobs.append(asyncio.ensure_future(_stream(router.url)))
            await asyncio.sleep(0.1)
        assert router.popen is not None
        pids = children_of(router.popen.pid)
        router.popen.send_signal(signal.SIGTERM)
        body = await asyncio.to_thread(
            wait_until,
            lambda: (a := http_json("GET", router.url + "/readiness"))[0] == 503 and a[1],
            what="/readiness 503",
        )
        assert body["status"] == "shutting_down", body
        for i in range(2):  # each process drains on its own: not ready, its streams still running
            assert on_child(pod, i, "GET", "/readiness")[0] == 503
        results = await asyncio.gather(*jobs)
        for res in results:
            assert res["status"] == 200, res
            assert res["events"][-1] == "[DONE]" and not any('"error"' in e for e in res["events"]), res
        code = await asyncio.to_thread(router.popen.wait, 40)
        assert code == 0, router.log()
        assert not any(alive(pid) for pid in pids)
        log = router.log()
        for i in range(2):
            assert f"[process {i}]: shut down (0 request(s) left)" in log, log
    finally:
        router.stop()
        for s in sims:
            s.stop()


def test_a_process_that_dies_stops_the_pod_with_status_1(logs: Path) -> None:
    router, _ = start_pod(logs, "pod-crash", args=["--shutdown-delay", "0"])
    try:
        assert router.popen is not None
        first, second = children_of(router.popen.pid)
        os.kill(first, signal.SIGKILL)
        code = router.popen.wait(30)
        assert code == 1, router.log()
        assert not alive(second)
        assert "exited with status -9: stopping the others" in router.log()
    finally:
        router.stop()


def test_one_process_is_the_router_alone_with_no_child(logs: Path, sim: Sim) -> None:
    router = start_router(logs, workers=[sim.url], args=["--processes", "1"])
    try:
        router.wait_routable(1)
        assert router.popen is not None and children_of(router.popen.pid) == []
        assert router.complete("one process").status == 200
    finally:
        router.stop()
