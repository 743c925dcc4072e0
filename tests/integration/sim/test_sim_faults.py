"""Fault injection and warm-up of real smg-sim processes: errors, hangs, crashes and slow start."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI
from smg_sim_procs import SimLauncher, http_get
from support.procs import wait_until_async

MODEL = "sim-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}


async def test_error_rate_one_answers_500(launch_sim: SimLauncher) -> None:
    sim = launch_sim("127.0.0.6", "--time-scale", "0.01", "--error-rate", "1")
    async with AsyncOpenAI(
        base_url=f"{sim.url}/v1",
        api_key="x",
        max_retries=0,
        http_client=openai.DefaultAsyncHttpxClient(trust_env=False),
    ) as client:
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(**CHAT)
    assert info.value.status_code == 500
    assert "simulated" in str(info.value)
    assert http_get(f"{sim.url}/health")[0] == 200  # still healthy: only requests fail


async def test_error_status_429_sheds_every_request_and_the_metrics_count_them(
    launch_sim: SimLauncher, http: aiohttp.ClientSession
) -> None:
    sim = launch_sim("127.0.0.10", "--time-scale", "0.01", "--error-rate", "1", "--error-status", "429")
    for _ in range(3):
        async with http.post(f"{sim.url}/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 429
            assert (await resp.json())["error"]["type"] == "rate_limit_exceeded"
    async with http.get(f"{sim.url}/metrics") as resp:
        text = await resp.text()
    assert f'smg_sim_generation_requests_total{{model_name="{MODEL}"}} 3.0' in text
    assert f'sglang:num_requests_total{{model_name="{MODEL}"}} 0.0' in text  # none reached the engine


async def test_crash_after_two_kills_the_process_on_the_second_request(
    launch_sim: SimLauncher, http: aiohttp.ClientSession
) -> None:
    sim = launch_sim("127.0.0.7", "--time-scale", "0.01", "--crash-after", "2")
    async with http.post(f"{sim.url}/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
    with pytest.raises(aiohttp.ClientError):
        async with http.post(f"{sim.url}/v1/chat/completions", json=CHAT) as resp:
            await resp.read()
    assert await asyncio.to_thread(sim.proc.wait, 5) == 1


async def test_hang_rate_one_never_answers_but_stays_healthy(
    launch_sim: SimLauncher, http: aiohttp.ClientSession
) -> None:
    sim = launch_sim("127.0.0.8", "--time-scale", "0.01", "--hang-rate", "1")
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.5), http.post(f"{sim.url}/generate", json={"text": "x"}) as resp:
            await resp.read()
    async with http.get(f"{sim.url}/health") as resp:
        assert resp.status == 200
    async with http.get(f"{sim.url}/v1/loads") as resp:
        assert (await resp.json())["loads"][0]["num_running_reqs"] == 0


async def test_slow_start_reports_unhealthy_then_healthy(launch_sim: SimLauncher) -> None:
    sim = launch_sim("127.0.0.9", "--time-scale", "0.01", "--slow-start", "1.0")
    status, body = http_get(f"{sim.url}/health")
    assert status == 503 and b"warming up" in body
    assert http_get(f"{sim.url}/health_generate")[0] == 503
    await wait_until_async(lambda: http_get(f"{sim.url}/health")[0] == 200, what="healthy after --slow-start")
