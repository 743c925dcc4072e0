"""SIGTERM: not ready at once, keep serving through --shutdown-delay, let in-flight work finish, exit 0.

Kubernetes sends SIGTERM when a router pod is terminated (rollout, scale-in, node drain) and removes the pod from
the Service endpoints at about the same time; clients that had requests in flight must not lose them.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
from support.procs import MODEL, Router, http_json, start_router, start_sim, wait_until


async def _complete(s: aiohttp.ClientSession, url: str, *, stream: bool, max_tokens: int) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": f"{uuid.uuid4()} a story", "max_tokens": max_tokens, "stream": stream}
    async with s.post(url + "/v1/completions", json=body) as resp:
        raw = await resp.read()
    if not stream:
        return {"status": resp.status, "body": json.loads(raw)}
    events = [line[len("data: ") :] for line in raw.decode().splitlines() if line.startswith("data: ")]
    return {"status": resp.status, "events": events}


def _not_ready(router: Router) -> dict[str, Any] | None:
    status, body = http_json("GET", router.url + "/readiness")
    return body if status == 503 else None


def _inflight(router: Router) -> int:
    return sum(w["load"]["inflight"] for w in router.workers())


async def test_requests_in_flight_across_sigterm_finish_and_the_router_exits_0(logs: Path) -> None:
    sims = [start_sim(logs, time_scale=1.0) for _ in range(2)]
    r = start_router(logs, workers=[s.url for s in sims], args=["--shutdown-delay", "1", "--shutdown-timeout", "20"])
    try:
        r.wait_routable(2)
        async with aiohttp.ClientSession() as s:
            jobs = [asyncio.ensure_future(_complete(s, r.url, stream=i % 2 == 0, max_tokens=120)) for i in range(30)]
            await asyncio.to_thread(wait_until, lambda: _inflight(r) == 30, what="30 requests in flight")
            assert r.popen is not None
            r.popen.send_signal(signal.SIGTERM)
            # polled: the signal reaches the router's loop a moment after send_signal returns (a GET answered in
            # between said ready once, in a CI-like run)
            body = await asyncio.to_thread(wait_until, lambda: _not_ready(r), what="/readiness 503")
            assert body["status"] == "shutting_down", body
            # still serving during the delay: the endpoints controller may not have removed the pod yet
            late = await _complete(s, r.url, stream=False, max_tokens=2)
            assert late["status"] == 200, late
            results = await asyncio.gather(*jobs)
        for i, res in enumerate(results):
            assert res["status"] == 200, res
            if i % 2 == 0:
                assert res["events"][-1] == "[DONE]" and not any('"error"' in e for e in res["events"]), res
            else:
                assert res["body"]["choices"][0]["finish_reason"] == "length", res
        code = await asyncio.to_thread(r.popen.wait, 30)
        assert code == 0, r.log()
    finally:
        r.stop()
        for sim in sims:
            sim.stop()


async def test_a_stream_outlasting_the_shutdown_timeout_ends_with_an_error_event(logs: Path) -> None:
    sim = start_sim(logs, time_scale=1.0)
    r = start_router(logs, workers=[sim.url], args=["--shutdown-delay", "0", "--shutdown-timeout", "1"])
    try:
        r.wait_routable(1)
        async with aiohttp.ClientSession() as s:
            job = asyncio.ensure_future(_complete(s, r.url, stream=True, max_tokens=5000))  # ~75 s of decoding
            await asyncio.to_thread(wait_until, lambda: _inflight(r) == 1, what="the stream in flight")
            assert r.popen is not None
            t0 = time.monotonic()
            r.popen.send_signal(signal.SIGTERM)
            res = await job
        assert res["status"] == 200
        assert res["events"][-1] == "[DONE]", res["events"][-3:]
        error = json.loads(res["events"][-2])["error"]
        assert error["code"] == "router_shutting_down" and error["type"] and error["message"], error
        code = await asyncio.to_thread(r.popen.wait, 30)
        assert code == 0, r.log()
        assert time.monotonic() - t0 < 20  # ended by the 1 s shutdown timeout, not by the worker finishing
        await asyncio.to_thread(
            wait_until,
            lambda: http_json("GET", sim.url + "/v1/loads")[1]["loads"][0]["num_running_reqs"] == 0,
            what="the worker to drop the cut-off stream",
        )
    finally:
        r.stop()
        sim.stop()


async def test_after_sigterm_every_answer_closes_its_connection_so_clients_retire_pooled_ones(logs: Path) -> None:
    sim = start_sim(logs)
    r = start_router(logs, workers=[sim.url], args=["--shutdown-delay", "3", "--shutdown-timeout", "5"])
    try:
        r.wait_routable(1)
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        async with aiohttp.ClientSession() as s:
            async with s.post(r.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200 and resp.headers.get("Connection", "").lower() != "close"
            assert r.popen is not None
            r.popen.send_signal(signal.SIGTERM)
            await asyncio.to_thread(
                wait_until, lambda: http_json("GET", r.url + "/readiness")[0] == 503, what="not ready"
            )
            for method, path, payload in (("POST", "/v1/completions", body), ("GET", "/v1/models", None)):
                async with s.request(method, r.url + path, json=payload) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers.get("Connection", "").lower() == "close", (path, dict(resp.headers))
        assert await asyncio.to_thread(r.popen.wait, 30) == 0, r.log()
    finally:
        r.stop()
        sim.stop()
