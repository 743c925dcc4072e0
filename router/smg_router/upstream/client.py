"""``Upstream``: the one object the request path sends through, choosing the transport by URL scheme.

Plain-http workers (the usual case inside a cluster) go through the lean pooled client of ``lean`` (a
fraction of ``ClientSession``'s cost per request); https workers go through ``session``.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Mapping

from smg_router.upstream.base import ResponseLimits, Timeouts, UpstreamResponse
from smg_router.upstream.lean import LeanUpstream
from smg_router.upstream.session import SessionUpstream


class Upstream:
    """Both transports under the same ``Timeouts`` and ``ResponseLimits``: ``TimeoutError`` past any of the first;
    ``UpstreamConnectError`` for a head past the second, ``ResponseTooLarge`` for a body read whole past it."""

    def __init__(self, timeouts: Timeouts, limits: ResponseLimits | None = None) -> None:
        self._lean = LeanUpstream(timeouts, limits)
        self._tls = SessionUpstream(timeouts, limits)

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
