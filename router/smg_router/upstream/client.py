"""``Upstream``: the one object the request path sends through, choosing the transport by URL scheme.

Plain-http workers (the usual case inside a cluster) go through the lean pooled client of ``lean`` (a
fraction of ``ClientSession``'s cost per request); https workers go through ``session``.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Callable, Mapping

from smg_router.upstream.base import ResponseLimits, Timeouts, UpstreamResponse
from smg_router.upstream.lean import LeanUpstream
from smg_router.upstream.session import SessionUpstream


class Upstream:
    """Both transports under the same ``Timeouts`` and ``ResponseLimits``: ``TimeoutError`` past any of the first;
    ``UpstreamConnectError`` for a head past the second, ``ResponseTooLarge`` for a body read whole past it."""

    def __init__(
        self,
        timeouts: Timeouts,
        limits: ResponseLimits | None = None,
        *,
        on_resend: Callable[[str], None] | None = None,
    ) -> None:
        """``on_resend``: told the URL of each request the lean client sent again on a fresh connection."""
        self._lean = LeanUpstream(timeouts, limits, on_resend=on_resend)
        self._tls = SessionUpstream(timeouts, limits)

    async def start(self) -> None:
        await self._lean.start()
        await self._tls.start()

    async def close(self) -> None:
        await self._lean.close()
        await self._tls.close()

    def forget(self, worker_url: str) -> None:
        """The worker left: no connection to it is kept idle (the https pool's own expire within its keep-alive)."""
        self._lean.forget(worker_url)

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        if url.startswith("http://"):
            return await self._lean.post(url, body, headers)
        return await self._tls.post(url, body, headers)

    async def post_stream(self, url: str, body: AsyncIterable[bytes], headers: Mapping[str, str]) -> UpstreamResponse:
        """A body sent as it is produced (a streamed upload), through ``session`` for http and https alike: the
        lean client sends bodies of known bytes only.  The first-byte timeout counts from the end of the
        upload: however slowly the client sends it, the worker is not late before it has the whole body."""
        return await self._tls.post(url, body, headers)
