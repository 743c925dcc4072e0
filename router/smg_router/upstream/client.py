"""``Upstream``: the one object the request path sends through, choosing the transport by URL scheme.

Plain-http workers (the usual case inside a cluster) go through the lean pooled client of ``lean`` (a
fraction of ``ClientSession``'s cost per request, DESIGN 2.9); https workers go through ``session``.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Mapping

from smg_router.upstream.base import UpstreamResponse
from smg_router.upstream.lean import LeanUpstream
from smg_router.upstream.session import SessionUpstream


class Upstream:
    """``first_byte_timeout``: request sent → response headers; ``stream_idle_timeout``: the longest silence
    between two pieces of a response body; ``total_timeout``: the whole response.  Both transports raise
    ``TimeoutError`` past any of them (DESIGN 6.1)."""

    def __init__(
        self,
        *,
        connect_timeout: float,
        total_timeout: float,
        first_byte_timeout: float | None = None,
        stream_idle_timeout: float | None = None,
    ) -> None:
        self._lean = LeanUpstream(
            connect_timeout=connect_timeout,
            total_timeout=total_timeout,
            first_byte_timeout=first_byte_timeout,
            stream_idle_timeout=stream_idle_timeout,
        )
        self._tls = SessionUpstream(
            connect_timeout=connect_timeout,
            total_timeout=total_timeout,
            first_byte_timeout=first_byte_timeout,
            stream_idle_timeout=stream_idle_timeout,
        )

    async def start(self) -> None:
        await self._lean.start()
        await self._tls.start()

    async def close(self) -> None:
        await self._lean.close()
        await self._tls.close()

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        if url.startswith("http://"):
            return await self._lean.post(url, body, headers)
        return await self._tls.post(url, body, headers)

    async def post_stream(self, url: str, body: AsyncIterable[bytes], headers: Mapping[str, str]) -> UpstreamResponse:
        """A body sent as it is produced (a streamed upload), through ``session`` for http and https alike: the
        lean client sends bodies of known bytes only.  The first-byte timeout counts from the start of the
        upload (the worker answers once it has read the body)."""
        return await self._tls.post(url, body, headers)
