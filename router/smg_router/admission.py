"""The requests the router is answering now: what a graceful shutdown waits for and, at its deadline, ends.

``Proxy.handle`` counts every generation request in and out; ``relay`` registers the task of every stream it
is passing through.  On SIGTERM, ``__main__`` waits for the count to reach zero (up to ``--shutdown-timeout``),
then ``end_streams`` cancels the streams still running: each ends with an error event and ``[DONE]`` instead of
a cut connection.
"""

from __future__ import annotations

import asyncio
import contextlib


class InflightRequests:
    __slots__ = ("_count", "_idle", "_streams", "closing")

    def __init__(self) -> None:
        self._count = 0
        self._idle: asyncio.Event | None = None  # made on first use, inside the running loop
        self._streams: set[asyncio.Task[object]] = set()
        self.closing = False
        """True once ``end_streams`` ran: a cancelled stream then ends with an error event."""

    def __len__(self) -> int:
        return self._count

    def enter(self) -> None:
        self._count += 1
        if self._idle is not None:
            self._idle.clear()

    def exit(self) -> None:
        self._count -= 1
        if self._count == 0 and self._idle is not None:
            self._idle.set()

    async def wait_idle(self, seconds: float) -> bool:
        """Whether every request finished within ``seconds``."""
        if self._count == 0:
            return True
        if self._idle is None:
            self._idle = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._idle.wait()
        return self._count == 0

    def stream_started(self, task: asyncio.Task[object]) -> None:
        self._streams.add(task)

    def stream_ended(self, task: asyncio.Task[object]) -> None:
        self._streams.discard(task)

    def end_streams(self) -> int:
        """Cancel every stream still running; returns how many."""
        self.closing = True
        for task in self._streams:
            task.cancel()
        return len(self._streams)
