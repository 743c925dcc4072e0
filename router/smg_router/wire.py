"""HTTP/1.1 messages as the router's server (``server``) reads and writes them: ``Request``, ``Response``,
``StreamResponse``.

The handlers see the few parts of a request they use (method, path, query, headers, version, length, the
body whole or as a stream) and answer with a ``Response`` (a whole body, written with its head in one send)
or a ``StreamResponse`` (chunked, written as the handler goes, waiting while the client is slow).  The
connection behind them is ``server``'s; this module only frames bytes, so that the error types
(``errors``) can build answers without knowing the server.
"""

from __future__ import annotations

import asyncio
import collections
import email.utils
import time
from collections.abc import Mapping
from http import HTTPStatus
from typing import Protocol
from urllib.parse import parse_qsl

from multidict import CIMultiDict, CIMultiDictProxy, MultiDict, MultiDictProxy

HIGH_WATER = 1 << 20
"""Request body bytes a connection buffers, not yet taken by a handler (pipelined requests' included), above which
reading from the client pauses: the server's default (``--max-connection-buffer``)."""

_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in HTTPStatus}
_NO_BODY = frozenset({204, 304})
_date: tuple[int, bytes] = (0, b"")


def _status_line(status: int) -> bytes:
    return _STATUS_LINES.get(status) or f"HTTP/1.1 {status} Status {status}\r\n".encode()


def _date_line() -> bytes:
    """The ``Date`` header line, formatted and encoded once per second."""
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, f"Date: {email.utils.formatdate(now, usegmt=True)}\r\n".encode())
    return _date[1]


class BodyTooLarge(Exception):
    """The request body passed the server's limit (``http_io.read_body`` answers 413)."""


class BodyTimeout(Exception):
    """The request body stopped arriving for ``body_timeout`` seconds, or arrives slower than the server's minimum
    rate (``http_io.read_body`` answers 408); ``reason`` names which, as ``smg_requests_rejected_total`` counts it."""

    def __init__(self, message: str, *, reason: str = "body_timeout") -> None:
        super().__init__(message)
        self.reason = reason


class BodyOverBudget(Exception):
    """The body bytes the server holds passed its budget as this body arrived: the request was shed (a 503), its
    bytes dropped (``Budget``)."""


class Budget:
    """Request body bytes the server holds, counted as they arrive and until the request's answer is over (a body
    streamed through only while buffered), against one limit for the whole server (``--max-inflight-bytes``).

    A body whose bytes take ``held`` past ``limit`` is shed as they arrive: its bytes are dropped and its reader gets
    ``BodyOverBudget`` (the reader counts the refusal: a request answered otherwise before it reads is not one).
    Memory stays bounded by what arrived, whatever a client declares.
    """

    __slots__ = ("held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def full(self) -> bool:
        return self.held >= self.limit


UNLIMITED = 1 << 62


READ_BATCH = 64 * 1024
"""A reader waiting for a body is woken once this many bytes wait (or the body ends, or the connection's buffer is
full), not for every read: a body sent in tiny pieces costs a wake-up per batch, not per piece."""


def _expire(request: Request, waiter: asyncio.Future[None], received: int) -> None:
    """The body timer: no byte since it was armed is a timeout; else it waits again (a gap is thus bounded by one to
    two ``body_timeout``: bytes that arrive below ``READ_BATCH`` wake nobody, and a timer per read would cost more)."""
    if waiter.done():
        return
    if request.received == received and not request._conn.let_in_held():
        seconds = request.body_timeout
        waiter.set_exception(BodyTimeout(f"no byte of the request body arrived for {seconds:g} s (--body-timeout)"))
    else:
        request._timer = asyncio.get_running_loop().call_later(
            request.body_timeout, _expire, request, waiter, request.received
        )


class Connection(Protocol):
    """What a request needs of the connection it came on (``server._Connection``)."""

    local_port: int | None
    remote: str | None
    """The client's IP address (None on a unix socket)."""
    closed: bool
    write_paused: bool
    """The client reads slower than we write: ``drain`` waits (a stream checks this before calling it)."""

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    def buffer_grew(self, size: int) -> bool:
        """``size`` more body bytes wait on the connection; whether reading paused (past its limit)."""
        ...

    def buffer_shrank(self, size: int) -> None:
        """``size`` body bytes were taken or dropped (reading resumes below its limit)."""
        ...

    def await_bytes(self, size: int) -> None:
        """A reader waits for ``size`` more body bytes: the connection may leave smaller pieces unread until then
        (1: every byte as it arrives)."""
        ...

    def let_in_held(self) -> int:
        """Body bytes that arrived and ``await_bytes`` left unread; if any, they are read now."""
        ...

    def clock(self) -> float:
        """Seconds, not counting the time reading was paused by the server itself (the body rate's clock)."""
        ...

    def paused(self) -> bool:
        """Whether reading from the client is paused."""
        ...

    def closing(self) -> bool: ...


class Request:
    """One request: its head as parsed, and its body as it arrives (``read`` whole, or ``content.readany``)."""

    __slots__ = (
        "_broken",
        "_budget",
        "_buffered",
        "_charged",
        "_chunks",
        "_conn",
        "_failure",
        "_query",
        "_query_string",
        "_timer",
        "_waiter",
        "_want",
        "answered",
        "body_timeout",
        "complete",
        "content_length",
        "headers",
        "keep_alive",
        "max_body",
        "method",
        "path",
        "received",
        "started",
        "too_large",
        "version",
    )

    def __init__(
        self,
        conn: Connection,
        *,
        method: str,
        path: str,
        query_string: str,
        headers: CIMultiDictProxy[str],
        version: tuple[int, int],
        keep_alive: bool,
        max_body: int,
        body_timeout: float,
        budget: Budget | None = None,
    ) -> None:
        self._conn = conn
        self._budget = budget if budget is not None else Budget(UNLIMITED)
        self.method = method
        self.path = path
        self._query_string = query_string
        self._query: MultiDictProxy[str] | None = None
        self.headers = headers
        self.version = version
        self.keep_alive = keep_alive
        """Whether the client lets the connection live on after this answer (HTTP/1.1 default, Connection)."""
        self.max_body = max_body
        self.body_timeout = body_timeout
        """Longest wait for the next piece of the body (``BodyTimeout`` past it)."""
        length = headers.get("Content-Length")
        self.content_length: int | None = int(length) if length is not None and length.isdigit() else None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._charged = 0
        """Bytes of this body counted in the budget: all that arrived, less what ``readany`` passed on."""
        self.received = 0
        """Body bytes arrived so far."""
        self.started = conn.clock()
        """When the head was parsed, on the connection's clock (the body rate counts from it)."""
        self._want = 1
        """Bytes waiting that wake the reader (``READ_BATCH`` while it reads the whole body)."""
        self._timer: asyncio.TimerHandle | None = None
        self._failure: BodyOverBudget | BodyTimeout | None = None
        """Why the body will not be read (shed over the budget, too slow): its reader gets this."""
        self.complete = False
        """The whole body has arrived."""
        self._broken = False
        self.too_large = False
        """More than ``max_body`` bytes arrived; ``read`` refused them and the connection closes after the answer."""
        self._waiter: asyncio.Future[None] | None = None
        self.answered = False
        """An answer's head went out (``Response.send_now`` or a stream's ``prepare``): no other may follow it."""

    @property
    def query(self) -> MultiDictProxy[str]:
        if self._query is None:
            self._query = MultiDictProxy(MultiDict(parse_qsl(self._query_string, keep_blank_values=True)))
        return self._query

    @property
    def query_string(self) -> str:
        """The request target's query, as sent (``query`` parses it)."""
        return self._query_string

    @property
    def local_port(self) -> int | None:
        """The port the connection was accepted on (the socket's, not the client's Host header)."""
        return self._conn.local_port

    @property
    def remote(self) -> str | None:
        """The IP address the connection came from (None on a unix socket: ``--processes``'s private endpoints)."""
        return self._conn.remote

    @property
    def content(self) -> Request:
        """The body as a stream (``readany``), for uploads passed through as they arrive."""
        return self

    # -- fed by the connection ---------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        if self.too_large or self._failure is not None:
            return  # refused already: the rest is dropped as it arrives
        size = len(data)
        self.received += size
        budget = self._budget
        budget.held += size
        self._charged += size
        if budget.held > budget.limit:
            self._drop(
                BodyOverBudget(f"the router holds {budget.limit} request body bytes at most (--max-inflight-bytes)")
            )
            return
        self._chunks.append(data)
        self._buffered += size
        if self._conn.buffer_grew(size) or self._buffered >= self._want:
            self._wake()
        elif self._waiter is not None:
            self._hold_back()

    def _hold_back(self) -> None:
        """Let the connection leave the body's next bytes unread until they wake the waiting reader: what it still
        wants, never more than the body has left (its end must wake the reader).  A chunked body's end is not known
        in bytes: read as it arrives."""
        if self.content_length is None:
            return
        self._conn.await_bytes(min(self._want - self._buffered, self.content_length - self.received))

    def fail(self, failure: BodyTimeout) -> None:
        """The body will not be read (it arrives too slowly): dropped, and its reader gets ``failure``."""
        if not self.complete and self._failure is None:
            self._drop(failure)

    def _drop(self, failure: BodyOverBudget | BodyTimeout) -> None:
        self._failure = failure
        self._chunks.clear()
        self._conn.buffer_shrank(self._buffered)
        self._buffered = 0
        self.release()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(failure)

    def hold(self, size: int) -> None:
        """The reader of a stream keeps ``size`` bytes it took (an upload's head, kept for a retry): counted in the
        budget again until the request is over."""
        self._budget.held += size
        self._charged += size

    def release(self) -> None:
        """The answer is over (or the request dropped): its bytes leave the budget."""
        self._budget.held -= self._charged
        self._charged = 0

    def finish(self) -> None:
        self.complete = True
        self._wake()

    def finish_broken(self) -> None:
        """No more body will come (the connection closed or stopped reading): a reader gets an error."""
        self._broken = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._broken or self._conn.closed:
            raise ConnectionResetError("the client closed the connection before sending the whole body")
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        self._timer = loop.call_later(self.body_timeout, _expire, self, waiter, self.received)
        self._hold_back()
        try:
            await waiter
        finally:
            self._conn.await_bytes(1)
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._waiter = None

    def _ended(self) -> bool:
        return self.complete  # a call: the narrowing of ``self.complete`` does not survive an await

    def _take(self) -> bytes:
        chunk = b"".join(self._chunks) if len(self._chunks) > 1 else self._chunks[0]
        self._chunks.clear()
        self._conn.buffer_shrank(self._buffered)
        self._buffered = 0
        return chunk

    # -- read by the handler -----------------------------------------------------------------------
    async def read(self) -> bytes:
        """The whole body; ``BodyTooLarge`` past ``max_body`` bytes."""
        if self._failure is not None:
            raise self._failure
        if self.complete:  # the common case: the body came with the head
            body = self._take() if self._chunks else b""
            if len(body) > self.max_body:
                self.too_large = True
                raise BodyTooLarge(f"request body exceeds the limit of {self.max_body} bytes")
            return body
        parts: list[bytes] = []
        size = 0
        self._want = READ_BATCH
        while True:
            if self._chunks:
                chunk = self._take()
                size += len(chunk)
                if size > self.max_body:
                    self.too_large = True
                    raise BodyTooLarge(f"request body exceeds the limit of {self.max_body} bytes")
                parts.append(chunk)
            elif self._ended():
                return b"".join(parts)
            else:
                await self._wait()

    async def readany(self, at_least: int = 1) -> bytes:
        """The body bytes that arrived since the last call (waiting for ``at_least`` of them, or the body's end, or a
        full connection buffer); ``b""`` at its end.  What it returns leaves the budget: the caller passes it on
        (``hold`` what it keeps)."""
        self._want = at_least
        while self._buffered < at_least and not self.complete:
            if self._failure is not None:
                raise self._failure
            if self._buffered and self._conn.paused():
                break
            await self._wait()
        while not self._chunks:
            if self._failure is not None:
                raise self._failure
            if self.complete:
                return b""
            await self._wait()
        chunk = self._take()
        self._budget.held -= len(chunk)
        self._charged -= len(chunk)
        return chunk

    def send_continue(self) -> None:
        """``Expect: 100-continue``: the go-ahead for a body the client holds back until it gets one."""
        if not self.complete and not self._chunks:
            self._conn.write(b"HTTP/1.1 100 Continue\r\n\r\n")


class Response:
    """A whole answer: written with its head in one send once the handler returns it."""

    __slots__ = ("body", "head", "headers", "keep_alive", "prepared", "status")

    def __init__(
        self,
        *,
        status: int = 200,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        content_type: str | None = None,
        head: bytes = b"",
    ) -> None:
        self.status = status
        self.body = body
        self.headers: CIMultiDict[str] = CIMultiDict(headers) if headers else CIMultiDict()
        if content_type is not None:
            self.headers["Content-Type"] = content_type
        self.head = head
        """Header lines already encoded (``name: value\r\n`` each), sent before ``headers``: a worker's, relayed as
        one piece (``relay.relayed_head``).  None of them frames the body or the connection (no Date,
        Content-Length, Transfer-Encoding or Connection): the server adds those."""
        self.keep_alive = True
        self.prepared = False
        """The head went out (a stream's ``prepare``)."""

    def force_close(self) -> None:
        """Close the connection after this answer."""
        self.keep_alive = False

    def encode_head(self, request: Request, *, length: int | None) -> bytes:
        """Status line and headers; ``length`` None: a chunked body (HTTP/1.1) or one that ends at the close."""
        if request._conn.closing() or not request.keep_alive or request.too_large:
            self.keep_alive = False
        out = [_status_line(self.status), self.head]
        headers = self.headers
        for name, value in headers.items():
            out.append(f"{name}: {value}\r\n".encode("latin-1", "replace"))
        if "Date" not in headers:
            out.append(_date_line())
        if self.status not in _NO_BODY and "Content-Length" not in headers:
            if length is not None:
                out.append(b"Content-Length: %d\r\n" % length)
            elif request.version >= (1, 1):
                out.append(b"Transfer-Encoding: chunked\r\n")
            else:
                self.keep_alive = False  # an HTTP/1.0 stream ends with the connection
        if not self.keep_alive:
            out.append(b"Connection: close\r\n")
        elif request.version < (1, 1):
            out.append(b"Connection: keep-alive\r\n")
        out.append(b"\r\n")
        return b"".join(out)

    def send_now(self, request: Request) -> None:
        """Write the whole answer at once, before what its handler does after (a relay's bookkeeping: the client
        does not wait for it); HEAD gets the head only."""
        head = self.encode_head(request, length=len(self.body))
        self.prepared = request.answered = True
        request._conn.write(head if request.method == "HEAD" or self.status in _NO_BODY else head + self.body)

    async def send(self, request: Request) -> None:
        """Write the whole answer unless ``send_now`` did (the server's, once the handler returned it), then wait
        while the client is slow."""
        if not self.prepared:
            self.send_now(request)
        await request._conn.drain()


class StreamResponse(Response):
    """An answer streamed as it is made: ``prepare`` sends the head, ``write`` each chunk, ``write_eof`` the end.

    Each is one socket write; ``prepare(hold=True)`` keeps the head for the first write and ``write(last=True)``
    ends the body with the chunk, for a caller that already has what comes next (a write to a loopback or LAN
    socket costs as much as the router's own work on a chunk).
    """

    __slots__ = ("_chunked", "_held", "_request", "eof")

    def __init__(self, *, status: int = 200, headers: Mapping[str, str] | None = None, head: bytes = b"") -> None:
        super().__init__(status=status, headers=headers, head=head)
        self._request: Request | None = None
        self._chunked = False
        self._held = b""
        """The head, while ``prepare(hold=True)`` kept it for the first write."""
        self.eof = False

    async def prepare(self, request: Request, *, hold: bool = False) -> None:
        """Send the head, or with ``hold`` keep it to go out with the first ``write`` or ``write_eof``."""
        if self.prepared:
            return
        self._request = request
        head = self.encode_head(request, length=None)
        self._chunked = "Content-Length" not in self.headers and request.version >= (1, 1)
        self.prepared = request.answered = True
        if hold:
            self._held = head
        else:
            request._conn.write(head)

    async def write(self, data: bytes, *, last: bool = False) -> None:
        """Send a chunk (``last``: and the end of the body); waits while the client is slow;
        ``ConnectionResetError`` once it is gone."""
        if self.write_now(data, last=last):
            await self.drain()

    def write_now(self, data: bytes, *, last: bool = False) -> bool:
        """``write`` without the wait: whether the client reads slower than we write (the caller then awaits
        ``drain`` before its next write).  A relay's loop calls it for every chunk: no coroutine for each."""
        assert self._request is not None, "prepare() first"
        conn = self._request._conn
        if conn.closed:
            raise ConnectionResetError("the client closed the connection")
        if not data and not last:
            return False
        out = b"%x\r\n%b\r\n" % (len(data), data) if self._chunked and data else data
        if last:
            self.eof = True
            if self._chunked:
                out += b"0\r\n\r\n"
        if self._held:
            out, self._held = self._held + out, b""
        conn.write(out)
        return conn.write_paused

    async def drain(self) -> None:
        """Wait while the client reads slower than we write; ``ConnectionResetError`` once it is gone."""
        assert self._request is not None, "prepare() first"
        await self._request._conn.drain()

    async def write_eof(self) -> None:
        if self.eof:
            return
        assert self._request is not None, "prepare() first"
        await self.write(b"", last=True)

    async def send(self, request: Request) -> None:
        """A stream its handler left unfinished ends here."""
        if not self.prepared:
            await self.prepare(request)
        await self.write_eof()
