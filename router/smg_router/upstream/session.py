"""The https transport: aiohttp's ``ClientSession``, which brings TLS (at a cost, so http uses ``lean``).

It keeps the interface's error contract, as ``lean`` does: before the response headers a failure is an
``UpstreamConnectError`` and a missed first-byte (or total) deadline a ``TimeoutError``; while the body is
read, a silence longer than the stream-idle timeout is a ``TimeoutError`` and a broken body an ``OSError``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping

import aiohttp

from smg_router.upstream.base import (
    BodyByChunks,
    ResponseLimits,
    Timeouts,
    UpstreamConnectError,
    UpstreamResponse,
    connect_failure,
)


class SessionResponse(BodyByChunks):
    __slots__ = ("_idle", "_resp", "limits", "status")

    def __init__(self, resp: aiohttp.ClientResponse, idle: float | None, limits: ResponseLimits) -> None:
        self.limits = limits
        self._resp = resp
        self._idle = idle
        self.status = resp.status

    @property
    def headers(self) -> Mapping[str, str]:
        return self._resp.headers

    async def _next(self) -> bytes:
        """What has arrived (waiting at most the stream-idle timeout for it); b"" at the end."""
        idle = asyncio.timeout(self._idle)
        try:
            async with idle:
                return await self._resp.content.readany()
        except TimeoutError:  # ours, or the session's total deadline
            raise TimeoutError(
                f"the worker sent nothing for {self._idle:g} s in the middle of its response"
                if idle.expired()
                else "the worker did not finish in time"
            ) from None
        except aiohttp.ClientError as e:
            raise ConnectionResetError(f"the worker broke off its response: {type(e).__name__}: {e}") from e

    async def next_chunk(self) -> bytes:
        chunk = await self._next()
        if not chunk:
            self._resp.release()
        return chunk

    async def pipe(self, sink: Callable[[bytes, bool], bool]) -> bool:
        """``UpstreamResponse.pipe`` by reading: a chunk a wake-up (https is not the hot path)."""
        while chunk := await self.next_chunk():
            if not sink(chunk, False):
                return False
        return True

    def waiting(self) -> bool:
        return False  # aiohttp's reader does not say without reading

    def finished(self) -> bool:
        return False

    def release(self) -> None:
        self._resp.release()

    def abort(self) -> None:
        """Close the connection: the worker sees the client go away and stops generating."""
        self._resp.close()


class SessionUpstream:
    """``Timeouts.first_byte`` bounds connect + request + response headers here (a streamed upload's: from the end of
    the upload, since a slow client is no slow worker); the others as in ``lean``."""

    def __init__(self, timeouts: Timeouts, limits: ResponseLimits | None = None) -> None:
        self.limits = limits or ResponseLimits()
        self._timeout = aiohttp.ClientTimeout(total=timeouts.total, sock_connect=timeouts.connect)
        self._first_byte = timeouts.first_byte
        self._idle = timeouts.stream_idle
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, enable_cleanup_closed=True)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
            max_line_size=self.limits.head,  # aiohttp bounds each line, not the whole head
            max_field_size=self.limits.head,
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def post(self, url: str, body: bytes | AsyncIterable[bytes], headers: Mapping[str, str]) -> UpstreamResponse:
        """``body``: the bytes, or an async iterable sent as it yields (with the caller's Content-Length if it
        gave one, else chunked)."""
        if self._session is None:
            raise RuntimeError("SessionUpstream.start() was not awaited")
        if isinstance(body, bytes):
            first_byte = asyncio.timeout(self._first_byte)
        else:  # the client's upload: its pace is not the worker's, the first-byte clock starts at its end
            first_byte = asyncio.timeout(None)
            body = self._then_first_byte(body, first_byte)
        try:
            async with first_byte:
                resp = await self._session.post(url, data=body, headers=headers, allow_redirects=False)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:  # a connect timeout included
            raise UpstreamConnectError(f"cannot reach the worker: {connect_failure(e)}") from e
        except TimeoutError:  # ours or the session's total deadline; before OSError, whose subclass it is
            raise TimeoutError(
                f"no response headers from the worker within {self._first_byte:g} s"
                if first_byte.expired()
                else "the worker did not finish in time"
            ) from None
        except OSError as e:
            raise UpstreamConnectError(f"cannot reach the worker: {connect_failure(e)}") from e
        return SessionResponse(resp, self._idle, self.limits)

    async def _then_first_byte(self, body: AsyncIterable[bytes], first_byte: asyncio.Timeout) -> AsyncIterator[bytes]:
        """``body`` as it comes, then the first-byte bound armed: the worker has the whole request."""
        async for chunk in body:
            yield chunk
        if self._first_byte is not None:
            with contextlib.suppress(RuntimeError):  # the worker answered before it read the whole body
                first_byte.reschedule(asyncio.get_running_loop().time() + self._first_byte)
