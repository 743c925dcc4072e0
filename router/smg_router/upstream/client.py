"""The upstream transport behind a small interface of our own.

The proxy only needs "POST these bytes to that URL, give me status, headers and a body I can read
whole or chunk by chunk, and let me abort it".  Plain-http workers (the usual case inside a cluster) go
through the lean pooled client of ``lean_upstream`` (a fraction of ``ClientSession``'s cost per request,
DESIGN 2.9); https workers go through aiohttp's ``ClientSession``, which brings TLS.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Protocol

import aiohttp


class UpstreamConnectError(Exception):
    """The worker could not be reached or the connection failed before a response arrived."""


class UpstreamResponse(Protocol):
    status: int

    @property
    def headers(self) -> Mapping[str, str]: ...
    async def read(self) -> bytes: ...
    def chunks(self) -> AsyncIterator[bytes]: ...
    def release(self) -> None: ...
    def abort(self) -> None: ...


class _AiohttpResponse:
    __slots__ = ("_resp", "status")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status = resp.status

    @property
    def headers(self) -> Mapping[str, str]:
        return self._resp.headers

    async def read(self) -> bytes:
        return await self._resp.read()

    def chunks(self) -> AsyncIterator[bytes]:
        return self._resp.content.iter_any()

    def release(self) -> None:
        self._resp.release()

    def abort(self) -> None:
        """Close the connection: the worker sees the client go away and stops generating."""
        self._resp.close()


class Upstream:
    def __init__(self, *, connect_timeout: float, total_timeout: float) -> None:
        self._timeout = aiohttp.ClientTimeout(total=total_timeout, sock_connect=connect_timeout)
        self._session: aiohttp.ClientSession | None = None
        from smg_router.lean_upstream import LeanUpstream  # late: lean_upstream imports this module's errors

        self._lean = LeanUpstream(connect_timeout=connect_timeout, total_timeout=total_timeout)

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, enable_cleanup_closed=True)
        self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout,
                                              auto_decompress=False, skip_auto_headers=("User-Agent",))
        await self._lean.start()

    async def close(self) -> None:
        await self._lean.close()
        if self._session is not None:
            await self._session.close()

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        if url.startswith("http://"):
            return await self._lean.post(url, body, headers)
        assert self._session is not None, "Upstream.start() was not awaited"
        try:
            resp = await self._session.post(url, data=body, headers=headers)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as e:
            raise UpstreamConnectError(f"{type(e).__name__}: {e}") from e
        return _AiohttpResponse(resp)
