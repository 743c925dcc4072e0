"""vLLM prefill/decode over plain HTTP (``--pd-mode vllm``) through the router, against smg-sim's vLLM roles:
the prefill leg with max_tokens 1 and kv_transfer_params, the decode leg with what the prefill returned, the
failures (wrong pairing, no transfer parameters, a dead prefill worker), retries, lifecycle and metrics."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from smg_router.settings import parse_settings
from support.pd_vllm import (
    generated_tokens,
    held_kv,
    register,
    requests_seen,
    start_vllm_decode,
    start_vllm_prefill,
)
from support.procs import MODEL, Router, Sim, http_json, metric_value, start_router, start_sim, wait_until

VLLM = ["--pd-disaggregation", "--pd-mode", "vllm"]


@pytest.fixture(scope="module")
def vllm_fleet(logs: Path) -> Iterator[tuple[list[Sim], list[Sim]]]:
    prefills = [start_vllm_prefill(logs) for _ in range(2)]
    decodes = [start_vllm_decode(logs) for _ in range(2)]
    yield prefills, decodes
    for sim in (*prefills, *decodes):
        sim.stop()


@pytest.fixture
def vllm_router(logs: Path, vllm_fleet) -> Iterator[Router]:
    """A vLLM-mode PD router started empty; the test registers the workers through POST /workers."""
    r = start_router(logs, args=VLLM, admin_key="pd-key")
    yield r
    r.stop()


def _client(router: Router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)


def _decode_ids(decodes: list[Sim]) -> set[str]:
    return {d.url.removeprefix("http://") for d in decodes}


def test_vllm_pd_serves_chat_and_completions_streamed_and_not(vllm_router: Router, vllm_fleet) -> None:
    prefills, decodes = vllm_fleet
    register(vllm_router, prefills, decodes)
    vllm_router.wait_routable(4)
    assert http_json("GET", vllm_router.url + "/readiness")[0] == 200
    client = _client(vllm_router)
    before = sum(generated_tokens(p) for p in prefills)

    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, max_completion_tokens=6, messages=[{"role": "user", "content": f"{uuid.uuid4()} hello " * 10}]
    )
    assert raw.headers["x-smg-sim-worker"] in _decode_ids(decodes)
    reply = raw.parse()
    assert reply.usage.completion_tokens == 6  # the decode answer, not the prefill's one token
    # the decode read the whole prompt's KV from the prefill: cached as vLLM reports it
    assert reply.usage.prompt_tokens_details.cached_tokens == reply.usage.prompt_tokens

    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": f"{uuid.uuid4()} stream me " * 10}],
    )
    assert raw.headers["x-smg-sim-worker"] in _decode_ids(decodes)
    chunks = list(raw.parse())
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 2
    assert chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == chunks[-1].usage.prompt_tokens

    done = client.completions.create(model=MODEL, prompt=f"{uuid.uuid4()} complete " * 8, max_tokens=4)
    assert done.usage.completion_tokens == 4 and done.choices[0].text
    pieces = [
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt=f"{uuid.uuid4()} stream " * 8, max_tokens=4, stream=True)
        if c.choices
    ]
    assert "".join(pieces)

    # each prefill leg asked for one token (max_tokens 1), whatever the client asked
    assert sum(generated_tokens(p) for p in prefills) - before == 4
    # and every KV the prefills held was read by a decode
    assert all(held_kv(p) == [] for p in prefills)
    text = vllm_router.metrics()
    assert metric_value(text, "smg_pd_requests_total", status="success") == 4
    for role in ("prefill", "decode"):  # per-role routing metrics, as in the bootstrap mode
        decided = metric_value(text, "smg_cache_tree_hits_total", model=MODEL, role=role) + metric_value(
            text, "smg_cache_tree_misses_total", model=MODEL, role=role
        )
        assert decided == 4, (role, decided)
        assert metric_value(text, "smg_worker_lifecycle_events_total", event="added", role=role) == 2
    assert metric_value(text, "smg_routing_fallbacks_total", reason="no_tree") == 0


def test_vllm_pd_lifecycle_removal_and_readd_keep_both_slots_routing(vllm_router: Router, vllm_fleet) -> None:
    prefills, decodes = vllm_fleet
    register(vllm_router, prefills, decodes)
    vllm_router.wait_routable(4)
    client = _client(vllm_router)
    prefix = f"{uuid.uuid4()} Shared system prompt. " * 20

    def ask(i: int) -> None:
        reply = client.chat.completions.create(
            model=MODEL,
            max_tokens=2,
            messages=[{"role": "system", "content": prefix}, {"role": "user", "content": f"question {i}"}],
        )
        assert reply.choices[0].message.content

    for i in range(3):
        ask(i)
    pre = {w["url"]: w for w in vllm_router.workers() if w["role"] == "prefill"}
    holder = max(pre.values(), key=lambda w: w["load"]["processed"])
    assert holder["load"]["processed"] == 3  # cache-aware on the prefill slot: one prefix, one worker
    status, _ = vllm_router.admin("DELETE", f"/workers/{holder['id']}")
    assert status == 200
    text = vllm_router.metrics()
    assert f'worker="{holder["url"]}"' not in text
    for i in range(3, 5):
        ask(i)
    survivor = next(w for w in vllm_router.workers() if w["role"] == "prefill")
    assert survivor["url"] != holder["url"] and survivor["load"]["processed"] >= 2
    status, again = vllm_router.admin("POST", "/workers", {"url": holder["url"], "role": "prefill", "model_id": MODEL})
    assert status == 201 and again["status"] == "ready"
    ask(5)
    text = vllm_router.metrics()
    assert metric_value(text, "smg_worker_lifecycle_events_total", event="removed", role="prefill") == 1
    assert metric_value(text, "smg_pd_requests_total", status="success") == 6
    assert metric_value(text, "smg_routing_fallbacks_total", reason="no_tree") == 0


def test_a_prefill_worker_without_kv_transfer_params_is_a_502_and_decode_is_not_asked(logs: Path) -> None:
    plain = start_sim(logs)  # an engine without a KV connector: it ignores kv_transfer_params
    decode = start_vllm_decode(logs)
    r = start_router(logs, args=[*VLLM, "--prefill", plain.url, "--decode", decode.url])
    try:
        r.wait_routable(2)
        status, body = http_json(
            "POST", r.url + "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        )
        assert status == 502, body
        assert body["error"]["code"] == "missing_kv_transfer_params"
        ids = {w["url"]: w["id"] for w in r.workers()}
        assert ids[plain.url] in body["error"]["message"] and "kv_transfer_params" in body["error"]["message"]
        assert plain.url not in body["error"]["message"]  # its opaque id, never its address
        assert requests_seen(decode) == 0
        assert metric_value(r.metrics(), "smg_pd_requests_total", status="prefill_failed") == 1
    finally:
        r.stop()
        plain.stop()
        decode.stop()


def test_a_router_in_the_wrong_pd_mode_fails_clearly_at_the_vllm_decode(logs: Path, vllm_fleet) -> None:
    """The default (SGLang bootstrap) mode sends the decode worker no kv_transfer_params: the engine's own refusal,
    passed on as it wrote it (as every 4xx of an engine is), says what it needs; the router counts it refused."""
    prefills, decodes = vllm_fleet
    r = start_router(logs, args=["--pd-disaggregation", "--prefill", prefills[0].url, "--decode", decodes[0].url])
    try:
        r.wait_routable(2)
        status, body = http_json(
            "POST", r.url + "/v1/completions", {"model": MODEL, "prompt": "wrong pairing", "max_tokens": 2}
        )
        assert status == 400, body
        assert body["error"]["code"] == "missing_kv_transfer_params"
        assert "do_remote_prefill" in body["error"]["message"]
        assert metric_value(r.metrics(), "smg_pd_requests_total", status="refused") == 1
    finally:
        r.stop()


def test_a_dead_prefill_worker_is_retried_on_another_then_a_502_naming_it(logs: Path) -> None:
    doomed, spare = start_vllm_prefill(logs), start_vllm_prefill(logs)
    decode = start_vllm_decode(logs)
    r = start_router(
        logs,
        args=[*VLLM, "--prefill-policy", "round_robin", "--health-check-interval", "60", "--decode", decode.url],
        admin_key="k",
    )
    try:
        register(r, [doomed, spare], [])
        r.wait_routable(3)
        doomed.kill()  # the router has not noticed: its next health probe is a minute away
        for i in range(4):  # round robin: some of these try the dead worker first
            status, body = http_json(
                "POST", r.url + "/v1/completions", {"model": MODEL, "prompt": f"retry {i} " * 5, "max_tokens": 3}
            )
            assert status == 200, body
            assert body["usage"]["completion_tokens"] == 3
        text = r.metrics()
        assert metric_value(text, "smg_retries_total", endpoint="/v1/completions") >= 1
        assert metric_value(text, "smg_pd_requests_total", status="success") == 4

        spare.kill()  # no prefill worker left alive: a 502 naming the worker, and the decode is not asked
        seen = requests_seen(decode)
        status, body = http_json(
            "POST", r.url + "/v1/completions", {"model": MODEL, "prompt": "nobody prefills", "max_tokens": 3}
        )
        assert status == 502, body
        assert body["error"]["code"] == "prefill_failed"
        assert (
            "prefill worker" in body["error"]["message"] and "decode worker was not asked" in body["error"]["message"]
        )
        ids = {w["url"]: w["id"] for w in r.workers()}
        assert ids[doomed.url] in body["error"]["message"] or ids[spare.url] in body["error"]["message"]
        assert requests_seen(decode) == seen
        wait_until(lambda: all(w["load"]["inflight"] == 0 for w in r.workers()), what="no attempt left in flight")
    finally:
        r.stop()
        for sim in (doomed, spare, decode):
            sim.stop()


def test_what_cannot_be_split_is_refused_and_a_prefill_refusal_is_passed_on(logs: Path, vllm_fleet) -> None:
    _, decodes = vllm_fleet
    small = start_vllm_prefill(logs, extra=["--kv-capacity", "64"])
    r = start_router(logs, args=[*VLLM, "--prefill", small.url, "--decode", decodes[0].url])
    try:
        r.wait_routable(2)
        status, body = http_json(
            "POST", r.url + "/v1/completions", {"model": MODEL, "prompt": ["one", "two"], "max_tokens": 2}
        )
        assert status == 400 and "one prompt per request" in body["error"]["message"], body
        status, body = http_json("POST", r.url + "/generate", {"text": "sglang only", "sampling_params": {}})
        assert status == 501 and "vLLM PD mode" in body["error"]["message"], body
        status, body = http_json(
            "POST",
            r.url + "/v1/completions",
            {"model": MODEL, "prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}},
        )
        assert status == 400 and "kv_transfer_params" in body["error"]["message"], body
        # too long for the prefill engine: its own 400, as it wrote it, and no decode leg
        seen = requests_seen(decodes[0])
        status, body = http_json("POST", r.url + "/v1/completions", {"model": MODEL, "prompt": "p" * 100})
        assert status == 400 and "KV capacity" in body["error"]["message"], body
        assert requests_seen(decodes[0]) == seen
        assert metric_value(r.metrics(), "smg_pd_requests_total", status="refused") == 1
        assert metric_value(r.metrics(), "smg_pd_requests_total", status="prefill_failed") == 0
    finally:
        r.stop()
        small.stop()


def test_a_hung_prefill_worker_times_out_into_a_502_naming_its_id(logs: Path) -> None:
    hung = start_vllm_prefill(logs, extra=["--hang-rate", "1"])
    decode = start_vllm_decode(logs)
    r = start_router(
        logs,
        args=[*VLLM, "--max-retries", "0", "--first-byte-timeout", "1", "--prefill", hung.url, "--decode", decode.url],
    )
    try:
        r.wait_routable(2)
        status, body = http_json("POST", r.url + "/v1/completions", {"model": MODEL, "prompt": "hang", "max_tokens": 2})
        assert status == 502, body
        ids = {w["url"]: w["id"] for w in r.workers()}
        assert body["error"]["code"] == "prefill_failed" and ids[hung.url] in body["error"]["message"], body
        assert requests_seen(decode) == 0
        wait_until(lambda: all(w["load"]["inflight"] == 0 for w in r.workers()), what="no attempt left in flight")
    finally:
        r.stop()
        hung.stop()
        decode.stop()


def test_sglang_stays_the_default_pd_mode_and_vllm_needs_pd(monkeypatch, capsys) -> None:
    assert parse_settings(["--pd-disaggregation"]).pd.mode == "sglang"
    assert parse_settings(["--pd-disaggregation", "--pd-mode", "vllm"]).pd.mode == "vllm"
    monkeypatch.setenv("SMG_PD_MODE", "vllm")
    assert parse_settings(["--pd-disaggregation"]).pd.mode == "vllm"
    for argv in (["--pd-mode", "vllm"], ["--pd-disaggregation", "--pd-mode", "nixl"]):
        with pytest.raises(SystemExit):
            parse_settings(argv)
    err = capsys.readouterr().err
    assert "--pd-mode needs --pd-disaggregation" in err and "'nixl'" in err
