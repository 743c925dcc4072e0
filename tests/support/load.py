"""Background load for backlog tests: long requests held open, cancelled (and so dropped by the worker) on exit."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp

from support.procs import MODEL


@contextlib.asynccontextmanager
async def flood(
    url: str,
    count: int,
    *,
    prompt: str = "hog",
    max_tokens: int = 3000,
    distinct: bool = False,
    path: str = "/v1/completions",
) -> AsyncIterator[list[asyncio.Task[None]]]:
    """``count`` concurrent long requests to ``url`` (a worker or a router) until the block ends.

    The prompts share ``prompt`` as a prefix, unless ``distinct`` puts a different start on each.
    """
    session = aiohttp.ClientSession()

    async def one(i: int) -> None:
        body = {"model": MODEL, "prompt": f"{i}: {prompt}" if distinct else f"{prompt} {i}", "max_tokens": max_tokens}
        with contextlib.suppress(aiohttp.ClientError, asyncio.CancelledError):
            async with session.post(url + path, json=body) as resp:
                await resp.read()

    tasks = [asyncio.create_task(one(i)) for i in range(count)]
    try:
        yield tasks
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await session.close()
