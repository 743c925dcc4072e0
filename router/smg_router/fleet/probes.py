"""The control-plane HTTP client: the GETs of health checks, model discovery and load polls.

One small interface (``get`` → status and body, or None when the worker cannot be reached in time) so
the checkers never handle aiohttp's exceptions themselves, and so the pool behind them can change
without touching them.  It exists from construction; ``start`` opens its connection pool.
"""

from __future__ import annotations

import aiohttp


class ProbeClient:
    def __init__(self, *, limit: int = 64) -> None:
        self._limit = limit
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self._limit))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def get(self, url: str, *, seconds: float) -> tuple[int, bytes] | None:
        """(status, body) within ``seconds``, or None on a connection error or timeout (and before ``start``)."""
        if self._session is None:
            return None
        try:
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=seconds)) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None
