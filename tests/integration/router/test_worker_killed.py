"""A worker killed (SIGKILL) mid-run: no non-streaming request is lost, its streams end with an error event."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import aiohttp
from support.procs import MODEL, Router, start_router, start_sim, wait_until


async def _complete(s: aiohttp.ClientSession, url: str, *, stream: bool, max_tokens: int) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": f"{uuid.uuid4()} a story", "max_tokens": max_tokens, "stream": stream}
    async with s.post(url + "/v1/completions", json=body) as resp:
        raw = await resp.read()
        worker = resp.headers.get("x-smg-worker-id")
    if not stream:
        return {"status": resp.status, "body": json.loads(raw), "worker": worker}
    events = [line[len("data: ") :] for line in raw.decode().splitlines() if line.startswith("data: ")]
    return {"status": resp.status, "events": events, "worker": worker}


def _inflight(router: Router) -> int:
    return sum(w["load"]["inflight"] for w in router.workers())


async def test_a_worker_killed_mid_run_loses_no_request_and_ends_its_streams_cleanly(logs: Path) -> None:
    victim, survivor = start_sim(logs, time_scale=1.0), start_sim(logs, time_scale=1.0)
    r = start_router(logs, workers=[victim.url, survivor.url], args=["--policy", "round_robin"])
    try:
        r.wait_routable(2)
        ids = {w["url"]: w["id"] for w in r.workers()}
        async with aiohttp.ClientSession() as s:
            jobs = [asyncio.ensure_future(_complete(s, r.url, stream=i % 3 == 0, max_tokens=150)) for i in range(30)]
            await asyncio.to_thread(wait_until, lambda: _inflight(r) == 30, what="30 requests in flight")
            victim.kill()
            results = await asyncio.gather(*jobs)
            after = await asyncio.gather(*(_complete(s, r.url, stream=False, max_tokens=2) for _ in range(10)))
        cut = 0
        for res in results:
            assert res["status"] == 200, res
            if "body" in res:  # retried before the first byte, wherever it was
                assert res["body"]["choices"][0]["finish_reason"] == "length", res
                continue
            assert res["events"][-1] == "[DONE]", res["events"][-3:]
            if res["worker"] == ids[victim.url]:
                cut += 1
                assert json.loads(res["events"][-2])["error"]["code"] == "upstream_disconnected"
            else:
                assert not any('"error"' in e for e in res["events"])
        assert cut >= 1  # round robin put some of the ten streams on the victim, and each of them was cut
        assert all(a["status"] == 200 and a["worker"] == ids[survivor.url] for a in after), after
        assert "Traceback" not in r.log()
    finally:
        r.stop()
        victim.stop()
        survivor.stop()
