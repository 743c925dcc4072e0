"""The router's HTTP/1.1 server: one ``asyncio.Protocol`` per connection, framed by httptools.

Why not aiohttp's server: per request it builds a message object, a payload stream, a request with a dozen
attributes and a response whose head is assembled by a writer, where the router needs a dict of headers, the
body bytes and one send (the proxy benchmark measured aiohttp's server leg at twice this one's CPU per request).  What a
production server must do is kept:

- keep-alive (HTTP/1.1 by default, HTTP/1.0 on request), pipelined requests answered in order, idle
  connections closed after ``keepalive_timeout``;
- a handler starts once the head is parsed (``Expect: 100-continue`` gets its go-ahead before the body); a
  client that goes away cancels its handler (the upstream request is then aborted);
- backpressure both ways: reading pauses while a connection holds more than ``max_buffer`` body bytes no handler
  took (pipelined requests' included), a stream waits while the client is slow;
- bounds on slow clients: a head must be whole ``head_timeout`` seconds after the connection opened or its first
  byte came (a 408), a body that stops arriving for ``body_timeout`` fails its read (``wire.BodyTimeout``: a 408),
  and so does one that arrives slower than ``body_min_rate`` bytes a second once ``head_timeout`` has passed
  (Apache's mod_reqtimeout rule: the deadline moves one second for every ``body_min_rate`` bytes);
- body bytes count against the server's ``wire.Budget`` as they arrive (never as a client declares them);
- a body sent in tiny pieces wakes the server once a batch, not once a piece: while a handler waits for more of a
  body with a ``Content-Length``, the kernel holds the pieces back until what it waits for arrived, or the body's
  end (``SO_RCVLOWAT``); the slow-client bounds count held bytes as arrived;
- at most ``max_connections`` connections, ``max_connections_per_client`` from one address: past them a new
  connection gets a 503 and is closed;
- a head that cannot be parsed or is too large is answered with a JSON error (400, 414, 431) and the connection
  closed; an answer sent before its request's body ended closes the connection after it, reading and dropping
  the rest for a moment first (a close with unread bytes resets the connection, and the client could lose the
  answer);
- ``shutdown``: listening stops, idle connections close, busy ones get a grace period, then are cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import socket
import struct
import termios
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote

import httptools
import orjson
from multidict import CIMultiDict, CIMultiDictProxy

from smg_router.wire import HIGH_WATER, UNLIMITED, BodyTimeout, Budget, Request, Response

log = logging.getLogger(__name__)

MAX_URL = 8190
MAX_HEADER = 8190
MAX_HEAD = 64 * 1024
MAX_PIPELINED = 16
"""Requests parsed ahead of the one being answered, above which reading pauses."""
MAX_CONNECTIONS = 4096
MAX_CONNECTIONS_PER_CLIENT = 1024
HEAD_TIMEOUT = 20.0
BODY_MIN_RATE = 500
LINGER_SECONDS = 2.0
REFUSED_LINGER_SECONDS = 0.5
"""How long a connection refused over the connection limits reads and drops what its client sends after the 503."""
"""How long a connection closed under an unread body reads and drops what the client still sends."""
SWEEP_SECONDS = 5.0
MAX_LOW_WATER = 16 * 1024
"""Most body bytes the kernel holds back before it wakes the router for a reader that waits for more
(``_Connection.await_bytes``)."""
_VERSIONS = {"1.1": (1, 1), "1.0": (1, 0)}

Handler = Callable[[Any], Awaitable[Response]]
RequestFactory = Callable[..., Request]


class _HeadRejected(Exception):
    def __init__(self, status: int, message: str, code: str = "request_head_too_large") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


_REASONS = {
    400: "Bad Request",
    408: "Request Timeout",
    414: "URI Too Long",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


def _error_bytes(status: int, message: str, code: str, *, retry_after: int | None = None) -> bytes:
    """A whole JSON error answer that closes the connection (the shape of ``errors.error_response``)."""
    kind = "service_unavailable" if status == 503 else "invalid_request_error"
    body = orjson.dumps({"error": {"message": message, "type": kind, "code": code}})
    retry = f"Retry-After: {retry_after}\r\n" if retry_after is not None else ""
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{retry}Connection: close\r\n\r\n"
    )
    return head.encode() + body


def _split_target(target: bytes) -> tuple[str, str]:
    """(path percent-decoded, query string) of a request target in any form (origin, absolute)."""
    try:
        url = httptools.parse_url(target)
    except httptools.HttpParserInvalidURLError:
        raise _HeadRejected(400, "the request target is not a valid URL", "bad_http_request") from None
    path = url.path.decode("latin-1") if url.path else "/"
    return unquote(path) if "%" in path else path, url.query.decode("latin-1") if url.query else ""


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, runs the handler for one at a time, writes its answers."""

    def __init__(self, server: Server) -> None:
        self._server = server
        self._loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.local_port: int | None = None
        self.remote: str | None = None
        self.closed = False
        self._parser = httptools.HttpRequestParser(self)
        self._url: list[bytes] = []
        self._headers: list[tuple[str, str]] = []
        self._head_size = 0
        self._parsing: Request | None = None
        """The request whose body is arriving."""
        self._pending: deque[Request] = deque()
        self._task: asyncio.Task[None] | None = None
        """Answers the requests in order, from the first request to the connection's end (one task, not one
        per request: a task's creation and its entry in asyncio's set of tasks cost more than a wake-up)."""
        self._idle: asyncio.Future[None] | None = None
        """What the task waits on while no request is parsed; the next head resolves it."""
        self._busy = False
        self._lingering = False
        """Parsing stopped: what the client sends is dropped until the connection closes."""
        self._rejection = b""
        self._read_pauses: set[str] = set()
        self.write_paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []
        self.idle_since = self._loop.time()
        self._paused_for = 0.0
        self._paused_at = 0.0
        self.head_since: float | None = self.clock()
        """When the head being waited for began (the connection's start, or its first byte), on ``clock``; None
        between requests."""
        self.buffered = 0
        """Body bytes on this connection no handler took yet, every request's (``wire.Request.feed``)."""
        self.client: str | None = None
        """The peer's address, counted against ``max_connections_per_client`` (None: a unix socket, not counted)."""
        self._sock: Any = None
        """The TCP socket (its receive low-water mark, ``await_bytes``); None on a unix socket."""
        self._low_water = 1

    # -- asyncio.Protocol --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sockname = transport.get_extra_info("sockname")
        self.local_port = sockname[1] if isinstance(sockname, tuple) else None
        peername = transport.get_extra_info("peername")
        self.remote = str(peername[0]) if isinstance(peername, tuple) and peername else None
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            self._sock = sock
        refusal = self._server.admit(self, self.remote)
        if refusal is not None:
            self._lingering = True  # nothing it sends is parsed
            self.write(_error_bytes(503, refusal, "too_many_connections", retry_after=1))
            self._linger(REFUSED_LINGER_SECONDS)
            return
        self._server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._stop_parsing()  # the router switches to no other protocol: answered as plain HTTP, then closed
        except httptools.HttpParserError as e:
            rejected = e.__context__ if isinstance(e.__context__, _HeadRejected) else None
            if rejected is not None:
                self._reject(rejected.status, rejected.message, rejected.code)
            else:
                self._reject(400, f"malformed HTTP request: {e}", "bad_http_request")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._server.gone(self)
        for request in self._pending:
            request.release()
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_exception(ConnectionResetError("the client closed the connection"))
        self._drain_waiters.clear()
        if self._parsing is not None:
            self._parsing.finish_broken()
        if self._task is not None:
            self._task.cancel()  # the client went away: its handler stops, and with it the upstream request

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._drain_waiters.clear()

    # -- httptools callbacks -----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url.clear()
        self._headers = []
        self._head_size = 0
        if self.head_since is None:
            self.head_since = self.clock()

    def on_url(self, url: bytes) -> None:
        self._url.append(url)
        self._head_size += len(url)
        if self._head_size > MAX_URL:
            raise _HeadRejected(414, f"request target longer than {MAX_URL} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        size = len(name) + len(value)
        self._head_size += size
        if size > MAX_HEADER or self._head_size > MAX_HEAD:
            what = f"header {name[:64].decode('latin-1')!r}" if size > MAX_HEADER else "request head"
            raise _HeadRejected(431, f"{what} too large (limits: {MAX_HEADER} bytes a header, {MAX_HEAD} in all)")
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        parser = self._parser
        target = b"".join(self._url) if len(self._url) > 1 else self._url[0] if self._url else b""
        if target.startswith(b"/") and b"?" not in target and b"%" not in target and b"#" not in target:
            path, query = target.decode("latin-1"), ""  # the usual origin-form target: nothing to split or decode
        else:
            path, query = _split_target(target)
        request = self._server.make_request(
            self,
            method=parser.get_method().decode("latin-1"),
            path=path,
            query_string=query,
            headers=CIMultiDictProxy(CIMultiDict(self._headers)),
            version=_VERSIONS.get(parser.get_http_version(), (1, 1)),
            keep_alive=parser.should_keep_alive(),
            max_body=self._server.max_body,
            body_timeout=self._server.body_timeout,
            budget=self._server.budget,
        )
        self.head_since = None
        self._parsing = request
        self._pending.append(request)
        if len(self._pending) > MAX_PIPELINED:
            self.pause_reading("pipelined")
        if self._task is None:
            self._task = self._loop.create_task(self._run())
        elif self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self._parsing is not None:
            self._parsing.feed(body)

    def on_message_complete(self) -> None:
        if self._parsing is not None:
            self._parsing.finish()
            self._parsing = None

    # -- used by requests and answers (wire.Connection) ---------------------------------------------
    def write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("the client closed the connection")
        if self.write_paused:
            waiter = self._loop.create_future()
            self._drain_waiters.append(waiter)
            await waiter

    def buffer_grew(self, size: int) -> bool:
        self.buffered += size
        if self.buffered > self._server.max_buffer:
            self.pause_reading("buffer")
            return True
        return False

    def paused(self) -> bool:
        return bool(self._read_pauses)

    def buffer_shrank(self, size: int) -> None:
        self.buffered -= size
        if self.buffered <= self._server.max_buffer:
            self.resume_reading("buffer")

    def await_bytes(self, size: int) -> None:
        """A reader waits for ``size`` more body bytes (1: for any byte): the kernel holds smaller pieces back until
        that many arrived (``SO_RCVLOWAT``; at most ``MAX_LOW_WATER`` and what fits under ``max_buffer``), so a body
        sent in tiny pieces wakes the router once a batch, not once a piece (each wake-up costs more in the kernel
        than the piece does here)."""
        size = max(1, min(size, MAX_LOW_WATER, self._server.max_buffer + 1 - self.buffered))
        sock = self._sock
        if size == self._low_water or sock is None or self.closed or self.transport is None:
            return
        if self.transport.is_closing():  # its descriptor may be closed already, its number another socket's
            return
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, size)
        except OSError as e:
            log.warning("cannot set the receive low-water mark (%s): body bytes are read as they arrive", e)
            self._sock = None
            return
        self._low_water = size

    def let_in_held(self) -> int:
        """Body bytes the kernel holds back below the low-water mark (they arrived, unread); if any, the mark drops
        so they are read (the body timer and the body rate judge what arrived, not what was read)."""
        if self._low_water == 1 or self._sock is None or self.closed or self.transport is None:
            return 0
        if self.transport.is_closing():
            return 0
        try:
            held: int = struct.unpack("i", fcntl.ioctl(self._sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
        except OSError:
            held = 0
        self.await_bytes(1)
        return held

    def clock(self) -> float:
        now = self._loop.time()
        return now - self._paused_for - (now - self._paused_at if self._read_pauses else 0.0)

    def pause_reading(self, why: str) -> None:
        if not self._read_pauses:
            self._paused_at = self._loop.time()
            if self.transport is not None and not self.closed:
                self.transport.pause_reading()
        self._read_pauses.add(why)

    def resume_reading(self, why: str) -> None:
        if why in self._read_pauses:
            self._read_pauses.discard(why)
            if not self._read_pauses:
                self._paused_for += self._loop.time() - self._paused_at
                if self.transport is not None and not self.closed:
                    self.transport.resume_reading()

    def check_deadlines(self) -> None:
        """The sweep's look at a slow client: a head past ``head_timeout``, a body slower than ``body_min_rate``
        (time the server itself did not read does not count)."""
        server = self._server
        if self._lingering or self.closed or self._read_pauses:
            return
        now = self.clock()
        if self.head_since is not None and now - self.head_since > server.head_timeout:
            server.rejected("head_timeout")
            self._reject(
                408,
                f"the request head did not arrive within {server.head_timeout:g} s (--head-timeout)",
                "request_head_timeout",
            )
            return
        request = self._parsing
        if request is None or not server.body_min_rate:
            return
        if now - request.started <= server.head_timeout + request.received / server.body_min_rate:
            return
        arrived = request.received + self.let_in_held()  # with what waits unread below the low-water mark
        if request.content_length is not None:
            arrived = min(arrived, request.content_length)
        if now - request.started > server.head_timeout + arrived / server.body_min_rate:
            request.fail(
                BodyTimeout(
                    f"the request body arrived slower than {server.body_min_rate} bytes/s after the first "
                    f"{server.head_timeout:g} s ({arrived} bytes; --body-min-rate)",
                    reason="body_too_slow",
                )
            )

    def closing(self) -> bool:
        return self._server.closing()

    # -- serving -----------------------------------------------------------------------------------
    async def _run(self) -> None:
        """Answer the parsed requests in order, waiting for the next while the connection is idle; ends with
        the connection (an answer that closes it, a rejected head, the client gone: cancelled)."""
        try:
            while not self.closed:
                if not self._pending:
                    if self._lingering:
                        break
                    self._idle = self._loop.create_future()
                    await self._idle
                    self._idle = None
                    continue
                request = self._pending.popleft()
                if len(self._pending) == MAX_PIPELINED:
                    self.resume_reading("pipelined")
                self._busy = True
                try:
                    keep = await self._serve(request)
                finally:
                    request.release()
                    self._busy = False
                    self.idle_since = self._loop.time()
                if not keep:
                    self._end(request)
                    return
            if self._lingering and not self.closed:  # parsing stopped behind these requests (a bad head)
                self._finish_rejected()
        finally:
            self._task = None

    async def _serve(self, request: Request) -> bool:
        """One request answered; whether the connection may carry another."""
        response: Response | None = None
        try:
            response = await self._server.handler(request)
            if request.answered and not response.prepared:  # a second answer after one went out: a router bug
                log.error(
                    "%s %s: a second answer (%d) after the first went out",
                    request.method,
                    request.path,
                    response.status,
                )
                return False  # the connection cannot carry it: closed
            await response.send(request)
        except ConnectionError:
            return False
        except Exception:
            log.exception("%s %s: answer failed", request.method, request.path)
            if not request.answered:
                self.write(_error_bytes(500, "internal error in the router (logged)", "server_error"))
            return False
        return response.keep_alive and request.complete

    def _end(self, request: Request) -> None:
        """Close after an answer: at once when the request was read whole, else after a short linger."""
        for pending in self._pending:
            pending.release()
        self._pending.clear()
        if self.closed or self.transport is None:
            return
        if request.complete and self._parsing is None:
            self.transport.close()
            return
        self._linger()

    def _linger(self, seconds: float = LINGER_SECONDS) -> None:
        transport = self.transport
        if transport is None or self.closed:
            return
        self._stop_parsing()
        for why in list(self._read_pauses):
            self.resume_reading(why)
        if transport.can_write_eof():
            transport.write_eof()  # the client reads the answer and an end; what it still sends is dropped
        self._loop.call_later(seconds, transport.close)

    def _stop_parsing(self) -> None:
        self._lingering = True
        if self._parsing is not None:
            self._parsing.finish_broken()
            self._parsing = None

    def _reject(self, status: int, message: str, code: str) -> None:
        """A head that cannot be served: parsing stops; the requests before it are answered, then this JSON
        error, then the connection ends."""
        log.info("rejected a request: %d %s", status, message)
        self._rejection = _error_bytes(status, message, code)
        self._stop_parsing()
        if not self._busy and not self._pending:
            self._finish_rejected()  # nothing before it to answer (the task, if any, is idle: the close ends it)

    def _finish_rejected(self) -> None:
        if self._rejection:
            self.write(self._rejection)
        self._linger()

    def close_idle(self) -> bool:
        """Close the connection if no request is on it; whether it was closed."""
        if self._busy or self._pending or self._parsing is not None or self.transport is None:
            return False
        self.transport.close()
        return True

    def abort(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.transport is not None:
            self.transport.close()


class Server:
    """Listens on any number of ports (``listen``) and serves every connection with ``handler``.

    ``make_request`` builds each request (the router's carries its core: ``core.Request``); ``closing``
    says when every answer should close its connection (from SIGTERM on: clients retire pooled connections).
    """

    def __init__(
        self,
        handler: Handler,
        *,
        make_request: RequestFactory = Request,
        max_body: int,
        body_timeout: float = 60.0,
        closing: Callable[[], bool] = lambda: False,
        keepalive_timeout: float = 75.0,
        budget: Budget | None = None,
        max_buffer: int = HIGH_WATER,
        head_timeout: float = HEAD_TIMEOUT,
        body_min_rate: int = BODY_MIN_RATE,
        max_connections: int = MAX_CONNECTIONS,
        max_connections_per_client: int = MAX_CONNECTIONS_PER_CLIENT,
        rejected: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.handler = handler
        self.make_request = make_request
        self.max_body = max_body
        self.body_timeout = body_timeout
        self.closing = closing
        self.keepalive_timeout = keepalive_timeout
        self.budget = budget if budget is not None else Budget(UNLIMITED)
        """Request body bytes held by the whole server (``--max-inflight-bytes``), shared with admission."""
        self.max_buffer = max_buffer
        self.head_timeout = head_timeout
        self.body_min_rate = body_min_rate
        """Bytes a second a body must average once ``head_timeout`` has passed (0: no minimum)."""
        self.max_connections = max_connections
        self.max_connections_per_client = max_connections_per_client
        self.rejected = rejected
        """Counts a refusal by reason (``too_many_connections``, ``head_timeout``)."""
        self.connections: set[_Connection] = set()
        self._per_client: dict[str, int] = {}
        self._listeners: list[asyncio.Server] = []
        self._sweeper: asyncio.Task[None] | None = None
        self.loop = asyncio.get_running_loop()

    async def listen(
        self, host: str, port: int, *, backlog: int = 1024, reuse_address: bool = True, reuse_port: bool = False
    ) -> asyncio.Server:
        """Accept connections on host:port; ``close()`` the listener returned to stop accepting there.
        ``reuse_port``: SO_REUSEPORT, the kernel spreads the port's connections over every process listening on it."""
        listener = await self.loop.create_server(
            lambda: _Connection(self), host, port, backlog=backlog, reuse_address=reuse_address, reuse_port=reuse_port
        )
        return self._listening(listener)

    async def listen_unix(self, path: str) -> asyncio.Server:
        """Accept connections on a unix socket (the private endpoints of ``--processes``; ``local_port`` None)."""
        return self._listening(await self.loop.create_unix_server(lambda: _Connection(self), path))

    def _listening(self, listener: asyncio.Server) -> asyncio.Server:
        self._listeners.append(listener)
        if self._sweeper is None:
            self._sweeper = self.loop.create_task(self._sweep(), name="smg-http-keepalive")
        return listener

    def admit(self, conn: _Connection, client: str | None) -> str | None:
        """Count a new connection from ``client`` (None: a unix socket, never refused); why it is refused, or None."""
        if client is None:
            return None
        count = self._per_client.get(client, 0)
        if len(self.connections) >= self.max_connections:
            why = f"the router serves {self.max_connections} connections at most (--max-connections); retry shortly"
        elif count >= self.max_connections_per_client:
            why = (
                f"the router serves {self.max_connections_per_client} connections from one address at most "
                "(--max-connections-per-client); reuse a connection or retry shortly"
            )
        else:
            self._per_client[client] = count + 1
            conn.client = client
            return None
        self.rejected("too_many_connections")
        log.info("refused a connection from %s: %s", client, why)
        return why

    def gone(self, conn: _Connection) -> None:
        """A connection closed: no longer counted."""
        self.connections.discard(conn)
        client = conn.client
        if client is not None:
            conn.client = None
            left = self._per_client[client] - 1
            if left:
                self._per_client[client] = left
            else:
                del self._per_client[client]

    async def _sweep(self) -> None:
        """Idle keep-alive connections close after ``keepalive_timeout``, and slow heads and bodies are cut off
        (``_Connection.check_deadlines``): one timer for all, none per request."""
        period = min(SWEEP_SECONDS, self.keepalive_timeout, self.head_timeout / 4)
        while True:
            await asyncio.sleep(period)
            now = self.loop.time()
            cutoff = now - self.keepalive_timeout
            for conn in list(self.connections):
                if conn.idle_since < cutoff and conn.close_idle():
                    continue
                conn.check_deadlines()

    async def shutdown(self, grace: float) -> None:
        """Stop listening, close idle connections, give busy ones ``grace`` seconds, then cut them off."""
        for listener in self._listeners:
            listener.close()
        self._listeners.clear()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        deadline = self.loop.time() + grace
        while True:
            busy = [c for c in self.connections if not c.close_idle()]
            if not busy or self.loop.time() >= deadline:
                break
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            conn.abort()
        await asyncio.sleep(0)  # the transports' close callbacks run
