"""A worker's update (PATCH, PUT) racing its removal (DELETE) against a real router and real smg-sim workers.

Whatever the order, a removed worker leaves nothing behind: not in ``/workers``, no metric series naming its URL,
and registered again it has one set of series.  The defined outcome: an update applied before the removal began
is kept until the removal drops the worker (200); one that comes while the worker drains for its removal is refused
(409 ``worker_being_removed``); one that comes after is a 404; the DELETE itself is always a 200.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from pathlib import Path
from typing import Any

from support.procs import MODEL, Router, Sim, http_json, start_router, start_sim, wait_until


def _series(text: str, url: str) -> list[str]:
    """The metric samples naming ``url``."""
    return [line for line in text.splitlines() if not line.startswith("#") and f'"{url}"' in line]


def _register(r: Router, url: str) -> str:
    status, worker = r.admin("POST", "/workers", {"url": url, "model_id": MODEL})
    assert status == 201, worker
    return str(worker["id"])


def _assert_gone(r: Router, url: str) -> None:
    assert url not in [w["url"] for w in r.workers()]
    assert _series(r.metrics(), url) == []


def _race(
    r: Router, worker_id: str, patch: dict[str, Any], delays: tuple[float, float], patch_first: bool
) -> dict[str, tuple[int, Any]]:
    """PATCH ``patch`` and DELETE the worker from two threads, each after its delay; their (status, answer)s."""
    results: dict[str, tuple[int, Any]] = {}

    def call(name: str, method: str, body: Any, delay: float) -> None:
        time.sleep(delay)
        results[name] = r.admin(method, f"/workers/{worker_id}", body)

    threads = [
        threading.Thread(target=call, args=("patch", "PATCH", patch, delays[0])),
        threading.Thread(target=call, args=("delete", "DELETE", None, delays[1])),
    ]
    for t in threads if patch_first else reversed(threads):
        t.start()
    for t in threads:
        t.join(15)
    return results


def test_concurrent_update_and_removal_leave_no_worker_and_no_series_behind(logs: Path, fleet: list[Sim]) -> None:
    url = fleet[0].url
    r = start_router(logs, args=["--load-monitor-interval", "0.05"])
    rng = random.Random(7)
    patches = [
        {"labels": {"tier": "gold"}},
        {"priority": 9},
        {"kv_capacity_tokens": 4096},
        {"draining": False},
        {"draining": True, "labels": {"x": "y"}},
    ]
    delays = [(0.0, 0.0), (0.0, 0.002), (0.002, 0.0), (0.0, 0.01), (0.01, 0.0)]
    outcomes: dict[int, int] = {}
    try:
        for i in range(24):
            worker_id = _register(r, url)
            time.sleep(0.06)  # a load poll or two: series to forget
            results = _race(r, worker_id, patches[i % len(patches)], rng.choice(delays), patch_first=i % 2 == 0)
            assert results["delete"][0] == 200, results
            assert results["patch"][0] in (200, 404, 409), results
            outcomes[results["patch"][0]] = outcomes.get(results["patch"][0], 0) + 1
            time.sleep(0.1)  # load polls that were in flight have ended
            _assert_gone(r, url)
        worker_id = _register(r, url)  # the same URL again: one set of series
        wait_until(lambda: "smg_worker_backend_load{" in r.metrics(), what="a load poll of the worker")
        names = [line.partition("{")[0] for line in _series(r.metrics(), url)]
        for name in ("smg_worker_healthy", "smg_worker_inflight", "smg_worker_backend_load"):
            assert names.count(name) == 1, (name, names)
        assert r.admin("DELETE", f"/workers/{worker_id}")[0] == 200
        _assert_gone(r, url)
    finally:
        r.stop()
    print("PATCH outcomes by status:", outcomes)


def _send_head(r: Router, method: str, path: str, body: bytes) -> socket.socket:
    """A request whose head is sent now and whose body is not (``_finish`` sends it)."""
    host, port = r.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
    )
    return sock


def _finish(sock: socket.socket, body: bytes) -> tuple[int, Any]:
    with sock:
        sock.sendall(body)
        sock.settimeout(10)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, payload = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


def test_an_update_whose_body_arrives_after_the_removal_is_404_and_revives_nothing(
    logs: Path, fleet: list[Sim]
) -> None:
    """The update's handler found the worker, then waited for its body while the DELETE went through: it must not
    apply to the removed worker (that republished its health and in-flight series under its URL)."""
    url = fleet[1].url
    r = start_router(logs)
    try:
        for method, body in (("PATCH", b'{"labels": {"tier": "gold"}}'), ("PUT", b'{"url": "%s"}' % url.encode())):
            worker_id = _register(r, url)
            sock = _send_head(r, method, f"/workers/{worker_id}", body)
            time.sleep(0.2)  # the handler found the worker and waits for the body
            assert r.admin("DELETE", f"/workers/{worker_id}")[0] == 200
            status, answer = _finish(sock, body)
            _assert_gone(r, url)  # applied to the removed worker, the update published its series again
            assert status == 404 and answer["error"]["code"] == "worker_not_found", answer
    finally:
        r.stop()


def test_an_update_while_the_worker_drains_for_its_removal_is_409_and_the_removal_completes(logs: Path) -> None:
    """``draining: false`` during the DELETE's drain would make the worker routable again as it is being removed."""
    sim = start_sim(logs, time_scale=1.0, extra=["--decode-step-ms", "20"])
    r = start_router(logs, workers=[sim.url])
    try:
        r.wait_routable(1)
        worker_id = r.workers()[0]["id"]
        done: dict[str, Any] = {}

        def long_request() -> None:
            done["request"] = http_json(
                "POST", r.url + "/v1/completions", {"model": MODEL, "prompt": "hold", "max_tokens": 60}, timeout=30
            )

        def delete() -> None:
            done["delete"] = r.admin("DELETE", f"/workers/{worker_id}?timeout=20", timeout=30)

        threads = [threading.Thread(target=long_request), threading.Thread(target=delete)]
        threads[0].start()
        wait_until(lambda: r.workers()[0]["load"]["inflight"] == 1, what="the long request in flight")
        threads[1].start()
        wait_until(lambda: r.workers()[0]["status"] == "draining", what="the worker draining for its removal")
        status, answer = r.admin("PATCH", f"/workers/{worker_id}", {"draining": False})
        assert status == 409 and answer["error"]["code"] == "worker_being_removed", answer
        status, answer = r.admin("PUT", f"/workers/{worker_id}", {"url": sim.url, "labels": {"a": "b"}})
        assert status == 409 and answer["error"]["code"] == "worker_being_removed", answer
        assert r.workers()[0]["status"] == "draining" and r.workers()[0]["labels"] == {}
        for t in threads:
            t.join(30)
        assert done["request"][0] == 200 and done["delete"][0] == 200, done
        assert done["delete"][1]["drained"] is True, done
        _assert_gone(r, sim.url)
    finally:
        r.stop()
        sim.stop()
