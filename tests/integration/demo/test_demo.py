"""smg-demo, the README's run command: a serving, cache-aware router in front of a simulated fleet.

A new user sends requests through it, then kills one of its workers to watch the router's fault handling: the
demo must keep serving (the router routes around the lost worker), say so, and bring the worker back on the same
address; only the router's own exit (or a signal to the demo) ends it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.procs import Proc, free_port, http_json, wait_until

MODEL = "smg-sim-model"
WORKER_HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")  # smg-demo --workers 3 puts its workers there


def _port_free_on_all(hosts: tuple[str, ...]) -> int:
    """A port nobody listens on at any of ``hosts`` (the demo gives every worker the same port)."""
    while True:
        port = free_port(hosts[0])
        with contextlib.ExitStack() as stack:
            try:
                for host in hosts:
                    s = stack.enter_context(socket.socket())
                    s.bind((host, port))
            except OSError:
                continue
        return port


def _children(pid: int) -> list[int]:
    """The direct children of ``pid`` (from /proc, every thread's list)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _worker_pid(demo_pid: int, host: str) -> int | None:
    """The pid of the demo's smg-sim child serving on ``host`` (None while there is none)."""
    for child in _children(demo_pid):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            if b"smg_sim" in argv and host.encode() in argv:
                return child
    return None


def _chat(router_url: str, prompt: str) -> tuple[int, object]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4}
    return http_json("POST", router_url + "/v1/chat/completions", body, timeout=30)


def _routable(router_url: str) -> dict[str, bool]:
    status, body = http_json("GET", router_url + "/workers", timeout=2)
    assert status == 200, body
    return {w["url"]: w["routable"] for w in body["workers"]}


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[tuple[Proc, str, int]]:
    """A running ``smg-demo --workers 3`` on free ports: the process, its router URL and the worker port."""
    port, worker_port = free_port(), _port_free_on_all(WORKER_HOSTS)
    proc = Proc(
        name="demo",
        log_path=tmp_path / "demo.log",
        args=[
            sys.executable,
            "-m",
            "smg_sim.demo",
            "--workers",
            str(len(WORKER_HOSTS)),
            "--port",
            str(port),
            "--worker-port",
            str(worker_port),
            "--time-scale",
            "0.05",
        ],
    ).start()
    assert proc.popen is not None
    pgid = proc.popen.pid  # its own session: the demo and every worker it (re)started
    router_url = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: "ready (Ctrl-C to stop)" in proc.log() or not proc.alive(),
            timeout=30,
            what="the demo to be ready",
        )
        assert proc.alive(), proc.log()
        wait_until(lambda: all(_routable(router_url).values()), timeout=15, what="every worker routable")
        yield proc, router_url, worker_port
    finally:
        proc.stop()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)  # whatever outlived the demo


def test_smg_demo_serves_chat_completions_through_a_cache_aware_router(demo: tuple[Proc, str, int]) -> None:
    proc, router_url, worker_port = demo
    for _ in range(3):
        status, answer = _chat(router_url, "Hello!")
        assert status == 200, answer
        assert answer["choices"][0]["message"]["content"]  # type: ignore[index]
    status, workers = http_json("GET", router_url + "/workers")
    assert sorted(w["load"]["processed"] for w in workers["workers"]) == [0, 0, 3]  # one prompt, one worker
    wait_until(lambda: "curl" in proc.log(), what="the demo to print its curl example")  # once it saw the router
    proc.stop()
    assert proc.popen is None
    for host in WORKER_HOSTS:  # SIGTERM stopped the workers too: nothing listens on their port any more
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, worker_port))


def test_demo_keeps_serving_when_a_worker_is_killed(demo: tuple[Proc, str, int]) -> None:
    proc, router_url, worker_port = demo
    assert proc.popen is not None
    victim_host = WORKER_HOSTS[1]
    victim_url = f"http://{victim_host}:{worker_port}"
    victim = _worker_pid(proc.popen.pid, victim_host)
    assert victim is not None, proc.log()

    os.kill(victim, signal.SIGKILL)
    for i in range(12):  # right after the kill, while the router may still pick the victim
        status, answer = _chat(router_url, f"request {i} after the kill")
        assert status == 200, answer

    wait_until(
        lambda: f"worker {victim_url} exited" in proc.log(), timeout=10, what="the demo to report the lost worker"
    )
    assert "the router routes around it" in proc.log()
    wait_until(lambda: http_json("GET", victim_url + "/health", timeout=1)[0] == 200, timeout=30, what="the restart")
    restarted = _worker_pid(proc.popen.pid, victim_host)
    assert restarted is not None and restarted != victim
    wait_until(lambda: _routable(router_url).get(victim_url), timeout=30, what="the router to route to it again")
    status, answer = _chat(router_url, "after the restart")
    assert status == 200, answer
    assert proc.alive(), proc.log()
    assert "smg-demo: stopped" not in proc.log()


def test_demo_stops_when_its_router_exits(demo: tuple[Proc, str, int]) -> None:
    proc, _, worker_port = demo
    assert proc.popen is not None
    router = next(
        c for c in _children(proc.popen.pid) if b"smg_router" in Path(f"/proc/{c}/cmdline").read_bytes().split(b"\0")
    )
    os.kill(router, signal.SIGKILL)
    assert proc.popen.wait(timeout=15) == 1
    assert "smg-demo: stopped" in proc.log()
    for host in WORKER_HOSTS:  # the workers were stopped with it: their port is free again
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, worker_port))
