"""vLLM-style prefill/decode (``--vllm-pd``) between real smg-sim processes: kv_transfer_params, the side channel,
and the clear failures of a decode without them or with a wrong pairing."""

from __future__ import annotations

import uuid
from typing import Any

import aiohttp
import pytest
from smg_sim_procs import SimLauncher, SimProcess, free_port, post
from support.procs import wait_until_async

PREFILL_HOST, OTHER_PREFILL_HOST, DECODE_HOST = "127.0.0.41", "127.0.0.42", "127.0.0.43"
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def _prefill_flags(host: str, *extra: str) -> tuple[str, ...]:
    return ("--vllm-pd", "prefill", "--bootstrap-port", str(free_port(host)), "--time-scale", "0.02", *extra)


@pytest.fixture(scope="module")
def prefill(launch_module_sim: SimLauncher) -> SimProcess:
    return launch_module_sim(PREFILL_HOST, *_prefill_flags(PREFILL_HOST))


@pytest.fixture(scope="module")
def other_prefill(launch_module_sim: SimLauncher) -> SimProcess:
    return launch_module_sim(OTHER_PREFILL_HOST, *_prefill_flags(OTHER_PREFILL_HOST))


@pytest.fixture(scope="module")
def decode(launch_module_sim: SimLauncher) -> SimProcess:
    return launch_module_sim(DECODE_HOST, "--vllm-pd", "decode", "--time-scale", "0.02", "--bootstrap-timeout", "2")


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": text}], **extra}


async def prefilled(http: aiohttp.ClientSession, prefill: SimProcess, body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg as a router sends it; the kv_transfer_params it answers."""
    status, answer = await post(
        http,
        prefill.url + "/v1/chat/completions",
        {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": REMOTE_DECODE},
    )
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 1
    params = answer["kv_transfer_params"]
    assert isinstance(params, dict), answer
    return params


async def test_prefill_returns_where_the_kv_waits_and_decode_reads_it(
    prefill: SimProcess, decode: SimProcess, http: aiohttp.ClientSession
) -> None:
    body = chat(f"vllm pd {uuid.uuid4()} " * 8, max_tokens=6)
    params = await prefilled(http, prefill, body)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_host"] == PREFILL_HOST and isinstance(params["remote_engine_id"], str)
    assert params["remote_block_ids"] and all(isinstance(b, int) for b in params["remote_block_ids"])
    # the prefill holds the blocks on its side channel until a decode reads them
    side = f"http://{PREFILL_HOST}:{params['remote_port']}/kv/held"
    async with http.get(side) as resp:
        held = (await resp.json())["held"]
    assert [h["block_ids"] for h in held] == [params["remote_block_ids"]]

    status, answer = await post(http, decode.url + "/v1/chat/completions", {**body, "kv_transfer_params": params})
    assert status == 200, answer
    usage = answer["usage"]
    assert usage["completion_tokens"] == 6
    # the whole prompt arrived from the prefill: the decode reports it cached, as vLLM does
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]
    async with http.get(side) as resp:
        assert (await resp.json())["held"] == []  # read once, freed
    # the parameters are single-use: a second decode finds the blocks gone
    status, again = await post(http, decode.url + "/v1/chat/completions", {**body, "kv_transfer_params": params})
    assert status == 500 and again["error"]["code"] == "kv_transfer_failed", again
    assert "already read" in again["error"]["message"], again


async def test_streaming_decode_and_completions(
    prefill: SimProcess, decode: SimProcess, http: aiohttp.ClientSession
) -> None:
    body = {"model": "sim-model", "prompt": f"complete {uuid.uuid4()} " * 5, "max_tokens": 4}
    status, answer = await post(
        http,
        prefill.url + "/v1/completions",
        {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": REMOTE_DECODE},
    )
    assert status == 200 and answer["kv_transfer_params"]["do_remote_prefill"] is True, answer
    stream = {**body, "stream": True, "kv_transfer_params": answer["kv_transfer_params"]}
    async with http.post(decode.url + "/v1/completions", json=stream) as resp:
        assert resp.status == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        text = (await resp.read()).decode()
    assert text.rstrip().endswith("data: [DONE]")
    assert text.count("data: ") >= 3


async def test_decode_without_transfer_params_fails_clearly(decode: SimProcess, http: aiohttp.ClientSession) -> None:
    status, answer = await post(http, decode.url + "/v1/chat/completions", chat("no prefill first"))
    assert status == 400, answer
    assert answer["error"]["code"] == "missing_kv_transfer_params"
    assert "do_remote_prefill" in answer["error"]["message"]
    # parameters that name no remote KV are refused before anything is read
    partial = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_host": PREFILL_HOST}
    status, answer = await post(http, decode.url + "/v1/chat/completions", chat("x", kv_transfer_params=partial))
    assert status == 400 and answer["error"]["code"] == "invalid_kv_transfer_params", answer
    assert "remote_port" in answer["error"]["message"] and "remote_block_ids" in answer["error"]["message"]


async def test_a_wrong_pairing_fails_naming_the_engine(
    prefill: SimProcess, other_prefill: SimProcess, decode: SimProcess, http: aiohttp.ClientSession
) -> None:
    body = chat(f"pairing {uuid.uuid4()} " * 4, max_tokens=3)
    params = await prefilled(http, prefill, body)
    other = await prefilled(http, other_prefill, chat(f"other {uuid.uuid4()}"))
    # an engine id the side channel does not serve: the params point at another prefill worker
    wrong_engine = {**params, "remote_engine_id": other["remote_engine_id"]}
    status, answer = await post(http, decode.url + "/v1/chat/completions", {**body, "kv_transfer_params": wrong_engine})
    assert status == 500 and answer["error"]["code"] == "kv_transfer_failed", answer
    assert other["remote_engine_id"] in answer["error"]["message"] and "another prefill" in answer["error"]["message"]
    # the right engine, but a prompt other than the one prefilled
    status, answer = await post(
        http, decode.url + "/v1/chat/completions", {**chat("a different prompt"), "kv_transfer_params": params}
    )
    assert status == 500 and "another prompt" in answer["error"]["message"], answer
    # a side channel that is not there
    dead = {**other, "remote_port": free_port(OTHER_PREFILL_HOST)}
    status, answer = await post(http, decode.url + "/v1/chat/completions", {**body, "kv_transfer_params": dead})
    assert status == 502 and "unreachable" in answer["error"]["message"], answer
    assert f"{OTHER_PREFILL_HOST}:{dead['remote_port']}" in answer["error"]["message"]


async def test_held_kv_is_freed_after_the_abort_timeout(
    launch_sim: SimLauncher, decode: SimProcess, http: aiohttp.ClientSession
) -> None:
    host = "127.0.0.44"
    prefill = launch_sim(host, *_prefill_flags(host, "--room-ttl", "0.5"))
    body = chat(f"nobody reads this {uuid.uuid4()}", max_tokens=2)
    params = await prefilled(http, prefill, body)
    side = f"http://{host}:{params['remote_port']}/kv/held"

    async def freed() -> bool:
        async with http.get(side) as resp:
            return (await resp.json())["held"] == []

    await wait_until_async(freed, what="the held KV to be freed")
    status, answer = await post(http, decode.url + "/v1/chat/completions", {**body, "kv_transfer_params": params})
    assert status == 500 and "abort timeout" in answer["error"]["message"], answer


async def test_prefill_without_remote_decode_serves_the_request_whole(
    prefill: SimProcess, http: aiohttp.ClientSession
) -> None:
    status, answer = await post(http, prefill.url + "/v1/chat/completions", chat("plain request", max_tokens=5))
    assert status == 200 and answer["usage"]["completion_tokens"] == 5
    assert "kv_transfer_params" not in answer
    status, answer = await post(
        http, prefill.url + "/v1/chat/completions", chat("stream?", stream=True, kv_transfer_params=REMOTE_DECODE)
    )
    assert status == 400 and "stream: false" in answer["error"]["message"], answer
