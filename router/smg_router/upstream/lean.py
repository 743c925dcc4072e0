"""A lean HTTP/1.1 upstream client: pooled keep-alive connections on ``asyncio.Protocol``, framed by httptools.

It implements the ``UpstreamResponse`` interface of ``base`` (post → status, headers, read or chunk-by-chunk
body, release, abort) with far less work per request than aiohttp's ``ClientSession`` (measured as the single
biggest cost of a Python proxy).  Only what the router needs: POST with a body of known length, responses framed
by Content-Length, chunked encoding or connection close.

Backpressure: a response body that arrives faster than the proxy forwards it pauses reading from the worker.
Three bounds per request, kept by one lazily re-armed timer: the response headers within the first-byte
timeout, no silence longer than the stream-idle timeout between body bytes (time spent paused for our own
reader does not count), the whole response within the total timeout; past one the request fails with
``TimeoutError`` and the connection is closed.  A connection goes back to the pool only after a complete
response the worker agreed to keep alive, and is reused only if nothing arrived on it in between; anything
else closes it.
"""

from __future__ import annotations

import asyncio
import collections
import math
import select
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

import httptools

from smg_router.upstream.base import (
    BodyByChunks,
    ResponseLimits,
    ResponseTooLarge,
    Timeouts,
    UpstreamConnectError,
    connect_failure,
)

Sink = Callable[[bytes, bool], bool]
"""Takes a piece of a response body and whether the body ends with it; returns whether to go on (``pipe``)."""
HIGH_WATER = 256 * 1024
"""Buffered body bytes above which reading from the worker pauses until the proxy catches up."""
MAX_IDLE_PER_HOST = 256


class _Timeouts:
    """``Timeouts`` as a connection checks them: no None (an absent bound is infinite), the first check known."""

    __slots__ = ("first_byte", "first_check", "idle", "total")

    def __init__(self, timeouts: Timeouts) -> None:
        self.total = timeouts.total
        self.first_byte = math.inf if timeouts.first_byte is None else timeouts.first_byte
        self.idle = math.inf if timeouts.stream_idle is None else timeouts.stream_idle
        self.first_check = min(self.first_byte, self.idle, self.total)
        """After sending: no bound can be passed sooner (the idle clock starts with the headers at the earliest)."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection to a worker, carrying one request at a time."""

    def __init__(self, key: tuple[str, int], timeouts: _Timeouts, limits: ResponseLimits | None = None) -> None:
        self.key = key
        self._timeouts = timeouts
        self._limits = limits or ResponseLimits()
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = 0.0
        self.watched = False
        """A request is out on this connection and its bounds are kept (``watch`` .. ``unwatch``)."""
        self._deadline_at = self._first_byte_at = self.last_data = 0.0
        self.transport: asyncio.Transport | None = None
        self.fd = -1
        self.poller: select.poll | None = None
        self.closed = False
        self._parser = httptools.HttpResponseParser(self)
        self.paused = False
        """Reading from the worker is paused (backpressure): the transport's state, not one response's."""
        self._reset()

    def _reset(self) -> None:
        self.headers_done: asyncio.Future[None] = self._loop.create_future()
        self.status = 0
        self.header_list: list[tuple[str, str]] = []
        self.head_size = 0
        self.headers: dict[str, str] = {}
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.sink: Sink | None = None
        """While set (``LeanResponse.pipe``), each read's body bytes go to it from within the read, instead of waking
        the reader for them."""
        self.sink_error: Exception | None = None
        """What the sink raised (it is then detached): the reader's ``pipe`` raises it."""

    # -- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.fd = transport.get_extra_info("socket").fileno()
        self.poller = select.poll()  # made once: a reuse's check is then one poll(2) (``_readable``)
        self.poller.register(self.fd, select.POLLIN)

    def data_received(self, data: bytes) -> None:
        if self.complete:
            self.close()  # stray bytes between a final response and the next request: not ours to hand on
            return
        self.last_data = self._loop.time()  # once a read, not once a chunk of it (the idle bound's clock)
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as e:
            if self.sink is not None and self.chunks:
                self._push()  # what was framed well before the fault goes on first, as a reader would take it
            self._unparsable(e)
            return
        if self.sink is not None and self.chunks:
            self._push()

    def _push(self) -> None:
        """This read's body bytes to the sink, in one piece; the reader is woken only when the sink stops."""
        sink = self.sink
        assert sink is not None
        chunk = self.take()
        try:
            go_on = sink(chunk, self.complete)
        except Exception as e:  # raised again by the reader (``pipe``), in its task: nothing escapes a read
            self.sink_error, go_on = e, False
        if not go_on:
            self.sink = None  # detached: the reader's ``pipe`` returns
            self._wake()

    def _unparsable(self, e: Exception) -> None:
        """Before the headers a connect error (retried elsewhere); after them an OSError, as a broken-off body."""
        if not self.complete:
            reason = e.__context__ if isinstance(e, httptools.HttpParserCallbackError) else e  # our callback's own
            if isinstance(reason, ResponseTooLarge):
                self._fail(UpstreamConnectError(str(reason)))
            elif self.headers_done.done():
                self._fail(ConnectionError(f"malformed response body from worker: {reason}"))
            else:
                self._fail(UpstreamConnectError(f"malformed response from worker: {reason}"))
        # else: stray bytes in the read that completed the response, which stays intact
        self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        by_worker = not self.closed  # close() marks the connections we close ourselves
        self.closed = True
        if not self.complete and self.error is None:
            if not self.headers_done.done():
                self._fail(UpstreamConnectError(f"worker closed the connection{f': {exc}' if exc else ''}"))
            elif by_worker and exc is None and not self._framed():
                self.complete = True  # a close-delimited body ends with a clean close (httptools has no EOF call)
            else:
                why = f": {exc}" if exc else ""
                self._fail(ConnectionResetError(f"worker closed the connection mid-response{why}"))
        self.unwatch()
        self._disarm()
        self._wake()

    def _framed(self) -> bool:
        """The body's end is in its bytes, not at the worker's close (RFC 9112 6.3: chunked as the last
        transfer coding, else a Content-Length, else the body runs to the close)."""
        te = self.headers.get("transfer-encoding")
        return te.rstrip().lower().endswith("chunked") if te is not None else "content-length" in self.headers

    def resume_writing(self) -> None:  # pragma: no cover - request bodies are small
        pass

    # -- httptools callbacks -------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.complete:  # a second response where one was asked for; raising stops the parser here
            raise ValueError("stray bytes after a complete response")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_size += len(name) + len(value) + 4
        if self.head_size > self._limits.head:
            self._limits.refused("head_too_large")
            raise ResponseTooLarge(
                f"the worker's answer has more than {self._limits.head} bytes of headers (--max-response-header-size)"
            )
        self.header_list.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:
            if status == 101:  # we never ask to switch protocols
                raise ValueError("the worker switched protocols (101) although nobody asked it to")
            self.header_list.clear()  # 100 Continue, 103 Early Hints: informational, the final response follows
            self.head_size = 0
            return
        self.status = status
        self.headers = {k.lower(): v for k, v in self.header_list}  # taken now: trailers come later
        if not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        if self.sink is None:  # piped, the bytes go to the sink once the read is parsed (``_push``)
            waiter = self.waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def on_message_complete(self) -> None:
        if self._parser.get_status_code() < 200:
            return  # the end of an informational response: the parser goes on to the next one
        self.keep_alive = self._parser.should_keep_alive()  # only meaningful inside the parser's callbacks
        self.complete = True
        self.unwatch()
        self._wake()

    # -- used by the response ------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        if not self.headers_done.done():
            self.headers_done.set_exception(exc)
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def take(self) -> bytes:
        """Every body byte buffered so far, as one piece: a read that brought several chunks of a chunked
        body (an engine's SSE events, one HTTP chunk each) is relayed in one write, not one write per chunk."""
        chunks = self.chunks
        if len(chunks) == 1:
            chunk = chunks.popleft()
        else:
            chunk = b"".join(chunks)
            chunks.clear()
        self.buffered -= len(chunk)
        if self.paused and self.buffered <= HIGH_WATER // 4 and self.transport is not None:
            self.paused = False
            self.last_data = self._loop.time()  # the worker's silence counts again from now
            self.transport.resume_reading()
        return chunk

    # -- the request's timers ------------------------------------------------------------------
    def watch(self) -> None:
        """The request was just sent: its bounds count from now.

        One timer per connection, never touched on the hot path (a body chunk only notes the time): it fires
        no later than the earliest moment a bound could be passed and, when none was, re-arms itself for the
        next.  It outlives a request (``unwatch`` only marks the connection idle; the timer, firing on an idle
        connection, stops): with the default bounds (minutes) a pooled connection's requests arm it about
        once per bound, not once each.
        """
        now = self._loop.time()
        t = self._timeouts
        self._deadline_at = now + t.total
        self._first_byte_at = now + t.first_byte
        self.watched = True
        due = now + t.first_check
        if self._timer is not None and self._timer_due > due:
            self._timer.cancel()  # armed for a later moment than this request's first bound
            self._timer = None
        if self._timer is None:
            self._arm(due)

    def unwatch(self) -> None:
        self.watched = False

    def _arm(self, due: float) -> None:
        self._timer_due = due
        self._timer = self._loop.call_at(due, self._check)

    def _check(self) -> None:
        self._timer = None
        if not self.watched or self.complete or self.closed or self.error is not None:
            return
        t = self._timeouts
        now = self._loop.time()
        if now >= self._deadline_at:
            self._time_out(f"the worker did not finish within {t.total:g} s")
            return
        if not self.headers_done.done():
            if now >= self._first_byte_at:
                self._time_out(f"no response headers from the worker within {t.first_byte:g} s")
                return
            due = min(self._first_byte_at, now + t.idle)  # headers may come any time, the idle clock with them
        elif self.paused:
            due = now + t.idle  # the worker is not silent: we stopped reading (take() restarts the clock)
        else:
            due = self.last_data + t.idle
            if now >= due:
                self._time_out(f"the worker sent nothing for {t.idle:g} s in the middle of its response")
                return
        self._arm(min(due, self._deadline_at))

    def _time_out(self, message: str) -> None:
        self._fail(TimeoutError(message))
        self.close()

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed and self.error is None

    def idle(self) -> None:
        """Into the pool: the unread rest of a complete body is dropped and reading resumes.

        A body that crossed the high-water mark in the same read that completed it leaves reading paused;
        pooled so, the connection would never see the next response.
        """
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def recycle(self) -> None:
        """Ready for the next request on the same connection."""
        self._parser = httptools.HttpResponseParser(self)
        self._reset()

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self) -> None:
        self._disarm()
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()


class LeanResponse(BodyByChunks):
    __slots__ = ("_client", "_conn", "_done", "headers", "limits", "status")

    def __init__(self, client: LeanUpstream, conn: _Conn) -> None:
        self.limits = client.limits
        self._client = client
        self._conn = conn
        self._done = False
        self.status = conn.status
        self.headers: Mapping[str, str] = conn.headers

    async def next_chunk(self) -> bytes:
        """The body bytes that arrived since the last call (waiting for some); b"" at the body's end, when the
        connection goes back to the pool.  One coroutine a chunk: a stream's relay calls it for every read."""
        conn = self._conn
        while not conn.chunks:
            if conn.error is not None:
                raise conn.error
            if conn.complete:
                self.release()
                return b""
            conn.waiter = conn._loop.create_future()
            try:
                await conn.waiter
            finally:
                conn.waiter = None
        return conn.take()

    async def pipe(self, sink: Sink) -> bool:
        """The body to ``sink(chunk, last)`` as it arrives, from within each read of the connection: no wake-up of
        this coroutine a read (a stream's relay: about three reads a request).  True at the body's end (the
        connection is released); False once ``sink`` returned False (the caller waits for its client, then pipes
        again); raises what ``next_chunk`` raises, and what ``sink`` raised."""
        conn = self._conn
        while True:
            if conn.chunks:  # arrived while nothing was piped: first, as a reader would take them
                if not sink(conn.take(), conn.complete):
                    return False
                continue
            if conn.error is not None:
                raise conn.error
            if conn.complete:
                self.release()
                return True
            conn.sink = sink
            conn.waiter = conn._loop.create_future()
            try:
                await conn.waiter
            finally:
                detached = conn.sink is None  # the sink stopped (or raised) while we waited
                conn.waiter = conn.sink = None
            if conn.sink_error is not None:
                error, conn.sink_error = conn.sink_error, None
                raise error
            if detached:
                return False

    def waiting(self) -> bool:
        conn = self._conn
        return bool(conn.chunks) or conn.complete or conn.error is not None

    def finished(self) -> bool:
        conn = self._conn
        return conn.complete and not conn.chunks and conn.error is None

    def release(self) -> None:
        """Back to the pool after a complete response, else closed (the rest of the body is not wanted)."""
        if self._done:
            return
        self._done = True
        self._conn.unwatch()
        self._client._give_back(self._conn)

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._conn.unwatch()
            self._conn.close()


class LeanUpstream:
    """The plain-http transport of ``client.Upstream``, bounded by ``Timeouts``."""

    def __init__(
        self,
        timeouts: Timeouts,
        limits: ResponseLimits | None = None,
        *,
        on_resend: Callable[[str], None] | None = None,
    ) -> None:
        self._on_resend = on_resend
        """Told the URL of every request sent again on a fresh connection (``post``), to be counted."""
        self._connect_timeout = timeouts.connect
        self._timeouts = _Timeouts(timeouts)
        self.limits = limits or ResponseLimits()
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._targets: dict[str, tuple[tuple[str, int], bytes]] = {}

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    def forget(self, worker_url: str) -> None:
        """The worker left: its idle connections are closed now, not kept until a host that may be gone says so."""
        parts = urlsplit(worker_url)
        if parts.hostname is not None:
            for conn in self._idle.pop((parts.hostname, parts.port or 80), []):
                conn.close()
        for url in [u for u in self._targets if u.startswith(worker_url)]:
            del self._targets[url]

    def _target(self, url: str) -> tuple[tuple[str, int], bytes]:
        """(host, port) and the request line + Host header, parsed once per URL."""
        cached = self._targets.get(url)
        if cached is None:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise UpstreamConnectError(f"the lean upstream client speaks plain http only, not {url}")
            port = parts.port or 80
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            head = f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n".encode("latin-1")
            cached = self._targets[url] = ((parts.hostname, port), head)
            if len(self._targets) > 4096:  # bounded: URLs come from the registry, but be safe
                self._targets.clear()
        return cached

    def _pooled(self, key: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed and not _readable(conn):
                conn.recycle()
                return conn
            conn.close()
        return None

    async def _connect(self, key: tuple[str, int]) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Conn(key, self._timeouts, self.limits), *key), self._connect_timeout
            )
        except (OSError, TimeoutError) as e:
            raise UpstreamConnectError(f"cannot connect: {connect_failure(e)}") from None
        return conn

    def _give_back(self, conn: _Conn) -> None:
        if conn.reusable():
            idle = self._idle.setdefault(conn.key, [])
            if len(idle) < MAX_IDLE_PER_HOST:
                conn.idle()
                idle.append(conn)
                return
        conn.close()

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> LeanResponse:
        key, head = self._target(url)
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items() if k.lower() not in ("host", "content-length"))
        request = head + f"{extra}Content-Length: {len(body)}\r\n\r\n".encode("latin-1") + body
        conn = self._pooled(key)
        if conn is not None:
            try:
                return await self._send(conn, request)
            except UpstreamConnectError:
                # the worker had closed this idle connection: not a worker failure, try a fresh one (counted: the
                # worker may have read the request before it closed, as with any HTTP/1.1 client's re-send)
                if self._on_resend is not None:
                    self._on_resend(url)
        return await self._send(await self._connect(key), request)

    async def _send(self, conn: _Conn, request: bytes) -> LeanResponse:
        assert conn.transport is not None
        conn.transport.write(request)
        conn.watch()
        try:
            await conn.headers_done
        except BaseException:
            conn.unwatch()
            conn.close()
            raise
        return LeanResponse(self, conn)


def _readable(conn: _Conn) -> bool:
    """Bytes (or the worker's close) waiting on an idle connection the loop has not read yet.

    Anything there was sent before our next request and would be taken as its answer: one poll(2) per
    reuse (1-2 us measured) keeps one client from getting another's answer, and spares a write to a
    connection the worker already closed.  httpcore checks its idle connections the same way.  Bytes still
    in flight from the worker can slip past it, as they would past any HTTP/1.1 client.
    """
    return conn.poller is None or bool(conn.poller.poll(0))
