"""The README's run command: smg-demo gives a new user a serving, cache-aware router in front of a fleet."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from support.procs import Proc, free_port, http_json, wait_until


def test_smg_demo_serves_chat_completions_through_the_router(tmp_path: Path) -> None:
    port, worker_port = free_port(), free_port("127.0.0.2")
    demo = Proc(
        name="demo",
        log_path=tmp_path / "demo.log",
        args=[
            sys.executable,
            "-m",
            "smg_sim.demo",
            "--workers",
            "2",
            "--port",
            str(port),
            "--worker-port",
            str(worker_port),
            "--time-scale",
            "0.05",
        ],
    ).start()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(
            lambda: http_json("GET", url + "/readiness", timeout=1)[0] == 200 or not demo.alive(),
            timeout=30,
            what="the demo router to be ready",
        )
        assert demo.alive(), demo.log()
        body = {"model": "smg-sim-model", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}
        for _ in range(3):
            status, answer = http_json("POST", url + "/v1/chat/completions", body)
            assert status == 200, answer
            assert answer["choices"][0]["message"]["content"]
        status, workers = http_json("GET", url + "/workers")
        assert sorted(w["load"]["processed"] for w in workers["workers"]) == [0, 3]  # cache-aware
        wait_until(lambda: "curl" in demo.log(), what="the demo to print its curl example")  # once it saw the router
    finally:
        demo.stop()
    assert demo.popen is None
    # SIGTERM stopped the workers too: nothing listens on their port any more
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.2", worker_port))
