"""Whose fault it is: a client's slow upload is never a worker's failure, and open breakers never take a whole
model out of routing (past ``--max-ejection-share`` every ready worker serves again: panic routing)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from support.procs import MODEL, http_json, metric_value, start_router, start_sim, wait_until

BOUNDARY = "smgslowupload"
CONTENT_TYPE = f"multipart/form-data; boundary={BOUNDARY}"


async def _slow_form(size: int, rate: int) -> AsyncIterator[bytes]:
    """A transcription form whose file of ``size`` bytes arrives at ``rate`` bytes a second."""
    yield (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="model"\r\n\r\n{MODEL}\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        "Content-Type: audio/wav\r\n\r\n"
    ).encode()
    piece = rate // 4
    for _ in range(size // piece):
        await asyncio.sleep(0.25)
        yield b"\x07" * piece
    yield f"\r\n--{BOUNDARY}--\r\n".encode()


async def test_slow_uploads_open_no_breaker_and_a_plain_chat_still_answers(logs: Path) -> None:
    sims = [start_sim(logs) for _ in range(2)]
    r = start_router(logs, workers=[s.url for s in sims], args=["--first-byte-timeout", "1"])
    try:
        await asyncio.to_thread(r.wait_routable, 2)
        async with aiohttp.ClientSession() as s:

            async def upload() -> int:
                async with s.post(
                    r.url + "/v1/audio/transcriptions",
                    data=_slow_form(6 * 1024, 2 * 1024),  # 3 s at 2 KiB/s: three first-byte timeouts long
                    headers={"Content-Type": CONTENT_TYPE},
                ) as resp:
                    await resp.read()
                    return resp.status

            statuses = await asyncio.gather(*(upload() for _ in range(10)))
            assert statuses == [200] * 10
            assert [w["breaker"] for w in await asyncio.to_thread(r.workers)] == ["closed", "closed"]
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            async with s.post(r.url + "/v1/chat/completions", json=chat) as resp:
                assert resp.status == 200, await resp.text()
    finally:
        r.stop()
        for sim in sims:
            sim.stop()


def test_when_every_breaker_is_open_the_workers_still_serve_and_the_panic_is_counted(logs: Path) -> None:
    bad = [start_sim(logs, extra=["--error-rate", "1"]) for _ in range(2)]
    r = start_router(
        logs,
        workers=[s.url for s in bad],
        args=["--breaker-failure-threshold", "2", "--breaker-cooldown", "60", "--max-retries", "0"],
    )
    try:
        r.wait_routable(2)

        def chat() -> tuple[int, dict]:
            body = {"model": MODEL, "prompt": f"{uuid.uuid4()} breakers", "max_tokens": 1}
            return http_json("POST", r.url + "/v1/completions", body)

        for _ in range(4):
            assert chat()[0] == 500  # the workers' own answer
        assert [w["breaker"] for w in r.workers()] == ["open", "open"]
        status, body = chat()
        assert status == 500, body  # still the workers' answer, not a 503 "no healthy worker"
        assert metric_value(r.metrics(), "smg_breaker_panics_total", model=MODEL, role="regular") >= 1
        assert http_json("GET", r.url + "/readiness")[0] == 200
        for s in bad:
            s.stop()
        good = [start_sim(logs, host=s.host, port=s.port) for s in bad]  # the workers recover
        try:
            wait_until(lambda: chat()[0] == 200, what="a recovered worker to answer")
            assert "closed" in [w["breaker"] for w in r.workers()]  # a success closes a breaker
        finally:
            for s in good:
                s.stop()
    finally:
        r.stop()
        for s in bad:
            s.stop()
