"""The in-process API (`start_sim`): the same worker inside the test's event loop."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest
from smg_sim import SimConfig, SimServer, start_sim
from smg_sim_procs import post
from support.procs import wait_until_async


async def test_regular_worker_ignores_bootstrap_fields(http: aiohttp.ClientSession) -> None:
    async with await start_sim(SimConfig(host="127.0.0.10", port=0, time_scale=0.0)) as sim:
        assert sim.url == f"http://127.0.0.10:{sim.port}" and sim.port > 0
        assert sim.bootstrap_url is None
        body = {"text": "hi", "bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 5}
        async with http.post(f"{sim.url}/generate", json=body) as resp:
            assert resp.status == 200
            assert resp.headers["x-smg-sim-worker"] == f"127.0.0.10:{sim.port}"
            assert (await resp.json())["meta_info"]["completion_tokens"] == 16


async def test_crash_hook_replaces_process_exit(http: aiohttp.ClientSession) -> None:
    crashes: list[int] = []
    config = SimConfig(host="127.0.0.10", port=0, time_scale=0.0, crash_after=2)
    async with await start_sim(config, crash=lambda: crashes.append(1)) as sim:
        assert (await post(http, f"{sim.url}/generate", {"text": "one"}))[0] == 200
        assert crashes == []
        status, body = await post(http, f"{sim.url}/generate", {"text": "two"})
        assert crashes == [1]
        assert status == 500 and body["error"]["code"] == "simulated_crash"


async def pd_pair(*, prefill_tps: float = 4000.0) -> tuple[SimServer, SimServer]:
    prefill = await start_sim(
        SimConfig(
            host="127.0.0.11",
            port=0,
            role="prefill",
            bootstrap_port=0,
            time_scale=1.0,
            prefill_tps=prefill_tps,
            decode_step_ms=1.0,
        )
    )
    decode = await start_sim(SimConfig(host="127.0.0.12", port=0, role="decode", time_scale=0.0, bootstrap_timeout=5.0))
    return prefill, decode


async def test_aborted_prefill_fails_the_waiting_decode_quickly(http: aiohttp.ClientSession) -> None:
    prefill, decode = await pd_pair(prefill_tps=100.0)  # a 1000-token prompt takes 10 s to prefill
    try:
        assert prefill.bootstrap_port is not None and prefill.bootstrap_port > 0
        room = random.getrandbits(62)
        body = {
            "text": "z" * 1000,
            "bootstrap_host": "127.0.0.11",
            "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": room,
        }
        decode_task = asyncio.create_task(post(http, f"{decode.url}/generate", body))
        prefill_task = asyncio.create_task(post(http, f"{prefill.url}/generate", body))
        await wait_until_async(lambda: prefill.state.engine.stats().num_running_reqs == 1, what="prefill running")
        assert not decode_task.done()
        prefill_task.cancel()  # the client of the prefill goes away mid-prefill
        await asyncio.gather(prefill_task, return_exceptions=True)
        status, data = await asyncio.wait_for(decode_task, 30.0)
        assert status == 500
        # The failed room ended the wait, not the 5 s bootstrap timeout (that answer says "did not finish").
        assert f"prefill for bootstrap room {room} failed" in data["error"]["message"], data
        await wait_until_async(
            lambda: prefill.state.engine.stats().num_running_reqs == 0, what="the aborted prefill to leave the engine"
        )
    finally:
        await prefill.stop()
        await decode.stop()


async def test_in_process_pd_pair(http: aiohttp.ClientSession) -> None:
    prefill, decode = await pd_pair()
    try:
        body = {
            "text": "in process",
            "sampling_params": {"max_new_tokens": 3},
            "bootstrap_host": "127.0.0.11",
            "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": "room-a",
        }
        (p_status, _), (d_status, d_body) = await asyncio.gather(
            post(http, f"{prefill.url}/generate", body), post(http, f"{decode.url}/generate", body)
        )
        assert (p_status, d_status) == (200, 200)
        assert d_body["meta_info"]["completion_tokens"] == 3
    finally:
        await prefill.stop()
        await decode.stop()


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="max_running"):
        SimConfig(max_running=0)
    with pytest.raises(ValueError, match="error_rate"):
        SimConfig(error_rate=1.5)
    with pytest.raises(ValueError, match="role"):
        SimConfig(role="router")  # type: ignore[arg-type]
    assert SimConfig(role="prefill").effective_bootstrap_port == 8998
    assert SimConfig().effective_bootstrap_port is None
