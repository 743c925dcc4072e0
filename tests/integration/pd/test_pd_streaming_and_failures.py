"""PD through the official openai client, and what happens when the prefill worker dies mid-request."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import openai
from support.pd import register_pd, start_decode, start_prefill
from support.procs import MODEL, Router, http_json, metric_value, start_router, wait_until


def test_pd_stream_returns_the_decode_workers_tokens(pd_router: Router, pd_fleet) -> None:
    prefills, decodes = pd_fleet
    register_pd(pd_router, prefills, decodes)
    pd_router.wait_routable(4)
    client = openai.OpenAI(base_url=pd_router.url + "/v1", api_key="none", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        max_tokens=6,
        stream=True,
        messages=[{"role": "user", "content": f"{uuid.uuid4()} stream me " * 10}],
    )
    served_by = raw.headers["x-smg-sim-worker"]
    assert served_by in {d.url.removeprefix("http://") for d in decodes}, served_by
    pieces = [c.choices[0].delta.content or "" for c in raw.parse() if c.choices]
    assert len([p for p in pieces if p]) >= 2
    # completions and /generate batch go through the same dual dispatch
    out = client.completions.create(model=MODEL, prompt=["first item", "second item"], max_tokens=2)
    assert len(out.choices) == 2
    status, body = http_json(
        "POST", pd_router.url + "/generate", {"text": ["a b c", "d e f"], "sampling_params": {"max_new_tokens": 2}}
    )
    assert status == 200 and len(body) == 2, body
    # counted once both legs settled, which may be just after the client has its answer (the prefill leg's end)
    wait_until(
        lambda: metric_value(pd_router.metrics(), "smg_pd_requests_total", status="success") == 3,
        what="three successful dual dispatches counted",
    )
    time.sleep(0.2)
    assert metric_value(pd_router.metrics(), "smg_pd_requests_total", status="success") == 3  # and no more


def test_killing_the_prefill_worker_mid_request_is_a_502_and_frees_the_decode_leg(logs: Path) -> None:
    # a slow prefill (50 uncached tokens/s in real time) leaves time to kill it mid-request
    prefill, bport = start_prefill(logs, time_scale=1.0, extra=["--prefill-tps", "50"])
    decode = start_decode(logs, time_scale=1.0)
    r = start_router(logs, args=["--pd-disaggregation", "--prefill", prefill.url, str(bport), "--decode", decode.url])
    try:
        r.wait_routable(2)
        result: dict[str, object] = {}

        def call() -> None:
            result["answer"] = http_json(
                "POST",
                r.url + "/v1/completions",
                {"model": MODEL, "prompt": "p" * 500, "max_tokens": 5, "stream": True},
                timeout=30,
            )
            result["answered_at"] = time.monotonic()

        t = threading.Thread(target=call)
        t.start()
        wait_until(lambda: all(w["load"]["inflight"] == 1 for w in r.workers()), what="both legs in flight")
        wait_until(
            lambda: http_json("GET", prefill.url + "/v1/loads")[1]["loads"][0]["num_running_reqs"] == 1,
            what="the prefill worker to be prefilling the request",
        )  # 500 tokens at 50/s: 10 s
        prefill.kill()
        killed_at = time.monotonic()
        t.join(timeout=20)
        assert not t.is_alive(), "the request hung after the prefill worker died"
        status, body = result["answer"]
        assert status == 502, body
        assert "prefill" in body["error"]["message"], body
        # answered on the prefill's death, not after the decode side's 10 s bootstrap timeout
        assert result["answered_at"] - killed_at < 10
        # no hung decode leg: the decode worker has nothing running or waiting, the router nothing in flight
        wait_until(
            lambda: (
                http_json("GET", decode.url + "/v1/loads")[1]["loads"][0]["num_running_reqs"] == 0
                and http_json("GET", decode.url + "/v1/loads")[1]["loads"][0]["num_waiting_reqs"] == 0
            ),
            what="the decode worker to drop the request",
        )
        assert all(w["load"]["inflight"] == 0 for w in r.workers())
        assert metric_value(r.metrics(), "smg_pd_requests_total", status="prefill_failed") == 1
        assert http_json("GET", r.url + "/liveness")[0] == 200
    finally:
        r.stop()
        prefill.stop()
        decode.stop()


def test_pd_flags_register_workers_and_env_works(logs: Path, pd_fleet) -> None:
    prefills, decodes = pd_fleet
    env = {
        "SMG_PD_DISAGGREGATION": "true",
        "SMG_PREFILL": ", ".join(f"{s.url} {b}" for s, b in prefills),
        "SMG_DECODE": ",".join(d.url for d in decodes),
        "SMG_PREFILL_POLICY": "round_robin",
    }
    r = start_router(logs, env=env)
    try:
        r.wait_routable(4)
        ports = {w["url"]: w["bootstrap_port"] for w in r.workers() if w["role"] == "prefill"}
        assert ports == {s.url: b for s, b in prefills}
        for _ in range(4):
            assert (
                http_json(
                    "POST", r.url + "/v1/completions", {"model": MODEL, "prompt": "same prompt " * 20, "max_tokens": 1}
                )[0]
                == 200
            )
        pre = [w["load"]["processed"] for w in r.workers() if w["role"] == "prefill"]
        dec = [w["load"]["processed"] for w in r.workers() if w["role"] == "decode"]
        assert pre == [2, 2]  # round robin on the prefill slot
        assert sorted(dec) == [0, 4]  # cache-aware on the decode slot
    finally:
        r.stop()


def test_a_prefill_failing_while_the_decode_stream_is_relayed_ends_it_with_an_error_event(logs: Path) -> None:
    """SGLang's decode worker sends a stream's head at once and then waits for the KV: the prefill leg is still
    watched while that stream is relayed.  Here the prefill worker never answers (its bootstrap room stays empty,
    so the decode worker would wait 30 s) and the router's first-byte timeout fails that leg after 1 s."""
    prefill, bport = start_prefill(logs, time_scale=1.0, extra=["--hang-rate", "1"])
    decode = start_decode(logs, time_scale=1.0, extra=["--stream-head-first", "--bootstrap-timeout", "30"])
    r = start_router(
        logs,
        args=[
            *("--pd-disaggregation", "--prefill", prefill.url, str(bport), "--decode", decode.url),
            *("--first-byte-timeout", "1"),
        ],
    )
    try:
        r.wait_routable(2)
        started = time.monotonic()
        status, body = http_json(
            "POST",
            r.url + "/v1/completions",
            {"model": MODEL, "prompt": "p" * 50, "max_tokens": 5, "stream": True},
            timeout=40,
        )
        took = time.monotonic() - started
        assert status == 200, body  # the decode worker's head went out before the prefill failed
        assert '"code":"prefill_failed"' in body.replace(" ", ""), body
        assert body.rstrip().endswith("data: [DONE]"), body
        assert took < 10, f"the stream waited {took:.1f} s for the decode worker's own bootstrap timeout"
        wait_until(lambda: all(w["load"]["inflight"] == 0 for w in r.workers()), what="no attempt left in flight")
        wait_until(
            lambda: (
                http_json("GET", decode.url + "/v1/loads")[1]["loads"][0]["num_waiting_reqs"] == 0
                and http_json("GET", decode.url + "/v1/loads")[1]["loads"][0]["num_running_reqs"] == 0
            ),
            what="the decode worker to drop the request",
        )
        assert metric_value(r.metrics(), "smg_pd_requests_total", status="prefill_failed") == 1
        assert metric_value(r.metrics(), "smg_pd_requests_total", status="success") == 0
    finally:
        r.stop()
        prefill.stop()
        decode.stop()


def test_an_engine_refusing_the_request_itself_is_passed_on_not_a_502(logs: Path) -> None:
    """A prompt longer than the engines' KV capacity: their own 400, as they wrote it, not a 502 naming a worker."""
    prefill, bport = start_prefill(logs, extra=["--kv-capacity", "64"])
    decode = start_decode(logs, extra=["--kv-capacity", "64"])
    r = start_router(logs, args=["--pd-disaggregation", "--prefill", prefill.url, str(bport), "--decode", decode.url])
    try:
        r.wait_routable(2)
        for stream in (False, True):
            status, body = http_json(
                "POST", r.url + "/v1/completions", {"model": MODEL, "prompt": "p" * 400, "stream": stream}
            )
            assert status == 400, body
            assert "KV capacity" in body["error"]["message"], body
            assert prefill.url not in body["error"]["message"] and decode.url not in body["error"]["message"]
        wait_until(
            lambda: metric_value(r.metrics(), "smg_pd_requests_total", status="refused") == 2,
            what="two refusals counted",
        )
        assert metric_value(r.metrics(), "smg_pd_requests_total", status="prefill_failed") == 0
        assert all(w["breaker"] == "closed" for w in r.workers())
    finally:
        r.stop()
        prefill.stop()
        decode.stop()


def test_a_failing_or_unreachable_worker_is_named_by_its_opaque_id_never_its_address(logs: Path) -> None:
    """A client learns which worker failed (the id `/workers` lists) but never its internal address."""
    prefill, bport = start_prefill(logs, extra=["--error-rate", "1", "--error-status", "500"])
    decode = start_decode(logs)
    r = start_router(
        logs,
        args=[
            "--pd-disaggregation",
            "--prefill",
            prefill.url,
            str(bport),
            "--decode",
            decode.url,
            "--max-retries",
            "0",
        ],
    )
    try:
        r.wait_routable(2)
        ids = {w["url"]: w["id"] for w in r.workers()}
        status, body = http_json(
            "POST", r.url + "/v1/completions", {"model": MODEL, "prompt": "p" * 40, "max_tokens": 2}
        )
        assert status == 502, body
        message = body["error"]["message"]
        assert "500" in message and ids[prefill.url] in message, message
        assert prefill.url.removeprefix("http://") not in message, message
        decode.kill()  # now the decode worker cannot be reached either
        prefill.stop()
        for stream in (False, True):
            status, body = http_json(
                "POST",
                r.url + "/v1/completions",
                {"model": MODEL, "prompt": "q" * 40, "max_tokens": 2, "stream": stream},
            )
            assert status in (502, 503, 504), body
            message = body["error"]["message"]
            for sim in (prefill, decode):
                host_port = sim.url.removeprefix("http://")
                assert host_port not in message and host_port.split(":")[1] not in message, message
    finally:
        r.stop()
        prefill.stop()
        decode.stop()
