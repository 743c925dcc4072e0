"""What the router's ``/workers`` says each worker prefills (``Worker.prefilling``, ``prefill_chars``: a request counts
from when it is sent until its answer's first chunk), shown on real ``smg-sim`` engines that prefill slowly."""

from __future__ import annotations

import http.client
import uuid
from pathlib import Path

from support.procs import MODEL, start_router, start_sim, wait_until

SLOW = ["--prefill-tps", "200", "--decode-step-ms", "300"]
"""Simulated seconds at time scale 1: a 1000-char prompt prefills for 5 s, then each token takes 0.3 s."""


def test_a_stream_counts_as_prefilling_until_its_first_chunk_then_as_decoding_until_its_end(
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
        assert busy["load"]["prefill_chars"] >= 1000  # the whole prompt: nobody held any of it
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
