"""The imbalance fallback reads the workers' real backlog, not the router's own in-flight count."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from pathlib import Path

import aiohttp
from support.procs import MODEL, metric_value, start_router, start_sim, wait_until


async def test_backlog_on_a_worker_makes_new_requests_go_to_the_least_loaded(logs: Path) -> None:
    sims = [start_sim(logs, time_scale=1.0, extra=["--max-running", "2"]) for _ in range(2)]
    r = start_router(logs, workers=[s.url for s in sims])  # engines of 2 running slots (reported in /v1/loads)
    flood: list[asyncio.Task] = []
    try:
        r.wait_routable(2)
        prompt = f"{uuid.uuid4()} long shared document " * 40
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        async with aiohttp.ClientSession() as s:
            async with s.post(r.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                holder_id = resp.headers["x-smg-worker-id"]
            holder = next(w for w in r.workers() if w["id"] == holder_id)
            other = next(w for w in r.workers() if w["id"] != holder_id)

            # Someone else (another router, a direct client) floods the holder: 30 long requests.
            async def hog() -> None:
                with contextlib.suppress(aiohttp.ClientError, asyncio.CancelledError):
                    async with s.post(
                        holder["url"] + "/v1/completions", json={"model": MODEL, "prompt": "hog", "max_tokens": 2000}
                    ) as resp:
                        await resp.read()

            flood = [asyncio.create_task(hog()) for _ in range(30)]

            def backlog_seen() -> bool:
                w = next(w for w in r.workers() if w["id"] == holder_id)
                return (w["load"]["backend"] or 0) >= 25

            await asyncio.to_thread(wait_until, backlog_seen, what="the router to poll the holder's backlog")
            before = metric_value(r.metrics(), "smg_routing_fallbacks_total", reason="imbalance")
            for _ in range(4):
                async with s.post(r.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    assert resp.headers["x-smg-worker-id"] == other["id"]
            after = metric_value(
                r.metrics(),
                "smg_routing_fallbacks_total",
                reason="imbalance",
                model=MODEL,
                role="regular",
                policy="cache_aware",
            )
            # the first spilled off the overloaded holder (and was inserted for the other worker), the next three
            # were hits on the other worker, which now held the prefix too
            assert after - before == 1
            decisions = {
                b: metric_value(r.metrics(), "smg_routing_decisions_total", model=MODEL, role="regular", branch=b)
                for b in ("hit", "miss", "spill")
            }
            assert decisions == {"hit": 3, "miss": 1, "spill": 1}, decisions
            # the router itself has nothing in flight on the holder: the decision came from the backlog
            assert next(w for w in r.workers() if w["id"] == holder_id)["load"]["inflight"] == 0
            for t in flood:
                t.cancel()
            await asyncio.gather(*flood, return_exceptions=True)
    finally:
        for t in flood:
            t.cancel()
        r.stop()
        for sim in sims:
            sim.stop()
