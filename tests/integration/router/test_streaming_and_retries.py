"""Streaming pass-through, client disconnects, retries before the first byte, and the circuit breaker."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import aiohttp
from support.procs import MODEL, http_json, metric_value, start_router, start_sim, wait_until


async def test_client_disconnect_cancels_the_upstream_request(logs: Path) -> None:
    sim = start_sim(logs, time_scale=1.0)
    r = start_router(logs, workers=[sim.url])
    try:
        r.wait_routable(1)
        body = {"model": MODEL, "prompt": f"{uuid.uuid4()} tell a long story", "max_tokens": 3000, "stream": True}
        async with aiohttp.ClientSession() as s:
            resp = await s.post(r.url + "/v1/completions", json=body)
            assert resp.status == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            chunks = 0
            async for _ in resp.content.iter_any():
                chunks += 1
                if chunks >= 3:
                    break
            assert http_json("GET", sim.url + "/v1/loads")[1]["loads"][0]["num_running_reqs"] == 1
            resp.close()  # the client goes away mid-stream
        await asyncio.to_thread(
            wait_until,
            lambda: http_json("GET", sim.url + "/v1/loads")[1]["loads"][0]["num_running_reqs"] == 0,
            what="the worker to drop the abandoned request",
        )
        assert r.workers()[0]["load"]["inflight"] == 0
    finally:
        r.stop()
        sim.stop()


def test_failed_attempts_are_retried_on_another_worker_and_open_the_breaker(logs: Path) -> None:
    good = start_sim(logs)
    bad = start_sim(logs, extra=["--error-rate", "1.0"])
    r = start_router(
        logs,
        workers=[good.url, bad.url],
        args=["--policy", "round_robin", "--breaker-failure-threshold", "3", "--breaker-cooldown", "60"],
    )
    try:
        r.wait_routable(2)
        for i in range(8):
            status, body = http_json(
                "POST", r.url + "/v1/completions", {"model": MODEL, "prompt": f"p{i}", "max_tokens": 1}
            )
            assert status == 200, body
        text = r.metrics()
        assert metric_value(text, "smg_retries_total", endpoint="/v1/completions", outcome="retried") == 3
        bad_worker = next(w for w in r.workers() if w["url"] == bad.url)
        assert bad_worker["breaker"] == "open" and bad_worker["routable"] is False
        assert metric_value(text, "smg_worker_healthy", worker=bad.url) == 1  # healthy, but its breaker is open
    finally:
        r.stop()
        good.stop()
        bad.stop()


def test_a_dead_worker_is_retried_elsewhere_then_marked_not_ready(logs: Path) -> None:
    sims = [start_sim(logs) for _ in range(2)]
    r = start_router(logs, workers=[s.url for s in sims], args=["--policy", "round_robin"])
    try:
        r.wait_routable(2)
        sims[0].kill()
        for i in range(4):
            status, body = http_json(
                "POST", r.url + "/v1/completions", {"model": MODEL, "prompt": f"dead {i}", "max_tokens": 1}
            )
            assert status == 200, body
        wait_until(
            lambda: next(w for w in r.workers() if w["url"] == sims[0].url)["status"] == "not_ready",
            what="health checks to mark the dead worker not_ready",
        )
        assert metric_value(r.metrics(), "smg_worker_healthy", worker=sims[0].url) == 0
        sims[1].kill()
        status, body = http_json("POST", r.url + "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert status in (502, 503) and body["error"]["message"], body
        assert all(s.url.removeprefix("http://") not in body["error"]["message"] for s in sims), body
    finally:
        r.stop()
        for s in sims:
            s.stop()
