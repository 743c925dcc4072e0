"""A burst on one new prefix waits for its first prefill (``coordination.Holds``; the routing benchmark's bursty
workload): requests that arrive together with the same leading chars all go to the worker the first one is placed
on, which caches the prefix only once its prefill is done; sent at once, each prefills the whole prefix. Shown on a
real ``smg-sim`` engine by the cached tokens it reports, with the hold and without it (the premise: an engine busy
decoding when the burst arrives admits the whole burst into one prefill step, and caches none of it for the others)."""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import urllib.request
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest
from support.procs import MODEL, Router, Sim, free_ports, metric_value, start_router, start_sim, wait_until
from support.tcp_proxy import CuttableProxy

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


def _burst(
    router: Router | Sequence[Router], prefix: str, size: int = 1 + FOLLOWERS, routed: list[str] | None = None
) -> list[bytes]:
    """The burst: one streamed completion per thread, all sent at once (over several routers: by turns, as a Service
    spreads them); each answer read whole (and the worker each was routed to appended to ``routed``)."""
    routers = router if isinstance(router, Sequence) else [router]
    answers: list[bytes] = [b""] * size
    go = threading.Barrier(size)

    def one(i: int) -> None:
        go.wait()
        conn, resp = _stream(routers[i % len(routers)], f"{prefix}\nquestion {i}: {uuid.uuid4()}", 1)
        try:
            answers[i] = resp.read()
            if routed is not None:
                routed.append(resp.getheader("x-smg-routed-worker-id", ""))
        finally:
            conn.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(size)]
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


def test_a_burst_bigger_than_the_load_gate_stays_whole_on_the_worker_of_its_prefill(tmp_path: Path) -> None:
    """The requests waiting behind a prefill of their prefix are one prefill (``Worker.held``): the load gate (4
    requests over an idle worker) does not count them against a request that joins them, so a burst of 8 on a new
    prefix all goes to the worker that prefills it, and finds it cached there, instead of spilling its last 3 to
    the other worker to prefill the prefix once more."""
    sims = [start_sim(tmp_path, time_scale=1.0, extra=SLOW) for _ in range(2)]
    r = start_router(tmp_path, workers=[s.url for s in sims])
    try:
        r.wait_routable(2)
        routed: list[str] = []
        size = 8
        answers = _burst(r, f"[manual {uuid.uuid4()}] " + "lorem ipsum " * (PREFIX_CHARS // 12), size, routed)
        assert all(a.rstrip().endswith(b"data: [DONE]") for a in answers), [a[-120:] for a in answers]
        assert len(routed) == size and len(set(routed)) == 1, routed
        (holder,) = (s for s in sims if s.url == routed[0])
        assert _cached(holder) >= (size - 1) * PREFIX_CHARS
        text = r.metrics()
        assert metric_value(text, "smg_prefill_holds_total", outcome="released") == size - 1, text
        wait_until(lambda: all(w["load"]["held"] == 0 for w in r.workers()), what="nothing held")
    finally:
        r.stop()
        for s in sims:
            s.stop()


@pytest.mark.parametrize("hold", [True, False])
def test_a_burst_spread_over_two_replicas_waits_for_the_prefill_a_peer_leads(tmp_path: Path, hold: bool) -> None:
    """Replicas with peers: replica A's request leads the first prefill of a new prefix and A tells B (``prefills`` in
    its batch); B's requests on that prefix, hits for B (A's route is in its tree), wait for that prefill as behind
    one of its own, and find the prefix cached.  Without holds (the premise) B sends them at once, the engine admits
    them with A's in one step, and none finds the prefix."""
    sim = start_sim(tmp_path, time_scale=1.0, extra=SLOW)
    ports = free_ports(2)
    off = [] if hold else ["--prefill-hold-seconds", "0"]
    a, b = (
        start_router(tmp_path, workers=[sim.url], port=port, args=[*off, "--peer", f"http://127.0.0.1:{other}"])
        for port, other in zip(ports, reversed(ports), strict=True)
    )
    try:
        for r in (a, b):
            r.wait_routable(1)
            wait_until(lambda r=r: metric_value(r.metrics(), "smg_peers_in_sync") == 1, what="peers in sync")
        conn, background = _stream(a, f"background {uuid.uuid4()}", 4)
        assert background.readline().startswith(b"data: ")  # the engine decodes it: a burst now waits for a step
        before = _cached(sim)
        prefix = f"[manual {uuid.uuid4()}] " + "lorem ipsum " * (PREFIX_CHARS // 12)
        applied = metric_value(b.metrics(), "smg_peer_records_received_total", outcome="applied")
        lead: list[bytes] = []
        leader = threading.Thread(target=lambda: lead.extend(_burst(a, prefix, 1)))
        leader.start()
        told = 2 if hold else 1  # the route, and the lead when there are holds
        wait_until(
            lambda: metric_value(b.metrics(), "smg_peer_records_received_total", outcome="applied") >= applied + told,
            what="B told of A's route",
        )
        answers = _burst(b, prefix, FOLLOWERS)
        leader.join(timeout=60)
        assert all(x.rstrip().endswith(b"data: [DONE]") for x in [*lead, *answers]), [x[-120:] for x in answers]
        cached = _cached(sim) - before
        released = metric_value(b.metrics(), "smg_prefill_holds_total", outcome="released")
        if hold:
            assert cached >= FOLLOWERS * PREFIX_CHARS, cached  # B's requests waited for A's prefill and found it
            assert released == FOLLOWERS
        else:
            assert cached < PREFIX_CHARS, cached  # the premise: admitted with A's, none found the prefix
            assert released == 0
        background.read()
        conn.close()
        for r in (a, b):
            wait_until(lambda r=r: r.worker(sim.url)["load"]["held"] == 0, what="nothing held")
    finally:
        for r in (a, b):
            r.stop()
        sim.stop()


@pytest.mark.parametrize("claim", [True, False])
def test_a_burst_that_reaches_two_replicas_at_once_is_prefilled_once(tmp_path: Path, claim: bool) -> None:
    """A burst spread over replicas A and B at once, their link slow (0.2 s each way): each replica's first request
    would lead a prefill of its own, as neither lead can be told before both went out.  With claims
    (``--prefill-claim-seconds``, wider than the link's delay) the replica with the higher id waits, is told of the
    other's lead, yields, and its requests find the prefix cached: the engine prefills it once.  Without (the
    premise) both leads go out, are admitted in one step, and are prefilled whole."""
    sim = start_sim(tmp_path, time_scale=1.0, extra=SLOW)
    ports = free_ports(2)
    links = [CuttableProxy(("127.0.0.1", port), delay=0.2) for port in reversed(ports)]  # A -> B, B -> A
    window = ["--prefill-claim-seconds", "0.8" if claim else "0"]
    a, b = (
        start_router(tmp_path, workers=[sim.url], port=port, args=[*window, "--peer", f"http://127.0.0.1:{link.port}"])
        for port, link in zip(ports, links, strict=True)
    )
    try:
        for r in (a, b):
            r.wait_routable(1)
            wait_until(lambda r=r: metric_value(r.metrics(), "smg_peers_in_sync") == 1, what="peers in sync")
        conn, background = _stream(a, f"background {uuid.uuid4()}", 4)
        assert background.readline().startswith(b"data: ")  # the engine decodes it: the leads wait for a step
        before = _cached(sim)
        prefix = f"[manual {uuid.uuid4()}] " + "lorem ipsum " * (PREFIX_CHARS // 12)
        answers = _burst([a, b], prefix, 4)  # two requests on each replica
        assert all(x.rstrip().endswith(b"data: [DONE]") for x in answers), [x[-120:] for x in answers]
        cached = _cached(sim) - before
        texts = [a.metrics(), b.metrics()]
        yielded = sum(metric_value(t, "smg_prefill_claims_total", outcome="yielded") for t in texts)
        if claim:
            assert cached >= 3 * PREFIX_CHARS, cached  # one prefill of the prefix: three requests found it
            assert yielded == 1
        else:
            assert cached < 3 * PREFIX_CHARS, cached  # the premise: each replica led a prefill of its own
            assert yielded == 0
        assert sum(metric_value(t, "smg_prefill_holds_total", outcome="timed_out") for t in texts) == 0
        background.read()
        conn.close()
    finally:
        for r in (a, b):
            r.stop()
        for link in links:
            link.close()
        sim.stop()


def test_a_lead_of_a_replica_that_died_mid_prefill_holds_the_others_requests_no_longer(tmp_path: Path) -> None:
    """Replica A leads a long prefill and tells B, then is killed: its end will never be told.  B's requests on that
    prefix wait only until B has heard nothing from A for ``coordination.PEER_SILENCE`` (3.5 s), not for the hold's
    bound (60 s here): they are released, none times out, all are served."""
    sim = start_sim(tmp_path, time_scale=1.0, extra=SLOW)
    ports = free_ports(2)
    a, b = (
        start_router(
            tmp_path,
            workers=[sim.url],
            port=port,
            args=["--prefill-hold-seconds", "60", "--peer", f"http://127.0.0.1:{other}"],
        )
        for port, other in zip(ports, reversed(ports), strict=True)
    )
    try:
        for r in (a, b):
            r.wait_routable(1)
            wait_until(lambda r=r: metric_value(r.metrics(), "smg_peers_in_sync") == 1, what="peers in sync")
        prefix = f"[manual {uuid.uuid4()}] " + "lorem ipsum " * (PREFIX_CHARS // 12)
        applied = metric_value(b.metrics(), "smg_peer_records_received_total", outcome="applied")

        def lead() -> None:
            with contextlib.suppress(OSError, http.client.HTTPException):  # A dies before its answer starts
                conn, resp = _stream(a, f"{prefix}\nquestion: {uuid.uuid4()}", 1)
                try:
                    resp.read()
                finally:
                    conn.close()

        leader = threading.Thread(target=lead, daemon=True)
        leader.start()
        wait_until(
            lambda: metric_value(b.metrics(), "smg_peer_records_received_total", outcome="applied") >= applied + 2,
            what="B told of A's route and lead",
        )
        a.kill()
        answers = _burst(b, prefix, FOLLOWERS)
        assert all(x.rstrip().endswith(b"data: [DONE]") for x in answers), [x[-120:] for x in answers]
        text = b.metrics()
        assert metric_value(text, "smg_prefill_holds_total", outcome="released") == FOLLOWERS, text
        assert metric_value(text, "smg_prefill_holds_total", outcome="timed_out") == 0
    finally:
        for r in (a, b):
            r.stop()
        sim.stop()


def test_a_burst_on_a_prefix_its_worker_holds_stays_whole_there(tmp_path: Path) -> None:
    """A burst on a prefix one worker already holds, sent at once: none of it has started its answer when its 6th
    request is routed, so the load gate counts them as one prefill (``Worker.joining``) and all 8 go to the holder,
    which serves them from its cache.  Counted one by one, the 6th-8th were over the gate (abs 4) and spilled to the
    other worker, which prefilled the prefix once more (the routing benchmark's bursty workload: a group's second
    burst)."""
    sims = [start_sim(tmp_path, time_scale=1.0, extra=SLOW) for _ in range(2)]
    r = start_router(tmp_path, workers=[s.url for s in sims])
    try:
        r.wait_routable(2)
        prefix = f"[manual {uuid.uuid4()}] " + "lorem ipsum " * (PREFIX_CHARS // 12)
        first: list[str] = []
        _burst(r, prefix, 1, first)  # the holder prefills the prefix
        (holder,) = (s for s in sims if s.url == first[0])
        (other,) = (s for s in sims if s is not holder)
        before = _cached(holder), _cached(other)
        routed: list[str] = []
        size = 8
        answers = _burst(r, prefix, size, routed)
        assert all(a.rstrip().endswith(b"data: [DONE]") for a in answers), [a[-120:] for a in answers]
        assert routed == [holder.url] * size, routed
        assert _cached(holder) - before[0] >= size * PREFIX_CHARS
        assert _cached(other) == before[1]
        wait_until(lambda: all(w["load"]["inflight"] == 0 for w in r.workers()), what="nothing in flight")
    finally:
        r.stop()
        for s in sims:
            s.stop()
