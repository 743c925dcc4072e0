"""What a failing fleet costs: a retry budget bounds the attempts, and a request already written to a worker that
timed out is not run a second time (unless the client says it is idempotent).  Attempts are counted at the sims
(``smg_sim_generation_requests_total``), not by the router's own account."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
from support.procs import MODEL, Sim, http_json, http_json_headers, metric_value, start_router, start_sim

ENDPOINT = "/v1/chat/completions"


def received(sims: list[Sim]) -> float:
    """Generation requests the sims received, those their faults answered included."""
    return sum(metric_value(http_json("GET", s.url + "/metrics")[1], "smg_sim_generation_requests_total") for s in sims)


async def test_a_fleet_answering_429_sees_at_most_a_fifth_more_attempts_than_requests(logs: Path) -> None:
    sims = [start_sim(logs, extra=["--error-rate", "1", "--error-status", "429"]) for _ in range(2)]
    r = start_router(logs, workers=[s.url for s in sims], args=["--retry-budget-min", "3"])
    try:
        r.wait_routable(2)
        statuses: list[int] = []
        async with aiohttp.ClientSession() as s:

            async def one(i: int) -> None:
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 1}
                async with s.post(r.url + ENDPOINT, json=body) as resp:
                    await resp.read()
                    statuses.append(resp.status)

            for wave in range(5):  # 100 requests, 20 at a time
                await asyncio.gather(*(one(wave * 20 + i) for i in range(20)))
        assert statuses == [429] * 100
        attempts = received(sims)
        text = r.metrics()
        retried = metric_value(text, "smg_retries_total", endpoint=ENDPOINT, outcome="retried")
        refused = metric_value(text, "smg_retries_total", endpoint=ENDPOINT, outcome="budget_exhausted")
        assert attempts <= 120, attempts  # without a budget each request tries both workers: 200
        assert attempts == 100 + retried and retried + refused == 100, (attempts, retried, refused)
    finally:
        r.stop()
        for s in sims:
            s.stop()


def _slow_chat(r_url: str, headers: dict[str, str] | None = None) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "write a long story"}], "max_tokens": 300}
    status, answer, _ = http_json_headers("POST", r_url + ENDPOINT, body, headers=headers, timeout=60)
    return status, answer, time.monotonic() - t0


def test_a_generation_outliving_the_first_byte_timeout_is_one_attempt_and_a_504(logs: Path) -> None:
    sims = [start_sim(logs, time_scale=1.0) for _ in range(3)]  # 300 tokens at 15 ms a step: 4.5 s
    r = start_router(logs, workers=[s.url for s in sims], args=["--first-byte-timeout", "1"])
    try:
        r.wait_routable(3)
        status, answer, took = _slow_chat(r.url)
        assert status == 504, answer
        assert answer["error"]["type"] == "upstream_timeout", answer
        assert received(sims) == 1  # the generation was not started again on another worker
        assert took < 4, took
    finally:
        r.stop()
        for s in sims:
            s.stop()


def test_a_timed_out_request_with_an_idempotency_key_is_retried_elsewhere(logs: Path) -> None:
    sims = [start_sim(logs, time_scale=1.0) for _ in range(2)]
    r = start_router(logs, workers=[s.url for s in sims], args=["--first-byte-timeout", "1", "--max-retries", "1"])
    try:
        r.wait_routable(2)
        status, answer, _ = _slow_chat(r.url, headers={"Idempotency-Key": "story-1"})
        assert status == 504, answer
        assert received(sims) == 2  # the client said a second run is harmless
        assert metric_value(r.metrics(), "smg_retries_total", endpoint=ENDPOINT, outcome="retried") == 1
    finally:
        r.stop()
        for s in sims:
            s.stop()
