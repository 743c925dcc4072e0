"""smg-sim's Messages, Responses and pooling endpoints, in process: shapes, event order, cache and refusals."""

from __future__ import annotations

import base64
import struct
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from smg_sim import SimConfig, SimServer, start_sim
from smg_sim_procs import post

MODEL = "sim-pass"


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    async with await start_sim(SimConfig(host="127.0.0.11", port=0, time_scale=0.0, model=MODEL)) as server:
        yield server


async def events(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[tuple[str, str]]:
    """(event name, data) of every named SSE event of a stream."""
    async with http.post(url, json=body) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        raw = (await resp.read()).decode()
    out = []
    for block in raw.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], lines["data"]))
    return out


async def test_messages_report_the_cache_they_read_apart_from_the_rest(sim: SimServer, http) -> None:
    body = {"model": MODEL, "max_tokens": 3, "system": "S" * 300, "messages": [{"role": "user", "content": "hi"}]}
    status, first = await post(http, sim.url + "/v1/messages", body)
    assert status == 200, first
    assert first["usage"]["cache_read_input_tokens"] == 0 and first["stop_reason"] == "max_tokens"
    status, second = await post(http, sim.url + "/v1/messages", body)
    prompt = first["usage"]["input_tokens"]
    assert second["usage"]["cache_read_input_tokens"] > 300
    assert second["usage"]["cache_read_input_tokens"] + second["usage"]["input_tokens"] == prompt


async def test_a_messages_stream_is_anthropics_event_sequence(sim: SimServer, http) -> None:
    body = {"model": MODEL, "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "hello"}]}
    names = [name for name, _ in await events(http, sim.url + "/v1/messages", body)]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}


async def test_a_stop_sequence_is_named_in_the_answer(sim: SimServer, http) -> None:
    probe = {"model": MODEL, "max_tokens": 40, "messages": [{"role": "user", "content": "stop test"}]}
    _, full = await post(http, sim.url + "/v1/messages", probe)
    word = full["content"][0]["text"].split()[2]
    _, stopped = await post(http, sim.url + "/v1/messages", {**probe, "stop_sequences": [word]})
    assert stopped["stop_reason"] == "stop_sequence" and stopped["stop_sequence"] == word


async def test_responses_count_cached_input_and_stream_their_events(sim: SimServer, http) -> None:
    body = {"model": MODEL, "instructions": "I" * 200, "input": "q", "max_output_tokens": 3}
    await post(http, sim.url + "/v1/responses", body)
    status, again = await post(http, sim.url + "/v1/responses", body)
    assert status == 200 and again["object"] == "response" and again["status"] == "incomplete"
    assert again["usage"]["input_tokens_details"]["cached_tokens"] > 200
    assert again["output"][0]["content"][0]["type"] == "output_text"
    names = [n for n, _ in await events(http, sim.url + "/v1/responses", {**body, "stream": True})]
    assert names[0] == "response.created" and names[-1] == "response.incomplete"
    assert "response.output_text.delta" in names and "response.output_text.done" in names


async def test_responses_are_stored_and_continued_by_previous_response_id(sim: SimServer, http) -> None:
    """The second call's prompt is the first's conversation (its input and output) then its own input: the
    engine serves the first's prompt from cache.  An unknown id is a 404, as on vLLM; store=false keeps none."""
    _, first = await post(http, sim.url + "/v1/responses", {"input": "Q" * 300, "max_output_tokens": 2})
    assert first["store"] is True and first["previous_response_id"] is None
    status, second = await post(
        http, sim.url + "/v1/responses", {"input": "and then?", "previous_response_id": first["id"]}
    )
    assert status == 200 and second["previous_response_id"] == first["id"]
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= 300
    status, answer = await post(http, sim.url + "/v1/responses", {"input": "x", "previous_response_id": "resp_1"})
    assert status == 404 and answer["error"]["code"] == "previous_response_not_found"
    assert "resp_1" in answer["error"]["message"]
    _, unstored = await post(http, sim.url + "/v1/responses", {"input": "y", "store": False})
    status, _ = await post(http, sim.url + "/v1/responses", {"input": "z", "previous_response_id": unstored["id"]})
    assert status == 404
    streamed = await events(http, sim.url + "/v1/responses", {"input": "s", "stream": True})
    created = orjson.loads(streamed[0][1])["response"]["id"]
    status, _ = await post(http, sim.url + "/v1/responses", {"input": "t", "previous_response_id": created})
    assert status == 200  # a streamed response is stored too


async def test_embeddings_are_deterministic_and_base64_is_the_same_vector(sim: SimServer, http) -> None:
    _, floats = await post(http, sim.url + "/v1/embeddings", {"input": ["a b c", "a b c"]})
    assert floats["data"][0]["embedding"] == floats["data"][1]["embedding"]
    _, packed = await post(http, sim.url + "/v1/embeddings", {"input": "a b c", "encoding_format": "base64"})
    raw = base64.b64decode(packed["data"][0]["embedding"])
    unpacked = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert unpacked == pytest.approx(floats["data"][0]["embedding"], abs=1e-6)


async def test_rerank_orders_by_shared_words_and_keeps_top_n(sim: SimServer, http) -> None:
    docs = ["red apple pie", "blue sky", "apple pie recipe"]
    _, answer = await post(http, sim.url + "/rerank", {"query": "apple pie", "documents": docs, "top_n": 2})
    assert {r["index"] for r in answer["results"]} == {0, 2}  # both share the query's words; "blue sky" none
    assert answer["results"][0]["relevance_score"] >= answer["results"][1]["relevance_score"]


async def test_chat_render_answers_the_prompt_token_ids_the_engine_would_run(sim: SimServer, http) -> None:
    """vLLM's ``/v1/chat/completions/render`` (what vLLM's own router asks before a cache-aware choice): the chat
    template applied and tokenized, as ``/v1/tokenize`` does, in a generate request's shape; nothing is run."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    status, rendered = await post(
        http, sim.url + "/v1/chat/completions/render", {"messages": messages, "max_tokens": 7}
    )
    assert status == 200, rendered
    _, tokenized = await post(http, sim.url + "/v1/tokenize", {"messages": messages})
    assert rendered["token_ids"] == tokenized["tokens"] and rendered["token_ids"]
    assert rendered["request_id"].startswith("chatcmpl-") and rendered["sampling_params"]["max_tokens"] == 7
    _, loads = await post(http, sim.url + "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert loads["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the render cached nothing


async def test_completion_render_answers_one_generate_request_per_prompt(sim: SimServer, http) -> None:
    """vLLM's ``/v1/completions/render`` (what vLLM's own router asks before a cache-aware or KV-aware choice of a
    completion): a list of generate requests, one per prompt, with the token ids ``/v1/tokenize`` gives."""
    status, rendered = await post(http, sim.url + "/v1/completions/render", {"prompt": "héllo", "max_tokens": 5})
    assert status == 200 and isinstance(rendered, list) and len(rendered) == 1, rendered
    _, tokenized = await post(http, sim.url + "/v1/tokenize", {"prompt": "héllo"})
    assert rendered[0]["token_ids"] == tokenized["tokens"] and rendered[0]["sampling_params"]["max_tokens"] == 5
    assert rendered[0]["request_id"].startswith("cmpl-") and rendered[0]["model"] == MODEL
    _, two = await post(http, sim.url + "/v1/completions/render", {"prompt": ["ab", "abc"]})
    assert [r["token_ids"] for r in two] == [[97, 98], [97, 98, 99]]
    _, loads = await post(http, sim.url + "/v1/completions", {"prompt": "héllo", "max_tokens": 1})
    assert loads["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the render cached nothing


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions/render", {"messages": "hello"}),
        ("/v1/completions/render", {"prompt": []}),
        ("/v1/completions/render", {"prompt": [1, 2]}),
        ("/v1/completions/render", {"prompt": "x", "max_tokens": 0}),
        ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}),
        ("/v1/embeddings", {"input": {}}),
        ("/v1/rerank", {"query": 1, "documents": []}),
        ("/v1/detokenize", {"tokens": [-1]}),
        ("/v1/tokenize", {}),
        ("/v1/messages", {"messages": [{"role": "user", "content": [1]}]}),
        ("/v1/embeddings", {"model": "other", "input": "x"}),
    ],
)
async def test_bad_bodies_are_openai_shaped_4xx(sim: SimServer, http, path: str, body: dict[str, Any]) -> None:
    status, answer = await post(http, sim.url + path, body)
    assert 400 <= status < 500 and isinstance(answer["error"]["message"], str), answer


@pytest.mark.parametrize("twice", ["model", "file"])
async def test_a_transcription_form_field_given_twice_is_a_400(sim: SimServer, http, twice: str) -> None:
    """A repeated field is not one value of the schema's type: refused, whatever order the parts come in
    (the router reads only the fields before the file, so after it the worker is the one that checks)."""
    form = aiohttp.FormData()
    form.add_field("file", b"RIFF....WAVE", filename="a.wav", content_type="audio/wav")
    form.add_field("model", MODEL)
    form.add_field(twice, MODEL if twice == "model" else b"more", **({} if twice == "model" else {"filename": "b.wav"}))
    async with http.post(sim.url + "/v1/audio/transcriptions", data=form) as resp:
        body = await resp.json()
    assert resp.status == 400 and twice in body["error"]["message"], body


async def test_a_transcription_without_a_model_is_a_400(sim: SimServer, http) -> None:
    form = aiohttp.FormData()
    form.add_field("file", b"RIFF....WAVE", filename="a.wav", content_type="audio/wav")
    async with http.post(sim.url + "/v1/audio/transcriptions", data=form) as resp:
        body = await resp.json()
    assert resp.status == 400 and "model" in body["error"]["message"], body
