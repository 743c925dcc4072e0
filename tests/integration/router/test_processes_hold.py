"""``--processes 2`` with ``--hold-when-empty``: a model declared on the admin port is declared in every process,
the requests each process holds add up in the pod's ``/metrics``, and a worker registered once releases them all."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from support.procs import Sim, free_port, http_json, metric_value, start_router, start_sim, wait_until

KEY = "processes-hold-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "org/cold-model"
HELD = 12
"""Over fresh connections: all on one process by chance is 2 in 4,096."""


async def _on_child(pod: Path, index: int, target: str) -> Any:
    """GET ``target`` from one process alone, on its private socket."""
    connector = aiohttp.UnixConnector(path=str(pod / f"child-{index}.sock"))
    async with aiohttp.ClientSession(connector=connector) as session, session.get("http://child" + target) as resp:
        raw = await resp.read()
        return orjson.loads(raw) if resp.content_type == "application/json" else raw.decode()


async def test_a_declaration_reaches_every_process_and_their_held_requests_add_up(logs: Path) -> None:
    pod = logs / "pod-hold"
    admin_port = free_port()
    router = start_router(
        logs,
        admin_key=KEY,
        args=[
            *("--processes", "2", "--processes-dir", str(pod)),
            *("--admin-port", str(admin_port), "--hold-when-empty", "30"),
        ],
    )
    admin = f"http://{router.host}:{admin_port}"
    sim: Sim | None = None
    try:
        wait_until(lambda: http_json("GET", admin + "/workers", timeout=1)[0] == 200, what="the parent's admin port")
        status, body = http_json("PUT", f"{admin}/models/{MODEL}", headers=AUTH)
        assert status == 201, body
        for i in range(2):  # applied by each process before the answer
            listing = await _on_child(pod, i, "/workers")
            assert [m["model"] for m in listing["declared_models"]] == [MODEL], (i, listing)

        answers: list[int] = []

        def call() -> None:  # urllib: a fresh connection each, spread over both processes by SO_REUSEPORT
            status, _ = http_json(
                "POST", router.url + "/v1/completions", {"model": MODEL, "prompt": "cold", "max_tokens": 1}, timeout=40
            )
            answers.append(status)

        threads = [threading.Thread(target=call, daemon=True) for _ in range(HELD)]
        for t in threads:
            t.start()
        waiting = {"model": MODEL, "role": "regular"}
        wait_until(
            lambda: metric_value(router.metrics(), "smg_model_requests_waiting", **waiting) == HELD,
            what="every request held, summed over the processes",
        )
        own = [
            metric_value(await _on_child(pod, i, "/metrics"), "smg_model_requests_waiting", **waiting) for i in range(2)
        ]
        assert sum(own) == HELD and all(n > 0 for n in own), own  # each process held some

        sim = start_sim(logs, model=MODEL)
        status, body = http_json("POST", admin + "/workers", {"url": sim.url, "model_id": MODEL}, headers=AUTH)
        assert status == 201, body
        deadline = time.monotonic() + 30
        for t in threads:
            t.join(max(0.1, deadline - time.monotonic()))
        assert answers == [200] * HELD, answers
        assert metric_value(router.metrics(), "smg_model_requests_waiting", **waiting) == 0
        assert metric_value(router.metrics(), "smg_model_holds_total", model=MODEL, outcome="sent") == HELD

        status, body = http_json("DELETE", f"{admin}/models/{MODEL}", headers=AUTH)
        assert status == 200 and body["declarations"] == [], body
        for i in range(2):
            assert (await _on_child(pod, i, "/workers"))["declared_models"] == [], i
    finally:
        router.stop()
        if sim is not None:
            sim.stop()
