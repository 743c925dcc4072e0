"""Every pass-through endpoint end to end: the official clients (openai, anthropic) → smg-router → smg-sim.

The generation endpoints (Messages, Responses) go by the model's policy (cache-aware here: one long system
prompt stays on one worker, whose cache then really holds it); the others go by load, so identical inputs
spread over the workers instead of sticking to one.
"""

from __future__ import annotations

import uuid

import aiohttp
import anthropic
import openai
import pytest
from support.procs import MODEL, Router, Sim, http_json, metric_value


@pytest.fixture
async def client(router: Router):
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0) as c:
        yield c


@pytest.fixture
async def claude(router: Router):
    async with anthropic.AsyncAnthropic(base_url=router.url, api_key="none", max_retries=0) as c:
        yield c


def _requests(router: Router, endpoint: str, status: str = "200") -> float:
    return metric_value(router.metrics(), "smg_requests_total", endpoint=endpoint, model=MODEL, status=status)


async def _post(router: Router, path: str, body: dict) -> tuple[int, dict, str | None]:
    async with aiohttp.ClientSession() as s, s.post(router.url + path, json=body) as r:
        return r.status, await r.json(), r.headers.get("x-smg-worker-id")


# -- by load -------------------------------------------------------------------------------------------


async def test_embeddings_through_the_openai_client_spread_by_load(router: Router, fleet: list[Sim], client) -> None:
    before = _requests(router, "/v1/embeddings")
    text = "the same long input every time " * 30
    served_by = set()
    vectors = []
    for _ in range(6):
        raw = await client.embeddings.with_raw_response.create(model=MODEL, input=[text, "another one"])
        served_by.add(raw.headers["x-smg-worker-id"])
        answer = raw.parse()
        assert [d.index for d in answer.data] == [0, 1]
        vectors.append(answer.data[0].embedding)
    assert len(vectors[0]) == 64 and all(v == vectors[0] for v in vectors)  # deterministic from the text
    assert abs(sum(x * x for x in vectors[0]) - 1.0) < 1e-5
    # a cache-aware choice would keep an identical long input on one worker; by load they spread
    assert len(served_by) >= 2, served_by
    assert _requests(router, "/v1/embeddings") - before == 6


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
async def test_rerank_answers_results_best_first(router: Router, path: str) -> None:
    before = _requests(router, path)
    docs = ["bananas are yellow fruit", "the router sends requests to workers", "cats sleep a lot"]
    status, body, worker = await _post(
        router, path, {"model": MODEL, "query": "which worker does the router send requests to", "documents": docs}
    )
    assert status == 200, body
    assert worker is not None
    assert body["results"][0]["index"] == 1
    scores = [r["relevance_score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True) and len(scores) == 3
    assert _requests(router, path) - before == 1


async def test_score_and_classify_answer_the_vllm_shapes(router: Router) -> None:
    status, body, _ = await _post(router, "/v1/score", {"model": MODEL, "text_1": "a b", "text_2": ["a b", "c d"]})
    assert status == 200, body
    assert [d["index"] for d in body["data"]] == [0, 1] and body["data"][0]["score"] > body["data"][1]["score"]
    status, body, _ = await _post(router, "/v1/classify", {"model": MODEL, "input": ["good", "bad"]})
    assert status == 200, body
    assert len(body["data"]) == 2 and all(d["label"] in ("negative", "positive") for d in body["data"])
    assert _requests(router, "/v1/score") >= 1 and _requests(router, "/v1/classify") >= 1


async def test_tokenize_and_detokenize_round_trip(router: Router) -> None:
    status, body, _ = await _post(router, "/v1/tokenize", {"model": MODEL, "prompt": "héllo"})
    assert status == 200, body
    assert body["count"] == 6 and body["tokens"] == list("héllo".encode()) and body["max_model_len"] > 0  # UTF-8 bytes
    status, back, _ = await _post(router, "/v1/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert status == 200 and back == {"prompt": "héllo"}
    assert _requests(router, "/v1/tokenize") >= 1 and _requests(router, "/v1/detokenize") >= 1


async def test_audio_transcription_through_the_openai_client(router: Router, client) -> None:
    before = _requests(router, "/v1/audio/transcriptions")
    audio = bytes(range(256)) * 400  # 100 KiB: more than the router reads to find the model
    first = await client.audio.transcriptions.create(model=MODEL, file=("speech.wav", audio, "audio/wav"))
    again = await client.audio.transcriptions.create(model=MODEL, file=("speech.wav", audio, "audio/wav"))
    assert first.text and first.text == again.text  # the sim's text is seeded by the bytes it received
    assert first.model_extra["x_smg_sim"]["bytes"] == len(audio)
    assert _requests(router, "/v1/audio/transcriptions") - before == 2


# -- by the model's policy -----------------------------------------------------------------------------


async def test_messages_through_the_anthropic_client_hit_the_cache(router: Router, claude) -> None:
    system = f"You are assistant {uuid.uuid4()}. " + "Be brief. " * 120
    served_by = set()
    for q in range(3):
        raw = await claude.messages.with_raw_response.create(
            model=MODEL, max_tokens=6, system=system, messages=[{"role": "user", "content": f"question {q}"}]
        )
        served_by.add(raw.headers["x-smg-worker-id"])
        message = await raw.parse()
        assert message.type == "message" and message.role == "assistant"
        assert message.content[0].type == "text" and message.content[0].text
        assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 6
    assert len(served_by) == 1  # the cache-aware policy places by the first 1024 chars: the system prompt
    assert message.usage.cache_read_input_tokens > len(system) // 2  # the worker really had the prefix cached
    assert _requests(router, "/v1/messages") >= 3


async def test_messages_stream_through_the_anthropic_client(router: Router, claude) -> None:
    kinds = []
    text = []
    async with claude.messages.stream(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": f"stream {uuid.uuid4()}"}]
    ) as stream:
        async for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta":
                text.append(event.delta.text)
        final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds and kinds.count("content_block_delta") >= 2
    assert final.content[0].text == "".join(text) and final.usage.output_tokens == 8
    ttft = metric_value(router.metrics(), "smg_time_to_first_token_seconds_count", endpoint="/v1/messages")
    assert ttft >= 1


async def test_responses_through_the_openai_client_hit_the_cache(router: Router, client) -> None:
    instructions = f"Instructions {uuid.uuid4()}. " + "Answer in one line. " * 60
    served_by = set()
    for q in range(3):
        raw = await client.responses.with_raw_response.create(
            model=MODEL, instructions=instructions, input=f"question {q}", max_output_tokens=5
        )
        served_by.add(raw.headers["x-smg-worker-id"])
        response = raw.parse()
        assert response.object == "response" and response.output_text
    assert len(served_by) == 1
    assert response.usage.output_tokens == 5
    assert response.usage.input_tokens_details.cached_tokens > len(instructions) // 2
    assert _requests(router, "/v1/responses") >= 3


async def test_responses_stream_through_the_openai_client(router: Router, client) -> None:
    stream = await client.responses.create(
        model=MODEL, input=[{"role": "user", "content": f"stream {uuid.uuid4()}"}], max_output_tokens=6, stream=True
    )
    kinds, deltas, final = [], [], None
    async for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[0] == "response.created" and len(deltas) >= 2
    assert final is not None and final.output_text == "".join(deltas)


# -- errors ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "named"),
    [
        ("/v1/embeddings", {"model": MODEL}, "input"),
        ("/v1/rerank", {"model": MODEL, "query": "q"}, "documents"),
        ("/v1/tokenize", {"model": MODEL}, "prompt or messages"),
        ("/v1/detokenize", {"model": MODEL}, "tokens"),
        ("/v1/messages", {"model": MODEL, "max_tokens": 3}, "messages"),
        ("/v1/messages", {"model": MODEL, "system": 5, "messages": [{"role": "user", "content": "x"}]}, "system"),
        ("/v1/responses", {"model": MODEL}, "input"),
        ("/v1/responses", {"model": MODEL, "input": 7}, "input"),
        ("/v1/embeddings", {"model": 3, "input": "x"}, "model"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(router: Router, path: str, body: dict, named: str) -> None:
    status, answer = http_json("POST", router.url + path, body)
    assert status == 400, answer
    assert answer["error"]["type"] == "invalid_request_error" and named in answer["error"]["message"], answer


def test_an_upload_that_is_not_multipart_is_a_400_saying_so(router: Router) -> None:
    status, answer = http_json("POST", router.url + "/v1/audio/transcriptions", {"model": MODEL})
    assert status == 400 and "multipart/form-data" in answer["error"]["message"], answer


def test_an_unknown_endpoint_is_an_openai_shaped_404_naming_the_path(router: Router) -> None:
    status, answer = http_json("POST", router.url + "/v1/nothing/here", {"model": MODEL})
    assert status == 404
    assert answer["error"] == {
        "message": "Unknown endpoint: POST /v1/nothing/here",
        "type": "not_found_error",
        "code": "unknown_endpoint",
    }


def test_models_lists_every_model_with_its_workers_by_role(router: Router, fleet: list[Sim]) -> None:
    status, answer = http_json("GET", router.url + "/v1/models")
    assert status == 200
    assert answer["object"] == "list"
    (model,) = answer["data"]
    assert model["id"] == MODEL and model["object"] == "model"
    assert model["smg"] == {"roles": {"regular": len(fleet)}, "workers": len(fleet), "routable": len(fleet)}


async def test_by_load_endpoints_read_polled_loads_even_when_no_policy_does(logs, fleet: list[Sim]) -> None:
    """With round_robin for generation nothing else reads load: the by-load slot is a policy slot like the
    others, so the load monitor polls for it and an embeddings request routes on fresh figures."""
    from support.procs import start_router, wait_until

    r = start_router(logs, workers=[s.url for s in fleet], args=["--policy", "round_robin"])
    try:
        r.wait_routable(len(fleet))
        wait_until(lambda: all(w["load"]["backend"] is not None for w in r.workers()), what="a load poll of each")
        for _ in range(4):
            status, body, _ = await _post(r, "/v1/embeddings", {"model": MODEL, "input": "hello"})
            assert status == 200, body
        text = r.metrics()
        assert metric_value(text, "smg_routing_fallbacks_total", policy="least_load", reason="no_load_data") == 0
        assert metric_value(text, "smg_requests_total", endpoint="/v1/embeddings", status="200") == 4
    finally:
        r.stop()
