"""A burst on one new prefix waits for its first prefill (``attempt.Holds``, issue 11's bursty workload): requests that
arrive together with the same leading chars all go to the worker the first one is placed on, which caches the prefix
only once its prefill is done; sent at once, each prefills the whole prefix.  Shown on a real ``smg-sim`` engine by the
cached tokens it reports, with the hold and without it (the premise: an engine busy decoding when the burst arrives
admits the whole burst into one prefill step, and caches none of it for the others)."""

from __future__ import annotations

import http.client
import json
import threading
import urllib.request
import uuid
from pathlib import Path

import pytest
from support.procs import MODEL, Router, Sim, metric_value, start_router, start_sim, wait_until

SLOW = ["--prefill-tps", "2000", "--decode-step-ms", "1000"]
"""Simulated seconds at time scale 1: the 3000-char prefix prefills for 1.5 s, a decode step takes 1 s (the burst,
sent within a few milliseconds, arrives inside one)."""
PREFIX_CHARS = 3000
FOLLOWERS = 3


def _stream(
    router: Router, prompt: str, max_tokens: int
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection(router.host, router.port, timeout=30)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def _cached(sim: Sim) -> float:
    with urllib.request.urlopen(sim.url + "/metrics", timeout=10) as resp:
        return metric_value(resp.read().decode(), "sglang:cached_tokens_total")


def _burst(router: Router, prefix: str) -> list[bytes]:
    """The burst: one streamed completion per thread, all sent at once; each answer read whole."""
    answers: list[bytes] = [b""] * (1 + FOLLOWERS)
    go = threading.Barrier(1 + FOLLOWERS)

    def one(i: int) -> None:
        go.wait()
        conn, resp = _stream(router, f"{prefix}\nquestion {i}: {uuid.uuid4()}", 1)
        try:
            answers[i] = resp.read()
        finally:
            conn.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(1 + FOLLOWERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return answers


@pytest.mark.parametrize("hold", [True, False])
def test_a_burst_on_a_new_prefix_prefills_it_once_when_it_waits_for_the_first_request(
    tmp_path: Path, hold: bool
) -> None:
    sim = start_sim(tmp_path, time_scale=1.0, extra=SLOW)
    r = start_router(tmp_path, workers=[sim.url], args=[] if hold else ["--prefill-hold-seconds", "0"])
    try:
        r.wait_routable(1)
        # the engine is decoding something else when the burst arrives: it admits the burst at its next step
        conn, background = _stream(r, f"background {uuid.uuid4()}", 4)
        assert background.status == 200
        assert background.readline().startswith(b"data: ")  # the background request is decoding now
        before = _cached(sim)
        answers = _burst(r, f"[manual {uuid.uuid4()}] " + "lorem ipsum " * (PREFIX_CHARS // 12))
        assert all(a.rstrip().endswith(b"data: [DONE]") for a in answers), [a[-120:] for a in answers]
        cached = _cached(sim) - before
        holds = r.metrics()
        released = metric_value(holds, "smg_prefill_holds_total", outcome="released")
        if hold:
            # the first request prefilled the prefix; the others waited for it and found it cached
            assert cached >= FOLLOWERS * PREFIX_CHARS, cached
            assert released == FOLLOWERS, holds
        else:
            assert cached < PREFIX_CHARS, cached  # the premise: admitted together, none found the others' prefix
            assert released == 0
        assert metric_value(holds, "smg_prefill_holds_total", outcome="timed_out") == 0
        background.read()
        conn.close()
        wait_until(lambda: r.worker(sim.url)["load"]["inflight"] == 0, what="nothing in flight")
    finally:
        r.stop()
        sim.stop()


def test_a_request_behind_a_prefill_that_does_not_start_goes_out_after_the_bound(tmp_path: Path) -> None:
    """The hold is bounded: a first request whose prefill outlasts ``--prefill-hold-seconds`` does not hold the others
    any longer (counted as timed_out); they are served, and nothing stays held."""
    sim = start_sim(tmp_path, time_scale=1.0, extra=["--prefill-tps", "500", "--decode-step-ms", "300"])  # 6 s
    r = start_router(tmp_path, workers=[sim.url], args=["--prefill-hold-seconds", "0.5"])
    try:
        r.wait_routable(1)
        answers = _burst(r, f"[manual {uuid.uuid4()}] " + "lorem ipsum " * (PREFIX_CHARS // 12))
        assert all(a.rstrip().endswith(b"data: [DONE]") for a in answers), [a[-120:] for a in answers]
        text = r.metrics()
        assert metric_value(text, "smg_prefill_holds_total", outcome="timed_out") == FOLLOWERS, text
        assert metric_value(text, "smg_prefill_holds_total", outcome="released") == 0
    finally:
        r.stop()
        sim.stop()
