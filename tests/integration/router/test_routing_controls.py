"""Routing controls end to end through smg-router against four smg-sim workers: session keys,
routing tokens, the routed worker's headers and model aliases.  Where a request went is read from the router's
response headers and checked against the workers' own request counts (``sglang:num_requests_total``)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from support.procs import MODEL, Router, Sim, metric_value, start_router, start_sim

KEY = "x-smg-routing-key"


@pytest.fixture(scope="module")
def fleet4(logs: Path) -> Iterator[list[Sim]]:
    sims = [start_sim(logs) for _ in range(4)]
    yield sims
    for s in sims:
        s.stop()


@pytest.fixture
def router4(logs: Path, fleet4: list[Sim]) -> Iterator[Router]:
    r = start_router(logs, workers=[s.url for s in fleet4])
    r.wait_routable(4)
    yield r
    r.stop()


def post(
    router: Router, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, Any, dict[str, str]]:
    """(status, JSON body, response headers) of one POST through ``router``."""
    req = urllib.request.Request(
        router.url + path,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def chat(router: Router, text: str, key: str | None = None, **headers: str) -> tuple[str, str]:
    """(x-smg-worker-id, x-smg-routed-worker-id) of one chat completion."""
    hdrs = {**({KEY: key} if key is not None else {}), **headers}
    status, body, got = post(
        router,
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1},
        hdrs,
    )
    assert status == 200, body
    return got["x-smg-worker-id"], got["x-smg-routed-worker-id"]


def engine_counts(fleet: list[Sim]) -> dict[str, float]:
    """Each worker's own count of the generation requests it received, by URL."""
    out = {}
    for s in fleet:
        with urllib.request.urlopen(s.url + "/metrics", timeout=10) as resp:
            out[s.url] = metric_value(resp.read().decode(), "sglang:num_requests_total")
    return out


def test_one_key_keeps_100_requests_on_one_worker_while_other_keys_spread(router4: Router, fleet4: list[Sim]) -> None:
    ids = {w["url"]: w["id"] for w in router4.workers()}
    before = engine_counts(fleet4)
    served = [chat(router4, f"turn {i} of a conversation {uuid.uuid4()}", key="session-A") for i in range(100)]
    after = engine_counts(fleet4)
    assert len(set(served)) == 1, Counter(served)
    (worker_id, url), _ = Counter(served).most_common(1)[0]
    assert ids[url] == worker_id  # the two headers name the same worker: its id and its URL
    deltas = {u: after[u] - before[u] for u in after}
    assert deltas == {u: 100.0 if u == url else 0.0 for u in deltas}, deltas  # the engines agree
    others = {chat(router4, f"first turn {uuid.uuid4()}", key=f"user-{k}")[1] for k in range(20)}
    assert len(others) >= 3, others
    assert metric_value(router4.metrics(), "smg_routing_decisions_total", model=MODEL, branch="session") == 120


def test_a_key_moves_when_its_worker_is_removed_and_only_then(logs: Path, fleet4: list[Sim]) -> None:
    router = start_router(logs, workers=[s.url for s in fleet4])
    try:
        router.wait_routable(4)
        keys = [f"k-{i}" for i in range(24)]
        home = {k: chat(router, f"hello {uuid.uuid4()}", key=k)[1] for k in keys}
        again = {k: chat(router, f"hello again {uuid.uuid4()}", key=k)[1] for k in keys}
        assert again == home  # nothing changed: nothing moved
        gone = home["k-0"]
        (gone_id,) = [w["id"] for w in router.workers() if w["url"] == gone]
        status, body = router.admin("DELETE", f"/workers/{gone_id}")
        assert status in (200, 202, 204), body
        router.wait_routable(3)
        moved = {k: chat(router, f"after removal {uuid.uuid4()}", key=k)[1] for k in keys}
        for k in keys:
            if home[k] == gone:
                assert moved[k] != gone
            else:
                assert moved[k] == home[k], f"{k} moved from {home[k]} to {moved[k]} though its worker stayed"
        assert moved["k-0"] != gone
    finally:
        router.stop()


def test_two_router_replicas_send_a_key_to_the_same_worker(logs: Path, fleet4: list[Sim]) -> None:
    urls = [s.url for s in fleet4]
    a, b = start_router(logs, workers=urls), start_router(logs, workers=list(reversed(urls)))
    try:
        a.wait_routable(4)
        b.wait_routable(4)
        for k in range(16):
            assert chat(a, f"a {uuid.uuid4()}", key=f"s{k}") == chat(b, f"b {uuid.uuid4()}", key=f"s{k}")
    finally:
        a.stop()
        b.stop()


def test_the_key_header_name_is_configurable_and_empty_turns_keys_off(logs: Path, fleet4: list[Sim]) -> None:
    urls = [s.url for s in fleet4]
    custom = start_router(logs, workers=urls, args=["--routing-key-header", "X-Session-Id"])
    off = start_router(logs, workers=urls, env={"SMG_ROUTING_KEY_HEADER": ""})
    try:
        custom.wait_routable(4)
        off.wait_routable(4)
        pinned = {chat(custom, f"q {uuid.uuid4()}", **{"X-Session-Id": "one"})[1] for _ in range(12)}
        assert len(pinned) == 1
        spread = {chat(off, f"q {uuid.uuid4()}", key="one")[1] for _ in range(12)}  # cache-aware placement
        assert len(spread) >= 2
        assert metric_value(off.metrics(), "smg_routing_decisions_total", branch="session") == 0
    finally:
        custom.stop()
        off.stop()


def test_routing_tokens_replace_the_text_for_cache_aware_routing(router4: Router, fleet4: list[Sim]) -> None:
    """Different texts with the same leading routing tokens go where those tokens went: the router matched the
    tokens, not the text.  A malformed header is a 400 naming it."""
    tokens = ",".join(str(i) for i in range(1000, 2100))  # past placement's 1024 leading chars: one home
    first = chat(router4, f"one text {uuid.uuid4()}", **{"x-smg-routing-tokens": tokens})
    for n in range(8):
        assert chat(router4, f"unrelated {uuid.uuid4()}", **{"x-smg-routing-tokens": tokens + f",{n}"}) == first
    assert metric_value(router4.metrics(), "smg_routing_decisions_total", model=MODEL, branch="hit") >= 8
    status, body, _ = post(
        router4,
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
        {"x-smg-routing-tokens": "1,two,3"},
    )
    assert status == 400 and "x-smg-routing-tokens" in body["error"]["message"], body


async def test_a_model_alias_routes_to_the_served_model_and_the_worker_sees_the_served_name(
    logs: Path, fleet4: list[Sim]
) -> None:
    """smg-sim answers 404 for any model but its own: a 200 shows the body forwarded names the served model."""
    router = start_router(
        logs,
        workers=[s.url for s in fleet4[:2]],
        args=["--model-alias", f"public={MODEL}", "--model-alias", "gpt=public"],
    )
    try:
        router.wait_routable(2)
        for name in ("public", "gpt"):
            status, body, _ = post(
                router, "/v1/completions", {"model": name, "prompt": "hello", "max_tokens": 1, "stream": False}
            )
            assert status == 200, body
            assert body["model"] == MODEL
        status, body, _ = post(router, "/v1/completions", {"model": "nobody", "prompt": "hello"})
        assert status == 404 and "nobody" in body["error"]["message"]
        assert metric_value(router.metrics(), "smg_requests_total", endpoint="/v1/completions", model=MODEL) == 2
        async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0) as client:
            with pytest.raises(openai.BadRequestError) as e:  # streamed through unchanged: no form field rewrite
                await client.audio.transcriptions.create(model="public", file=("a.wav", b"x" * 1000, "audio/wav"))
            assert e.value.code == "alias_not_supported" and MODEL in e.value.message
            served = await client.audio.transcriptions.create(model=MODEL, file=("a.wav", b"x" * 1000, "audio/wav"))
            assert served.text
            listed = {m.id: m.model_extra["smg"] for m in (await client.models.list()).data}
        assert set(listed) == {MODEL, "public", "gpt"}  # every alias beside the model, with its fleet
        assert listed["public"] == {**listed[MODEL], "alias_of": MODEL} and listed["gpt"]["alias_of"] == MODEL
    finally:
        router.stop()


def test_an_alias_is_a_startup_error_when_it_names_the_served_model() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "smg_router", "--model-id", MODEL, "--model-alias", f"{MODEL}=other"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert f"model alias {MODEL} is the name of the served model" in done.stderr


async def test_previous_response_id_goes_to_the_worker_that_stored_the_response(logs: Path, fleet4: list[Sim]) -> None:
    """A chain of stateful Responses calls through the openai client: every call continues the previous one, which
    only the worker that produced it holds (smg-sim answers 404 elsewhere, as vLLM does), streamed or not.  A
    replica that never relayed the id reads its worker from the id's tag; an id without a tag is routed by rendezvous
    of the id, the same worker on every replica."""
    urls = [s.url for s in fleet4]
    a, b, c = (start_router(logs, workers=urls) for _ in range(3))
    try:
        for r in (a, b, c):
            r.wait_routable(4)
        async with openai.AsyncOpenAI(base_url=a.url + "/v1", api_key="none", max_retries=0) as client:
            first = await client.responses.with_raw_response.create(
                model=MODEL, input=f"start {uuid.uuid4()}", max_output_tokens=2
            )
            worker = first.headers["x-smg-worker-id"]
            previous = first.parse().id
            for i in range(10):
                if i % 2:
                    stream = await client.responses.create(
                        model=MODEL, input=f"turn {i}", previous_response_id=previous, stream=True, max_output_tokens=2
                    )
                    async for event in stream:
                        if event.type == "response.completed":
                            assert event.response.previous_response_id == previous
                            previous = event.response.id
                else:
                    raw = await client.responses.with_raw_response.create(
                        model=MODEL, input=f"turn {i}", previous_response_id=previous, max_output_tokens=2
                    )
                    assert raw.headers["x-smg-worker-id"] == worker
                    answer = raw.parse()
                    assert answer.previous_response_id == previous
                    previous = answer.id
        assert metric_value(a.metrics(), "smg_routing_decisions_total", model=MODEL, branch="stored") == 10
        body = {"model": MODEL, "input": "elsewhere", "previous_response_id": previous}
        status_b, answer_b, got_b = post(b, "/v1/responses", body)
        status_c, _, got_c = post(c, "/v1/responses", body)
        assert got_b["x-smg-worker-id"] == got_c["x-smg-worker-id"] == worker  # the id's tag names the worker
        assert status_b == status_c == 200, answer_b
        assert answer_b["previous_response_id"] == previous  # in the form the client sent
        assert metric_value(b.metrics(), "smg_routing_decisions_total", model=MODEL, branch="stored") == 1
        unknown = {**body, "previous_response_id": "resp_" + uuid.uuid4().hex}  # no tag: rendezvous of the id
        status_b, _, got_b = post(b, "/v1/responses", unknown)
        status_c, _, got_c = post(c, "/v1/responses", unknown)
        assert got_b["x-smg-worker-id"] == got_c["x-smg-worker-id"] and status_b == status_c == 404
        assert metric_value(b.metrics(), "smg_routing_decisions_total", model=MODEL, branch="session") == 1
    finally:
        for r in (a, b, c):
            r.stop()
