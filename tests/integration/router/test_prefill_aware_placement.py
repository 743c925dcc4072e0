"""A router alone places a new prompt where its prefill waits least: engines prefill before they decode, so a
prompt sent to a worker busy prefilling another waits for it (the routing benchmark: unique prompts' TTFT tail against
round_robin).  Shown on real ``smg-sim`` engines: what the router's ``/workers`` says each worker prefills, and
which worker the engine says served each request."""

from __future__ import annotations

import http.client
import uuid
from pathlib import Path

from support.procs import MODEL, start_router, start_sim, wait_until

SLOW = ["--prefill-tps", "200", "--decode-step-ms", "300"]
"""Simulated seconds at time scale 1: a 1000-char prompt prefills for 5 s, then each token takes 0.3 s."""


def test_a_miss_goes_to_the_worker_that_is_not_prefilling_and_a_stream_stops_prefilling_at_its_first_chunk(
    tmp_path: Path,
) -> None:
    sims = [start_sim(tmp_path, time_scale=1.0, extra=SLOW) for _ in range(2)]
    r = start_router(tmp_path, workers=[s.url for s in sims])
    conn = http.client.HTTPConnection(r.host, r.port, timeout=30)
    try:
        r.wait_routable(2)
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=(
                f'{{"model": "{MODEL}", "max_tokens": 4, "stream": true, '
                f'"messages": [{{"role": "user", "content": "{uuid.uuid4()} {"x" * 1000}"}}]}}'
            ),
            headers={"Content-Type": "application/json"},
        )
        stream = conn.getresponse()  # the head: the engine is prefilling now
        assert stream.status == 200
        busy = wait_until(
            lambda: next((w for w in r.workers() if w["load"]["prefilling"] == 1), None), what="a worker prefilling"
        )
        other = next(s.url for s in sims if s.url != busy["url"])
        # each short prompt ranks first on either worker (rendezvous on its text): all go to the idle one
        served = [r.complete(f"{uuid.uuid4()} a short prompt", max_tokens=1) for _ in range(8)]
        assert [s.status for s in served] == [200] * 8
        assert [s.worker_url for s in served] == [other] * 8, (busy["url"], [s.worker_url for s in served])
        assert r.worker(busy["url"])["load"]["prefilling"] == 1  # still prefilling the long prompt
        first = stream.readline()  # the first chunk comes after the prefill: the role
        assert first.startswith(b"data: ") and b'"role"' in first, first
        w = r.worker(busy["url"])["load"]
        assert (w["prefilling"], w["inflight"]) == (0, 1), w  # decoding now: in flight, no longer prefilling
        rest = stream.read()
        assert rest.rstrip().endswith(b"data: [DONE]"), rest[-200:]
        w = r.worker(busy["url"])["load"]
        assert (w["prefilling"], w["inflight"]) == (0, 0), w
    finally:
        conn.close()
        r.stop()
        for s in sims:
            s.stop()
