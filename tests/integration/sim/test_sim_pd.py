"""Prefill/decode disaggregation between two real smg-sim processes, SGLang bootstrap style."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI
from smg_sim_procs import SimLauncher, SimProcess, free_port
from support.procs import wait_until_async

MODEL = "sim-model"
PREFILL_HOST, DECODE_HOST = "127.0.0.4", "127.0.0.5"


@pytest.fixture(scope="module")
def prefill(launch_module_sim: SimLauncher) -> SimProcess:
    return launch_module_sim(PREFILL_HOST, "--time-scale", "0.02", role="prefill", with_bootstrap=True)


@pytest.fixture(scope="module")
def decode(launch_module_sim: SimLauncher) -> SimProcess:
    return launch_module_sim(DECODE_HOST, "--time-scale", "0.02", "--bootstrap-timeout", "1", role="decode")


def boot(prefill: SimProcess, room: Any | None = None) -> dict[str, Any]:
    return {
        "bootstrap_host": prefill.host,
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": random.getrandbits(62) if room is None else room,
    }


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any, str]:
    async with http.post(url, json=body) as resp:
        return resp.status, await resp.json(content_type=None), resp.headers["x-smg-sim-worker"]


async def test_generate_pair_with_matching_room(
    prefill: SimProcess, decode: SimProcess, http: aiohttp.ClientSession
) -> None:
    text = f"pd prompt {uuid.uuid4()} " * 10
    for attempt in range(2):
        body = {"text": text, "sampling_params": {"max_new_tokens": 8}, **boot(prefill)}
        (p_status, p_body, p_worker), (d_status, d_body, d_worker) = await asyncio.gather(
            post(http, f"{prefill.url}/generate", body), post(http, f"{decode.url}/generate", body)
        )
        assert p_status == 200, p_body
        assert d_status == 200, d_body
        assert (p_worker, d_worker) == (prefill.worker_id, decode.worker_id)
        assert p_body["meta_info"]["completion_tokens"] == 1  # prefill only computes the first token
        assert d_body["meta_info"]["completion_tokens"] == 8
        assert len(d_body["text"]) == 8
        assert d_body["meta_info"]["prompt_tokens"] == len(text)
        # The decode side reports what the prefill side had cached (nothing, then all but one token).
        assert d_body["meta_info"]["cached_tokens"] == p_body["meta_info"]["cached_tokens"]
        assert d_body["meta_info"]["cached_tokens"] == (0 if attempt == 0 else len(text) - 1)


async def test_decode_waits_for_a_late_prefill(
    prefill: SimProcess, decode: SimProcess, http: aiohttp.ClientSession
) -> None:
    body = {"text": f"late {uuid.uuid4()}", "sampling_params": {"max_new_tokens": 4}, **boot(prefill)}
    decode_task = asyncio.create_task(post(http, f"{decode.url}/generate", body))

    async def decode_is_polling() -> bool:  # the decode worker's long-poll made the prefill side note the room
        async with http.get(f"http://{prefill.host}:{prefill.bootstrap_port}/bootstrap/rooms") as resp:
            rooms = await resp.json()
        return rooms.get(str(body["bootstrap_room"]), {}).get("status") == "unseen"

    await wait_until_async(decode_is_polling, what="the decode worker to wait for the room")
    assert not decode_task.done()
    p_status, _, _ = await post(http, f"{prefill.url}/generate", body)
    d_status, d_body, _ = await decode_task
    assert (p_status, d_status) == (200, 200), d_body
    assert d_body["meta_info"]["completion_tokens"] == 4


async def test_batch_generate_with_one_room_per_item(
    prefill: SimProcess, decode: SimProcess, http: aiohttp.ClientSession
) -> None:
    rooms = [random.getrandbits(62), random.getrandbits(62)]
    body = {"text": ["first item", "second item"], "sampling_params": {"max_new_tokens": 5}, **boot(prefill, rooms)}
    (p_status, _, _), (d_status, d_body, _) = await asyncio.gather(
        post(http, f"{prefill.url}/generate", body), post(http, f"{decode.url}/generate", body)
    )
    assert (p_status, d_status) == (200, 200), d_body
    assert [len(item["text"]) for item in d_body] == [5, 5]
    assert [item["meta_info"]["prompt_tokens"] for item in d_body] == [len("first item"), len("second item")]


async def test_chat_through_openai_client(prefill: SimProcess, decode: SimProcess) -> None:
    def client(sim: SimProcess) -> AsyncOpenAI:
        return AsyncOpenAI(
            base_url=f"{sim.url}/v1",
            api_key="x",
            max_retries=0,
            http_client=openai.DefaultAsyncHttpxClient(trust_env=False),
        )

    messages = [{"role": "user", "content": f"pd chat {uuid.uuid4()}"}]
    async with client(prefill) as p_client, client(decode) as d_client:
        extra = boot(prefill)
        _, answer = await asyncio.gather(
            p_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, extra_body=extra),
            d_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, extra_body=extra),
        )
        assert answer.choices[0].message.content is not None
        assert len(answer.choices[0].message.content) == 6
        assert answer.usage is not None and answer.usage.completion_tokens == 6

        extra = boot(prefill)
        prefill_call = asyncio.create_task(
            p_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, extra_body=extra)
        )
        stream = await d_client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, extra_body=extra, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await prefill_call
        assert text == answer.choices[0].message.content


async def test_decode_with_unknown_room_fails_clearly(
    prefill: SimProcess, decode: SimProcess, http: aiohttp.ClientSession
) -> None:
    body = {"text": "orphan", "sampling_params": {"max_new_tokens": 4}, **boot(prefill, room=424242)}
    started = time.monotonic()
    status, data, _ = await post(http, f"{decode.url}/generate", body)
    assert status == 500
    message = data["error"]["message"]
    assert "424242" in message and "not found" in message and prefill.worker_id.split(":")[0] in message
    assert 1.0 <= time.monotonic() - started < 4.0  # waited --bootstrap-timeout 1, not the 10 s default


async def test_decode_with_wrong_bootstrap_port_fails_clearly(
    prefill: SimProcess, decode: SimProcess, http: aiohttp.ClientSession
) -> None:
    wrong = {**boot(prefill), "bootstrap_port": free_port(PREFILL_HOST)}
    status, data, _ = await post(http, f"{decode.url}/generate", {"text": "lost", **wrong})
    assert status == 502
    assert "unreachable" in data["error"]["message"]
    assert str(wrong["bootstrap_port"]) in data["error"]["message"]


async def test_decode_rejects_mismatched_prompt(
    prefill: SimProcess, decode: SimProcess, http: aiohttp.ClientSession
) -> None:
    room = boot(prefill)
    p_status, _, _ = await post(http, f"{prefill.url}/generate", {"text": "short", **room})
    d_status, data, _ = await post(http, f"{decode.url}/generate", {"text": "a longer prompt", **room})
    assert (p_status, d_status) == (200, 500)
    assert "kv transfer failed" in data["error"]["message"]


@pytest.mark.parametrize("missing", ["bootstrap_host", "bootstrap_port", "bootstrap_room"])
async def test_pd_roles_require_bootstrap_fields(
    prefill: SimProcess, decode: SimProcess, http: aiohttp.ClientSession, missing: str
) -> None:
    body = {"text": "x", **boot(prefill)}
    del body[missing]
    for sim in (prefill, decode):
        status, data, _ = await post(http, f"{sim.url}/generate", body)
        assert status == 400
        assert missing in data["error"]["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **boot(prefill)}
    del chat[missing]
    status, data, _ = await post(http, f"{decode.url}/v1/chat/completions", chat)
    assert status == 400 and missing in data["error"]["message"]


async def test_bootstrap_server_endpoints(prefill: SimProcess, http: aiohttp.ClientSession) -> None:
    base = f"http://{prefill.host}:{prefill.bootstrap_port}"
    async with http.get(f"{base}/health") as resp:
        assert resp.status == 200
    room = boot(prefill)
    status, _, _ = await post(http, f"{prefill.url}/generate", {"text": "room info", **room})
    assert status == 200
    async with http.get(f"{base}/bootstrap/room/{room['bootstrap_room']}") as resp:
        info = await resp.json()
        assert resp.status == 200
    assert info["status"] == "ready" and info["prompt_tokens"] == len("room info")
    assert info["worker"] == prefill.worker_id
    started = time.monotonic()
    async with http.get(f"{base}/bootstrap/room/999?timeout=0.2") as resp:
        assert resp.status == 404
        assert "999" in (await resp.json())["error"]["message"]
    assert 0.2 <= time.monotonic() - started < 1.5  # waited the asked 0.2 s, not the 10 s ceiling

    async with http.get(f"{prefill.url}/get_server_info") as resp:
        server = await resp.json()
    assert server["disaggregation_mode"] == "prefill"
    assert server["disaggregation_bootstrap_port"] == prefill.bootstrap_port
