"""The https transport: aiohttp's ``ClientSession``, which brings TLS (DESIGN 2.9: costly, so http uses ``lean``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import aiohttp

from smg_router.upstream.base import UpstreamConnectError, UpstreamResponse


class SessionResponse:
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


class SessionUpstream:
    def __init__(self, *, connect_timeout: float, total_timeout: float) -> None:
        self._timeout = aiohttp.ClientTimeout(total=total_timeout, sock_connect=connect_timeout)
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, enable_cleanup_closed=True)
        self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout,
                                              auto_decompress=False, skip_auto_headers=("User-Agent",))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        if self._session is None:
            raise RuntimeError("SessionUpstream.start() was not awaited")
        try:
            resp = await self._session.post(url, data=body, headers=headers)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as e:
            raise UpstreamConnectError(f"{type(e).__name__}: {e}") from e
        return SessionResponse(resp)
