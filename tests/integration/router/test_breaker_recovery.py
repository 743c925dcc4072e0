"""Circuit breaker, end to end: a worker that fails its requests opens its breaker and leaves the routing; once
the cooldown has passed and the worker is back, a successful request closes the breaker again.

Real processes on loopback: two ``smg-sim`` workers on their own 127.0.0.x addresses and one ``smg-router``
(round robin, breaker opening after 2 failures).  The failing worker answers every generation request 500
(``--error-rate 1``; its ``/health`` stays 200, so only the breaker takes it out); it "recovers" by being
killed and restarted on the same address without the fault.  Only the router's HTTP API is used.

What half-open admits (one trial or all traffic) is not asserted here; recovery is.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from support.procs import start_router, start_sim, wait_until

COOLDOWN_S = 4.0  # short, yet far longer than the few quick requests sent while the breaker is open


def test_a_failing_worker_opens_its_breaker_and_a_recovered_one_closes_it(logs: Path) -> None:
    good = start_sim(logs)
    bad = start_sim(logs, extra=["--error-rate", "1"])
    r = start_router(
        logs,
        workers=[good.url, bad.url],
        args=[
            "--policy",
            "round_robin",
            "--breaker-failure-threshold",
            "2",
            "--breaker-cooldown",
            str(COOLDOWN_S),
            "--max-retries",
            "2",
        ],
    )
    try:
        r.wait_routable(2)
        assert r.worker(bad.url)["breaker"] == "closed"
        prefix = f"{uuid.uuid4()} breaker "

        def request_then_breaker_state() -> str:
            answer = r.complete(prefix + "opening")
            assert answer.status == 200, answer  # the failure on the bad worker is retried on the good one
            assert answer.worker_url == good.url, answer
            return str(r.worker(bad.url)["breaker"])

        wait_until(lambda: request_then_breaker_state() == "open", what="the bad worker's breaker to open")
        opened = r.worker(bad.url)
        assert opened["breaker"] == "open" and opened["routable"] is False, opened
        assert opened["status"] == "ready", opened  # healthy by its probes: the breaker alone keeps it out
        processed = opened["load"]["processed"]
        for i in range(4):
            answer = r.complete(prefix + f"while open {i}")
            assert answer.status == 200 and answer.worker_url == good.url, answer
        assert r.worker(bad.url)["load"]["processed"] == processed  # an open breaker: not even tried

        bad.kill()
        recovered = start_sim(logs, host=bad.host, port=bad.port)  # same address, no fault
        try:
            half_open = wait_until(
                lambda: (w := r.worker(bad.url))["breaker"] == "half_open" and w["status"] == "ready" and w,
                timeout=COOLDOWN_S + 30,
                what="the cooldown to pass and the restarted worker to be healthy",
            )
            assert half_open["routable"] is True, half_open

            def served_by_recovered() -> bool:
                answer = r.complete(prefix + "recovering")
                assert answer.status == 200, answer
                return answer.worker_url == recovered.url

            wait_until(served_by_recovered, what="a request served by the recovered worker")
            closed = r.worker(bad.url)
            assert closed["breaker"] == "closed" and closed["routable"] is True, closed
            served = [r.complete(prefix + f"closed {i}") for i in range(2)]
            assert all(a.status == 200 for a in served), served
            assert {a.worker_url for a in served} == {good.url, recovered.url}  # round robin over both again
        finally:
            recovered.stop()
    finally:
        r.stop()
        good.stop()
        bad.stop()
