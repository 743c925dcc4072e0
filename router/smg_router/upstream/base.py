"""The upstream interface the request path sees, its timeouts and its one connect error.  Imports no transport."""

from __future__ import annotations

import errno
import os
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol


class UpstreamConnectError(Exception):
    """The worker could not be reached or the connection failed before a response arrived.  Its text reaches the
    client, so it never holds the worker's address (the log line beside it names the worker)."""


def connect_failure(e: BaseException) -> str:
    """What went wrong connecting, without the address the OS or the library put in its text: the error number's
    meaning ("Connection refused"), else the kind of error."""
    if isinstance(e, TimeoutError):
        return "timed out"
    number = getattr(e, "errno", None) or getattr(getattr(e, "os_error", None), "errno", None)
    if isinstance(number, int) and number in errno.errorcode:
        return os.strerror(number)
    return type(e).__name__


class ResponseTooLarge(ConnectionError):
    """A worker's answer passed one of the router's limits (``ResponseLimits``): a broken-off answer (a 502)."""


@dataclass(frozen=True, slots=True)
class ResponseLimits:
    """What the router reads of a worker's answer at most, for both transports.  ``refused`` counts an answer past
    them by reason (``head_too_large``, ``body_too_large``)."""

    head: int = 64 * 1024
    """Bytes of the status line and headers (``--max-response-header-size``)."""
    body: int = 64 * 1024 * 1024
    """Bytes of a body read whole (``read``; ``--max-response-size``); a body taken chunk by chunk is not bounded."""
    refused: Callable[[str], None] = lambda reason: None


@dataclass(frozen=True, slots=True)
class Timeouts:
    """The bounds on one request to a worker, one value for ``Upstream`` and both its transports.

    ``connect``: the TCP connection; ``total``: the whole response; ``first_byte``: request sent → response
    headers; ``stream_idle``: the longest silence between two pieces of a response body.  None leaves a bound to
    the total one.  Past any of them a transport raises ``TimeoutError``.
    """

    connect: float
    total: float
    first_byte: float | None = None
    stream_idle: float | None = None


class UpstreamResponse(Protocol):
    """A worker's response: status and headers at once, the body whole or chunk by chunk."""

    status: int

    @property
    def headers(self) -> Mapping[str, str]: ...
    async def read(self) -> bytes: ...
    async def next_chunk(self) -> bytes:
        """The body bytes that arrived since the last call, waiting for some; b"" at the end (the connection is
        then released).  A plain coroutine per chunk, no async generator (a stream's relay uses ``pipe``)."""
        ...

    async def pipe(self, sink: Callable[[bytes, bool], bool]) -> bool:
        """The body to ``sink(chunk, last)`` as it arrives (``last``: the body ends with it, when known), until it
        ends (True; the connection is then released) or ``sink`` returns False (False: call again to go on).  The
        stream relay's loop: where the transport can, ``sink`` runs from within each read, waking nobody."""
        ...

    def waiting(self) -> bool:
        """Whether body bytes or the body's end have arrived and not been taken: ``next_chunk`` would not wait.
        (False when not known: a caller only uses it to write less often.)"""
        ...

    def finished(self) -> bool:
        """Whether the whole body arrived and was taken: the next ``next_chunk`` is b"" (False when not known)."""
        ...

    def chunks(self) -> AsyncIterator[bytes]: ...
    def release(self) -> None: ...
    def abort(self) -> None: ...


class BodyByChunks:
    """``read`` and ``chunks`` of both transports' responses, on their ``next_chunk``: the one place a body is taken
    to its end (the b"" that ends it releases the connection)."""

    __slots__ = ()

    limits: ResponseLimits

    async def next_chunk(self) -> bytes:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    async def read(self) -> bytes:
        """The whole body; ``ResponseTooLarge`` (the connection closed) past ``limits.body`` bytes."""
        limit = self.limits.body
        parts = []
        size = 0
        while chunk := await self.next_chunk():
            size += len(chunk)
            if size > limit:
                self.abort()
                self.limits.refused("body_too_large")
                raise ResponseTooLarge(
                    f"the worker's answer is larger than the router reads whole ({limit} bytes, --max-response-size)"
                )
            parts.append(chunk)
        return b"".join(parts)

    async def chunks(self) -> AsyncIterator[bytes]:
        while chunk := await self.next_chunk():
            yield chunk
