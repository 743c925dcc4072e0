"""What the router lets in, and what it is answering now.

Every generation request is admitted before its body is read: its body must fit ``--max-payload-size``
(413), and the router must have room, both in requests (``--max-concurrent-requests``) and in body bytes
held at once (``--max-inflight-bytes``; a body of unknown length reserves the payload limit until it is
read).  Over either, a 503 with ``Retry-After`` (``smg_requests_rejected_total{reason}``): memory stays
bounded whatever clients send.

The same count is what a graceful shutdown waits for (``wait_idle``); ``relay`` registers the task of every
stream it passes through so that at the shutdown deadline ``end_streams`` can end each one with an error
event and ``[DONE]`` instead of a cut connection.
"""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from smg_router.errors import Overloaded, PayloadTooLarge
from smg_router.http_io import read_body
from smg_router.metrics import Metrics

RETRY_AFTER_S = 1


class Admission:
    __slots__ = ("_bytes", "_count", "_idle", "_metrics", "_streams", "closing", "max_body", "max_bytes",
                 "max_requests")

    def __init__(self, *, max_requests: int, max_bytes: int, max_body: int, metrics: Metrics) -> None:
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.max_body = max_body
        self._metrics = metrics
        self._count = 0
        self._bytes = 0
        self._idle: asyncio.Event | None = None  # made on first use, inside the running loop
        self._streams: set[asyncio.Task[object]] = set()
        self.closing = False
        """True once ``end_streams`` ran: a cancelled stream then ends with an error event."""

    def __len__(self) -> int:
        return self._count

    async def enter(self, request: web.Request) -> bytes:
        """Admit the request and read its body; ``leave(len(body))`` when its answer is over."""
        size = request.content_length
        if size is not None and size > self.max_body:
            self._reject("payload_too_large")
            raise PayloadTooLarge(f"request body of {size} bytes exceeds the limit of {self.max_body} bytes",
                                  code="payload_too_large")
        reserved = self.max_body if size is None else size
        if self._count >= self.max_requests or self._bytes + reserved > self.max_bytes:
            reason = "concurrency" if self._count >= self.max_requests else "inflight_bytes"
            self._reject(reason)
            raise Overloaded(f"the router is at its limit ({self._count} requests, {self._bytes} body bytes in "
                             "flight); retry shortly", code="overloaded", retry_after=RETRY_AFTER_S)
        self._count += 1
        self._bytes += reserved
        if self._idle is not None:
            self._idle.clear()
        try:
            body = await read_body(request, self.max_body)
        except PayloadTooLarge:
            self.leave(reserved)
            self._reject("payload_too_large")
            raise
        except BaseException:
            self.leave(reserved)
            raise
        self._bytes += len(body) - reserved  # hold what was read, not the reservation
        return body

    def leave(self, held: int) -> None:
        self._count -= 1
        self._bytes -= held
        if self._count == 0 and self._idle is not None:
            self._idle.set()

    def _reject(self, reason: str) -> None:
        self._metrics.requests_rejected.labels(reason).inc()

    async def wait_idle(self, seconds: float) -> bool:
        """Whether every admitted request finished within ``seconds``."""
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
