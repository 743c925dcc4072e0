"""A worker answering 500: its breaker opens, half-open admits exactly one trial, the trial's outcome decides."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import aiohttp
from aiohttp import web
from support.inproc_worker import serving
from support.procs import MODEL, Router, start_router, start_sim, wait_until


class FlakyWorker:
    """An in-process worker that counts completions and answers them 500 (slowly) or 200 as told."""

    def __init__(self, *, status: int = 500) -> None:
        self.failing = True
        self.status = status
        self.hits = 0

    async def completions(self, request: web.Request) -> web.Response:
        await request.read()
        self.hits += 1
        if self.failing:
            await asyncio.sleep(0.5)  # the trial stays in flight while other requests arrive
            return web.json_response({"error": {"message": "boom"}}, status=self.status)
        return web.json_response(
            {
                "id": "x",
                "object": "text_completion",
                "model": MODEL,
                "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
            }
        )

    def serving(self, host: str) -> contextlib.AbstractAsyncContextManager[str]:
        return serving(host, {"/v1/completions": self.completions})


def _breaker(router: Router, url: str) -> str:
    return next(w["breaker"] for w in router.workers() if w["url"] == url)


async def _post_all(router: Router, n: int) -> list[int]:
    async with aiohttp.ClientSession() as s:

        async def one(i: int) -> int:
            body = {"model": MODEL, "prompt": f"p{i}", "max_tokens": 1}
            async with s.post(router.url + "/v1/completions", json=body) as resp:
                await resp.read()
                return resp.status

        return list(await asyncio.gather(*(one(i) for i in range(n))))


async def test_half_open_admits_exactly_one_trial_and_its_outcome_decides(logs: Path) -> None:
    flaky = FlakyWorker()
    good = start_sim(logs)
    async with flaky.serving("127.0.0.93") as bad_url:
        r = start_router(
            logs,
            workers=[good.url, bad_url],
            args=[
                "--policy",
                "round_robin",
                "--breaker-failure-threshold",
                "2",
                "--breaker-cooldown",
                "1",
                "--max-retries",
                "1",
            ],
        )
        try:
            await asyncio.to_thread(r.wait_routable, 2)
            for _ in range(10):  # failures are retried on the good worker
                assert await _post_all(r, 2) == [200, 200]
                if _breaker(r, bad_url) == "open":
                    break
            assert _breaker(r, bad_url) == "open"
            await asyncio.to_thread(
                wait_until, lambda: _breaker(r, bad_url) == "half_open", what="the cooldown to pass"
            )
            flaky.hits = 0
            assert await _post_all(r, 10) == [200] * 10
            assert flaky.hits == 1  # one trial; the other nine went to the good worker while it ran
            assert _breaker(r, bad_url) == "open"  # the failed trial re-opened it

            flaky.failing = False
            await asyncio.to_thread(
                wait_until, lambda: _breaker(r, bad_url) == "half_open", what="the second cooldown to pass"
            )
            flaky.hits = 0
            assert await _post_all(r, 4) == [200] * 4
            assert flaky.hits >= 1
            assert _breaker(r, bad_url) == "closed"  # the good trial closed it
        finally:
            r.stop()
            good.stop()


async def test_a_worker_answering_429_is_passed_on_but_never_opens_its_breaker(logs: Path) -> None:
    busy = FlakyWorker(status=429)
    async with busy.serving("127.0.0.97") as url:
        r = start_router(logs, workers=[url], args=["--breaker-failure-threshold", "2"])  # retries on (2)
        try:
            await asyncio.to_thread(r.wait_routable, 1)
            assert await _post_all(r, 6) == [429] * 6  # no other worker to try: back-pressure reaches the client
            assert busy.hits == 6 and _breaker(r, url) == "closed"  # three times the threshold, still closed
            busy.failing = False
            assert await _post_all(r, 2) == [200, 200]
        finally:
            r.stop()
