"""Admission: bounded requests and body bytes in flight (503 with Retry-After), 413 above the body limit.

Whatever clients send, the router's memory stays bounded; every refusal is counted by reason.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import aiohttp
from support.procs import MODEL, Router, metric_value, start_router, start_sim, wait_until


def _inflight(router: Router) -> int:
    return sum(w["load"]["inflight"] for w in router.workers())


async def _post(s: aiohttp.ClientSession, url: str, *, prompt: str, max_tokens: int) -> tuple[int, Any, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    async with s.post(url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.json(content_type=None), resp.headers.get("Retry-After")


async def test_over_the_concurrency_limit_is_503_with_retry_after_and_counted(logs: Path) -> None:
    sim = start_sim(logs, time_scale=1.0)
    r = start_router(logs, workers=[sim.url], args=["--max-concurrent-requests", "4"])
    try:
        await asyncio.to_thread(r.wait_routable, 1)
        async with aiohttp.ClientSession() as s:
            slow = [asyncio.ensure_future(_post(s, r.url, prompt=f"{uuid.uuid4()}", max_tokens=120)) for _ in range(4)]
            await asyncio.to_thread(wait_until, lambda: _inflight(r) == 4, what="4 requests in flight")
            status, body, retry_after = await _post(s, r.url, prompt="one too many", max_tokens=1)
            assert status == 503 and body["error"]["code"] == "overloaded", body
            assert body["error"]["type"] == "service_unavailable" and retry_after == "1"
            assert [res[0] for res in await asyncio.gather(*slow)] == [200] * 4
            assert (await _post(s, r.url, prompt="room again", max_tokens=1))[0] == 200
        text = await asyncio.to_thread(r.metrics)
        assert metric_value(text, "smg_requests_rejected_total", reason="concurrency") == 1
    finally:
        r.stop()
        sim.stop()


async def test_body_bytes_in_flight_are_bounded_and_oversized_bodies_are_413(logs: Path) -> None:
    sim = start_sim(logs, time_scale=1.0)
    r = start_router(logs, workers=[sim.url], args=["--max-payload-size", "10000", "--max-inflight-bytes", "20000"])
    try:
        await asyncio.to_thread(r.wait_routable, 1)
        async with aiohttp.ClientSession() as s:
            big = [
                asyncio.ensure_future(_post(s, r.url, prompt=f"{uuid.uuid4()}" + "x" * 9000, max_tokens=120))
                for _ in range(2)
            ]
            await asyncio.to_thread(wait_until, lambda: _inflight(r) == 2, what="2 large requests in flight")
            status, body, retry_after = await _post(s, r.url, prompt="y" * 9000, max_tokens=1)
            assert status == 503 and body["error"]["code"] == "overloaded" and retry_after == "1", body
            assert (await _post(s, r.url, prompt="small fits", max_tokens=1))[0] == 200
            status, body, _ = await _post(s, r.url, prompt="z" * 12000, max_tokens=1)
            assert status == 413 and body["error"]["code"] == "payload_too_large", body
            assert [res[0] for res in await asyncio.gather(*big)] == [200, 200]
        text = await asyncio.to_thread(r.metrics)
        assert metric_value(text, "smg_requests_rejected_total", reason="inflight_bytes") == 1
        assert metric_value(text, "smg_requests_rejected_total", reason="payload_too_large") == 1
    finally:
        r.stop()
        sim.stop()


async def test_a_body_that_stalls_is_408_and_gives_its_admission_slot_back(logs: Path) -> None:
    """A client that stops sending its body (gone without a FIN, or a slowloris) holds no admission slot past
    --body-timeout: the answer is a 408 JSON error, the connection closes, the refusal is counted."""
    sim = start_sim(logs, time_scale=1.0)
    r = start_router(logs, workers=[sim.url], args=["--max-concurrent-requests", "1", "--body-timeout", "1"])
    try:
        await asyncio.to_thread(r.wait_routable, 1)
        host, port = r.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n".encode()
            + b'{"model": '
        )
        await writer.drain()
        async with aiohttp.ClientSession() as s:
            status, body, _ = await _post(s, r.url, prompt="while the slot is held", max_tokens=1)
            assert status == 503 and body["error"]["code"] == "overloaded", body
            answer = await asyncio.wait_for(reader.read(), 10)  # the whole answer, then the router's close
            head, _, payload = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408 "), answer
            error = json.loads(payload)["error"]
            assert error["code"] == "request_body_timeout" and "1" in error["message"], error
            status, body, _ = await _post(s, r.url, prompt="the slot is free again", max_tokens=1)
            assert status == 200, body
        writer.close()
        text = await asyncio.to_thread(r.metrics)
        assert metric_value(text, "smg_requests_rejected_total", reason="body_timeout") == 1
    finally:
        r.stop()
        sim.stop()
