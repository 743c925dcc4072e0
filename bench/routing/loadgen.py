"""The open-loop load generator: sends a plan at its arrival times, spread over the replicas, and samples the workers.

Request ``i`` goes to replica ``i % replicas`` (client-side round robin, as a Kubernetes Service spreads
connections).  Every request streams, so the time to the first content chunk (TTFT) is measured at the client,
and asks for usage in the last chunk, whose ``prompt_tokens`` and ``prompt_tokens_details.cached_tokens`` are
the worker's own count.  A chat turn waits for the answer of its session's previous turn (a client cannot resend
a history it has not received), so its send time can fall behind its arrival time.  While the plan runs, a
sampler polls every worker's ``/v1/loads`` for its running and waiting requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from workloads import PlannedRequest

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(slots=True)
class Outcome:
    """What happened to one request (times are wall-clock ``perf_counter`` seconds)."""

    index: int
    replica: int
    arrival: float
    sent: float = 0.0
    first: float | None = None
    done: float = 0.0
    status: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    worker: str | None = None
    answer_ok: bool = False
    error: str | None = None


@dataclass(slots=True)
class LoadSamples:
    """Running and waiting requests of each worker, one row per poll."""

    times: list[float] = field(default_factory=list)
    running: list[list[int]] = field(default_factory=list)
    waiting: list[list[int]] = field(default_factory=list)


async def _send(session: aiohttp.ClientSession, url: str, req: PlannedRequest, out: Outcome, *, model: str) -> None:
    out.sent = time.perf_counter()
    text: list[str] = []
    usage: dict[str, Any] | None = None
    try:
        async with session.post(url + PATHS[req.endpoint], json=req.body(model=model)) as resp:
            out.status = resp.status
            out.worker = resp.headers.get("x-smg-sim-worker")
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    piece = (
                        choice.get("text") if req.endpoint == "completions" else choice.get("delta", {}).get("content")
                    )
                    if piece:
                        if out.first is None:
                            out.first = time.perf_counter()
                        text.append(piece)
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        out.done = time.perf_counter()
    if out.error is None:
        if usage is None:
            out.error = "no usage in the stream"
        else:
            out.prompt_tokens = int(usage.get("prompt_tokens", 0))
            details = usage.get("prompt_tokens_details") or {}
            out.cached_tokens = int(details.get("cached_tokens", 0))
            out.answer_ok = "".join(text) == req.answer


async def _sample(session: aiohttp.ClientSession, workers: Sequence[str], into: LoadSamples, interval: float) -> None:
    async def one(url: str) -> tuple[int, int]:
        async with session.get(url + "/v1/loads") as r:
            body = await r.json()
        loads = body["loads"]
        return sum(x["num_running_reqs"] for x in loads), sum(x["num_waiting_reqs"] for x in loads)

    while True:
        try:
            rows = await asyncio.gather(*(one(w) for w in workers))
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError):
            rows = []
        if rows:
            into.times.append(time.perf_counter())
            into.running.append([r for r, _ in rows])
            into.waiting.append([w for _, w in rows])
        await asyncio.sleep(interval)


async def drive(
    plan: Sequence[PlannedRequest],
    offsets: Sequence[float],
    *,
    replicas: Sequence[str],
    workers: Sequence[str],
    model: str,
    request_timeout: float = 300.0,
    sample_interval: float = 0.1,
) -> tuple[list[Outcome], LoadSamples, float]:
    """Send ``plan[i]`` at ``offsets[i]`` wall seconds from now; return the outcomes, the samples and the start."""
    outcomes = [Outcome(r.index, i % len(replicas), offsets[i]) for i, r in enumerate(plan)]
    samples = LoadSamples()
    timeout = aiohttp.ClientTimeout(total=request_timeout)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        sampler = asyncio.create_task(_sample(session, workers, samples, sample_interval), name="load-sampler")
        finished: dict[int, asyncio.Event] = {r.index: asyncio.Event() for r in plan}
        if len(finished) != len(plan):
            raise ValueError("the plan's request indices are not unique")

        async def run(i: int, req: PlannedRequest) -> None:
            try:
                if req.after is not None:
                    await finished[req.after].wait()
                await _send(session, replicas[outcomes[i].replica], req, outcomes[i], model=model)
            finally:
                finished[req.index].set()

        start = time.perf_counter()
        tasks: list[asyncio.Task[None]] = []
        for i, req in enumerate(plan):
            delay = start + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            outcomes[i].arrival = time.perf_counter()
            tasks.append(asyncio.create_task(run(i, req), name=f"request-{i}"))
        await asyncio.gather(*tasks)
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    return outcomes, samples, start
