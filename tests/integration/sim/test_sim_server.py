"""smg-sim as a real subprocess: OpenAI and SGLang APIs, load reports, metrics, errors and load build-up.

The OpenAI endpoints are exercised with the official `openai` client, so a response it cannot parse
fails here.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from openai import AsyncOpenAI
from smg_sim_procs import SimLauncher, SimProcess
from support.procs import wait_until_async

MODEL = "sim-model"


def chat_template(*turns: tuple[str, str]) -> str:
    return "".join(f"<|{role}|>\n{content}\n" for role, content in turns) + "<|assistant|>\n"


@pytest.fixture(scope="module")
def sim(launch_module_sim: SimLauncher) -> SimProcess:
    return launch_module_sim("127.0.0.2", "--time-scale", "0.02")


@pytest.fixture(scope="module")
def busy_sim(launch_module_sim: SimLauncher) -> SimProcess:
    """A worker with a small batch and realistic-ish speed, so queues build up."""
    return launch_module_sim("127.0.0.3", "--time-scale", "0.5", "--max-running", "4")


@pytest.fixture
async def client(sim: SimProcess) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(
        base_url=f"{sim.url}/v1",
        api_key="x",
        max_retries=0,
        http_client=openai.DefaultAsyncHttpxClient(trust_env=False),  # loopback only: never via a proxy
    ) as c:
        yield c


async def get_json(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with http.get(url) as resp:
        return resp.status, await resp.json(content_type=None)


async def post(http: aiohttp.ClientSession, url: str, **kwargs: Any) -> tuple[int, Any, aiohttp.ClientResponse]:
    async with http.post(url, **kwargs) as resp:
        return resp.status, await resp.json(content_type=None), resp


# -- OpenAI API -----------------------------------------------------------------------------------


async def test_chat_completion_stream_and_non_stream_agree(client: AsyncOpenAI) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"hi {uuid.uuid4()}"}]
    full = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
    assert full.object == "chat.completion"
    assert full.model == MODEL
    content = full.choices[0].message.content
    assert content is not None and len(content) == 12  # one token per character
    assert full.choices[0].finish_reason == "length"
    prompt = chat_template(("system", "be brief"), ("user", messages[1]["content"]))
    assert full.usage is not None
    assert full.usage.prompt_tokens == len(prompt)
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == len(prompt) + 12

    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, stream=True, stream_options={"include_usage": True}
    )
    deltas, roles, finishes, usages = [], [], [], []
    async for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            roles.append(choice.delta.role)
            deltas.append(choice.delta.content or "")
            finishes.append(choice.finish_reason)
    assert "".join(deltas) == content  # output depends only on the prompt
    assert roles[0] == "assistant"
    assert finishes[-1] == "length" and finishes.count("length") == 1
    assert len(usages) == 1 and usages[0].completion_tokens == 12
    assert usages[0].prompt_tokens_details is not None
    assert usages[0].prompt_tokens_details.cached_tokens == len(prompt) - 1  # second identical prompt


async def test_second_identical_request_reports_cached_tokens(client: AsyncOpenAI) -> None:
    messages = [{"role": "user", "content": f"cache me {uuid.uuid4()} " * 20}]
    first = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    second = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None and second.usage.prompt_tokens_details is not None
    # Only the chat template's "<|user|>\n" can be shared with earlier tests' prompts.
    assert first.usage.prompt_tokens_details.cached_tokens <= len("<|user|>\n")
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1


async def test_multi_turn_chat_reuses_previous_turn_from_cache(client: AsyncOpenAI) -> None:
    question = f"first question {uuid.uuid4()}"
    turn1 = [{"role": "user", "content": question}]
    answer = await client.chat.completions.create(model=MODEL, messages=turn1, max_tokens=10)
    reply = answer.choices[0].message.content or ""
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
    follow_up = await client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=3)
    assert follow_up.usage is not None and follow_up.usage.prompt_tokens_details is not None
    # Prompt and answer of turn 1 were cached when it finished; turn 2 diverges right after the answer.
    expected = len(chat_template(("user", question))) + len(reply)
    assert follow_up.usage.prompt_tokens_details.cached_tokens == expected


async def test_completions_stream_and_non_stream(client: AsyncOpenAI) -> None:
    prompt = f"complete this {uuid.uuid4()}"
    full = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=9)
    assert full.object == "text_completion"
    assert len(full.choices[0].text) == 9 and full.choices[0].finish_reason == "length"
    assert full.usage is not None and full.usage.prompt_tokens == len(prompt)
    stream = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=9, stream=True, stream_options={"include_usage": True}
    )
    texts, finishes, usage = [], [], None
    async for chunk in stream:
        for choice in chunk.choices:
            texts.append(choice.text)
            finishes.append(choice.finish_reason)
        usage = chunk.usage or usage
    assert "".join(texts) == full.choices[0].text
    assert finishes[-1] == "length"
    assert usage is not None and usage.completion_tokens == 9


async def test_stop_sequence_is_honoured(client: AsyncOpenAI) -> None:
    prompt = f"stop here {uuid.uuid4()}"
    full = (await client.completions.create(model=MODEL, prompt=prompt, max_tokens=40)).choices[0].text
    stop = full[12:15]
    cut = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


async def test_models_and_server_info(client: AsyncOpenAI, sim: SimProcess, http: aiohttp.ClientSession) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "smg-sim"
    status, info = await get_json(http, f"{sim.url}/get_model_info")
    assert status == 200 and info == {"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True}
    status, server = await get_json(http, f"{sim.url}/get_server_info")
    assert status == 200
    assert server["disaggregation_mode"] == "null" and server["role"] == "regular"
    assert server["sim_config"]["time_scale"] == 0.02
    assert isinstance(server["version"], str)


async def test_wrong_model_is_404(client: AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert info.value.status_code == 404
    assert "nope" in str(info.value)


async def test_malformed_requests_are_400(sim: SimProcess, http: aiohttp.ClientSession) -> None:
    for path, body in [
        ("/v1/chat/completions", b"{not json"),
        ("/v1/chat/completions", b"[1, 2]"),
        ("/v1/chat/completions", b'{"model": "sim-model"}'),
        ("/v1/completions", b'{"model": "sim-model"}'),
        ("/v1/completions", b'{"model": "sim-model", "prompt": "x", "max_tokens": -1}'),
        ("/generate", b'{"sampling_params": {}}'),
        ("/generate", b"{broken"),
    ]:
        status, data, resp = await post(http, f"{sim.url}{path}", data=body)
        assert status == 400, (path, body, data)
        assert set(data["error"]) >= {"message", "type", "code"}
        assert resp.headers["x-smg-sim-worker"] == sim.worker_id
    status, data = await get_json(http, f"{sim.url}/no/such/route")
    assert status == 404 and "error" in data


# -- SGLang native API ----------------------------------------------------------------------------


async def test_generate_single_batch_ids_and_stream(sim: SimProcess, http: aiohttp.ClientSession) -> None:
    url = f"{sim.url}/generate"
    text = f"native {uuid.uuid4()}"
    status, one, resp = await post(http, url, json={"text": text, "sampling_params": {"max_new_tokens": 7}})
    assert status == 200 and resp.headers["x-smg-sim-worker"] == sim.worker_id
    assert len(one["text"]) == 7 and len(one["output_ids"]) == 7
    meta = one["meta_info"]
    assert meta["prompt_tokens"] == len(text) and meta["completion_tokens"] == 7
    assert meta["finish_reason"] == {"type": "length", "length": 7}
    assert meta["cached_tokens"] == 0 and meta["e2e_latency"] >= 0

    status, batch, _ = await post(
        http,
        url,
        json={"text": [text, text + "!"], "sampling_params": {"max_new_tokens": 3}, "rid": ["a", "b"]},
    )
    assert status == 200 and isinstance(batch, list) and len(batch) == 2
    assert [b["meta_info"]["id"] for b in batch] == ["a", "b"]
    assert batch[0]["meta_info"]["cached_tokens"] == len(text) - 1

    status, by_ids, _ = await post(http, url, json={"input_ids": [5, 6, 7, 8], "sampling_params": {}})
    assert status == 200 and by_ids["meta_info"]["prompt_tokens"] == 4
    assert by_ids["meta_info"]["completion_tokens"] == 16  # --max-tokens-default

    chunks = []
    stream_body = {"text": text, "stream": True, "sampling_params": {"max_new_tokens": 7}}
    async with http.post(url, json=stream_body) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        async for line in r.content:
            if line.startswith(b"data: "):
                chunks.append(line[6:].strip())
    assert chunks[-1] == b"[DONE]"
    parsed = [orjson.loads(c) for c in chunks[:-1]]
    assert len(parsed) == 7  # one chunk per generated token
    assert parsed[-1]["text"] == one["text"]  # cumulative text, same as non-streaming
    assert parsed[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(p["meta_info"]["finish_reason"] is None for p in parsed[:-1])


# -- load reports ---------------------------------------------------------------------------------


async def test_loads_shape(sim: SimProcess, http: aiohttp.ClientSession) -> None:
    status, loads = await get_json(http, f"{sim.url}/v1/loads?include=all")
    assert status == 200
    assert isinstance(loads["timestamp"], str)
    dt.datetime.fromisoformat(loads["timestamp"])
    assert loads["dp_rank_count"] == 1
    (rank,) = loads["loads"]
    expected = {
        "dp_rank": int,
        "num_running_reqs": int,
        "num_waiting_reqs": int,
        "num_used_tokens": int,
        "max_total_num_tokens": int,
        "token_usage": float,
        "gen_throughput": float,
        "cache_hit_rate": float,
        "utilization": float,
        "max_running_requests": int,  # SGLang reports it per rank: the router's load gate reads it
    }
    assert set(rank) == set(expected)
    for key, kind in expected.items():
        assert isinstance(rank[key], kind), key
    assert rank["max_total_num_tokens"] == 200_000


async def test_metrics_exposition(sim: SimProcess, http: aiohttp.ClientSession) -> None:
    async with http.post(f"{sim.url}/generate", json={"text": "metrics", "sampling_params": {}}) as r:
        assert r.status == 200
    async with http.get(f"{sim.url}/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name_labels, value = line.rsplit(" ", 1)
            samples[name_labels] = float(value)
    for name, kind in [
        ("sglang:num_running_reqs", "gauge"),
        ("sglang:num_queue_reqs", "gauge"),
        ("sglang:num_used_tokens", "gauge"),
        ("sglang:token_usage", "gauge"),
        ("sglang:cache_hit_rate", "gauge"),
        ("sglang:prompt_tokens_total", "counter"),
        ("sglang:generation_tokens_total", "counter"),
        ("sglang:cached_tokens_total", "counter"),
    ]:
        assert f"# TYPE {name} {kind}" in text
        assert f"# HELP {name} " in text
        assert f'{name}{{model_name="{MODEL}"}}' in samples
    assert samples[f'sglang:prompt_tokens_total{{model_name="{MODEL}"}}'] > 0
    assert samples[f'sglang:generation_tokens_total{{model_name="{MODEL}"}}'] >= 16


async def test_load_builds_up_under_concurrency(busy_sim: SimProcess, http: aiohttp.ClientSession) -> None:
    async def one(i: int) -> int:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"load {i}"}], "max_tokens": 20}
        async with http.post(f"{busy_sim.url}/v1/chat/completions", json=body) as resp:
            await resp.read()
            return resp.status

    tasks = [asyncio.create_task(one(i)) for i in range(40)]
    peak_waiting, peak_running, peak_used = 0, 0, 0
    while not all(t.done() for t in tasks):
        _, loads = await get_json(http, f"{busy_sim.url}/v1/loads")
        rank = loads["loads"][0]
        peak_waiting = max(peak_waiting, rank["num_waiting_reqs"])
        peak_running = max(peak_running, rank["num_running_reqs"])
        peak_used = max(peak_used, rank["num_used_tokens"])
        await asyncio.sleep(0.02)
    assert await asyncio.gather(*tasks) == [200] * 40
    assert peak_running == 4  # never more than --max-running
    assert peak_waiting > 10
    assert peak_used > 0
    _, loads = await get_json(http, f"{busy_sim.url}/v1/loads")
    assert loads["loads"][0]["num_running_reqs"] == 0 and loads["loads"][0]["num_waiting_reqs"] == 0


async def wait_idle(http: aiohttp.ClientSession, sim: SimProcess) -> None:
    async def idle() -> bool:
        _, loads = await get_json(http, f"{sim.url}/v1/loads")
        return bool(loads["loads"][0]["num_running_reqs"] == 0)

    await wait_until_async(idle, what="the request to stop running after its client went away")


async def test_client_disconnect_frees_the_slot(busy_sim: SimProcess, http: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "endless"}], "max_tokens": 100_000, "stream": True}
    async with aiohttp.ClientSession() as own:
        resp = await own.post(f"{busy_sim.url}/v1/chat/completions", json=body)
        for _ in range(3):
            assert (await resp.content.readline()) is not None
        _, loads = await get_json(http, f"{busy_sim.url}/v1/loads")
        assert loads["loads"][0]["num_running_reqs"] == 1
        resp.close()  # drop the connection mid-stream
    await wait_idle(http, busy_sim)

    body["stream"] = False
    with pytest.raises(asyncio.TimeoutError):
        async with asyncio.timeout(0.3), http.post(f"{busy_sim.url}/v1/chat/completions", json=body) as r:
            await r.read()
    await wait_idle(http, busy_sim)
