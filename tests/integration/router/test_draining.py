"""Draining through the lifecycle API: ``PATCH /workers/{id} {"draining": true}`` takes a worker out of routing
while the requests it already has finish normally; ``{"draining": false}`` makes it routable again.

Real processes on loopback: two ``smg-sim`` workers on their own 127.0.0.x addresses and one ``smg-router``
(round robin, so "routable again" shows in the very next requests).  Only the router's HTTP API is used.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

from support.procs import Served, start_router, start_sim, wait_until

LONG_TOKENS = 150  # 150 decode steps of 20 ms: about 3 s in flight, far longer than the checks made meanwhile


def test_a_draining_worker_gets_no_new_requests_finishes_its_own_and_comes_back(logs: Path) -> None:
    sims = [start_sim(logs, time_scale=1.0, extra=["--decode-step-ms", "20"]) for _ in range(2)]
    r = start_router(logs, workers=[s.url for s in sims], args=["--policy", "round_robin"])
    try:
        r.wait_routable(2)
        prefix = f"{uuid.uuid4()} drain me "
        long_answer: list[Served] = []
        t = threading.Thread(target=lambda: long_answer.append(r.complete(prefix + "long", max_tokens=LONG_TOKENS)))
        t.start()
        victim = wait_until(
            lambda: next((w for w in r.workers() if w["load"]["inflight"] == 1), None),
            what="the long request in flight on one worker",
        )
        (other,) = [s.url for s in sims if s.url != victim["url"]]

        status, drained = r.admin("PATCH", f"/workers/{victim['id']}", {"draining": True})
        assert status == 200, drained
        assert drained["status"] == "draining" and drained["routable"] is False, drained
        assert drained["load"]["inflight"] == 1, "the long request was in flight when draining began"
        processed = drained["load"]["processed"]

        for i in range(6):
            answer = r.complete(prefix + str(i))
            assert answer.status == 200, answer
            assert answer.worker_url == other, answer
        assert r.worker(victim["url"])["load"]["processed"] == processed  # not even tried

        t.join(timeout=60)
        assert not t.is_alive(), "the in-flight request on the draining worker never finished"
        (long,) = long_answer
        assert long.status == 200, long
        assert long.worker_url == victim["url"]
        assert long.body["usage"]["completion_tokens"] == LONG_TOKENS  # finished in full, not cut off
        after = r.worker(victim["url"])
        assert after["status"] == "draining" and after["load"]["inflight"] == 0, after

        status, back = r.admin("PATCH", f"/workers/{victim['id']}", {"draining": False})
        assert status == 200, back
        assert back["status"] == "ready" and back["routable"] is True, back
        served = [r.complete(prefix + f"again {i}") for i in range(2)]
        assert all(a.status == 200 for a in served), served
        assert {a.worker_url for a in served} == {victim["url"], other}  # round robin over both again
    finally:
        r.stop()
        for s in sims:
            s.stop()
