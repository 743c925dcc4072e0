"""The soak's hostile traffic (``bench/soak.py --hostile``), mixed into the legitimate requests of the same run.

- Slow clients: connections that declare a large body and trickle it (or never finish their head), far below
  ``--body-min-rate``: the router answers each with a 408 past ``--head-timeout`` and closes it; the client then
  opens a new one, until the end of the run.
- Pipelining clients: connections that send a slow first request (a long non-streamed completion) and, behind it
  at once, several requests of ~1 MiB each: the router buffers at most ``--max-connection-buffer`` of them and
  counts their bytes against ``--max-inflight-bytes`` as they arrive.  Their answers are read in order; then the
  connection is closed and, after a pause, a new one opened.
- A silent peer: a TCP listener, given to the router as ``--peer``, that accepts connections, reads what it is
  sent and never answers (the router's queue for it is bounded by ``--peer-queue-bytes`` and
  ``--peer-queue-seconds``).

Raw sockets (asyncio streams): an HTTP client library would neither trickle nor pipeline.  Every answer is
counted by status, and every connection by how it ended (closed by the router after an answer, closed or reset
without one, or still open at the end of the run).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

MIB = 2**20


@dataclass
class HostileTally:
    slow_connections: int = 0
    slow_statuses: Counter[str] = field(default_factory=Counter)
    slow_closed_after_answer: int = 0
    slow_closed_without_answer: int = 0
    slow_open_at_end: int = 0
    slow_longest_answer_s: float = 0.0  # from the connection's open to its answer
    pipe_connections: int = 0
    pipe_requests_sent: int = 0
    pipe_body_bytes_sent: int = 0
    pipe_statuses: Counter[str] = field(default_factory=Counter)
    pipe_closed_early: int = 0  # the router closed (or reset) the connection before every request had its answer
    pipe_open_at_end: int = 0
    peer_connections: int = 0
    peer_bytes_received: int = 0

    def as_dict(self) -> dict[str, object]:
        return {k: dict(sorted(v.items())) if isinstance(v, Counter) else v for k, v in self.__dict__.items()}


class Closed(Exception):
    """The connection ended before a whole answer came."""


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """One HTTP/1.1 answer, read whole: its status and whether the router closes the connection after it."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError) as e:
        raise Closed from e
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    try:
        if "content-length" in headers:
            await reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                await reader.readexactly(size + 2)
                if size == 0:
                    break
    except (asyncio.IncompleteReadError, ConnectionError) as e:
        raise Closed from e
    return status, headers.get("connection", "").lower() == "close"


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError, OSError):
        await writer.wait_closed()


async def _at_eof(reader: asyncio.StreamReader, within: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), within) == b""
    except (ConnectionError, TimeoutError):
        return True


async def slow_client(host: str, port: int, tally: HostileTally, *, index: int, interval: float) -> None:
    """Forever: a connection that trickles 16 bytes every ``interval`` seconds, of its body (even ``index``: the
    head declares 1 MB) or of a head that never ends (odd ``index``), until the router answers and closes it."""
    loop = asyncio.get_running_loop()
    while True:
        opened = loop.time()
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(1.0)
            continue
        tally.slow_connections += 1
        if index % 2 == 0:
            first = (
                f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {MIB}\r\n\r\n"
            ).encode()
            piece = b"x" * 16
        else:
            first, piece = f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n".encode(), b"X-Slow: aaaa\r\n"

        async def trickle(writer: asyncio.StreamWriter = writer, first: bytes = first, piece: bytes = piece) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                writer.write(first)
                await writer.drain()
                while True:
                    await asyncio.sleep(interval)
                    writer.write(piece)
                    await writer.drain()

        sender = loop.create_task(trickle(), name=f"soak-slow-{index}")
        try:
            status, _ = await read_response(reader)
        except Closed:
            tally.slow_closed_without_answer += 1
        except asyncio.CancelledError:
            tally.slow_open_at_end += 1
            raise
        else:
            tally.slow_statuses[str(status)] += 1
            tally.slow_longest_answer_s = max(tally.slow_longest_answer_s, loop.time() - opened)
            if await _at_eof(reader, 5.0):
                tally.slow_closed_after_answer += 1
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender
            await _close(writer)


def _request(host: str, port: int, body: bytes) -> bytes:
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def pipelining_client(
    host: str,
    port: int,
    tally: HostileTally,
    *,
    index: int,
    model: str,
    slow_tokens: int,
    bodies: int,
    pause: float,
) -> None:
    """Forever: a connection with a non-streamed ``slow_tokens``-token completion first and ``bodies`` requests of
    ~1 MiB each (a short prompt, a 1-token answer, the rest an unused field) pipelined behind it, every answer read
    in order; then it closes, waits ``pause`` seconds and starts again."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(1.0)
            continue
        tally.pipe_connections += 1
        slow = json.dumps({"model": model, "prompt": f"{uuid.uuid4()} pipelined", "max_tokens": slow_tokens})
        payload = [_request(host, port, slow.encode())]
        for _ in range(bodies):
            small = {"model": model, "prompt": f"{uuid.uuid4()} pipelined", "max_tokens": 1, "padding": ""}
            padding = "p" * (MIB - len(json.dumps(small)))
            payload.append(_request(host, port, json.dumps({**small, "padding": padding}).encode()))

        async def send(writer: asyncio.StreamWriter = writer, payload: list[bytes] = payload) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                for request in payload:
                    writer.write(request)
                    tally.pipe_requests_sent += 1
                    tally.pipe_body_bytes_sent += len(request)
                    await writer.drain()  # blocks while the router stops reading (its connection buffer is full)

        sender = loop.create_task(send(), name=f"soak-pipelining-{index}")
        try:
            for _ in payload:
                status, closing = await asyncio.wait_for(read_response(reader), 120.0)
                tally.pipe_statuses[str(status)] += 1
                if closing:
                    tally.pipe_closed_early += 1
                    break
        except (Closed, TimeoutError):
            tally.pipe_closed_early += 1
        except asyncio.CancelledError:
            tally.pipe_open_at_end += 1
            raise
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender
            await _close(writer)
        await asyncio.sleep(pause)


class SilentPeer:
    """A TCP listener that accepts every connection, reads and drops what it is sent and never answers.  Its socket
    is bound at construction (the router is started with its address before the event loop runs)."""

    def __init__(self, host: str, tally: HostileTally) -> None:
        self.sock = socket.create_server((host, 0))
        self.host, self.port = self.sock.getsockname()[:2]
        self.tally = tally
        self._server: asyncio.Server | None = None
        self._conns: dict[asyncio.StreamWriter, asyncio.Task[Any]] = {}

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, sock=self.sock)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.tally.peer_connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._conns[writer] = task
        try:
            while data := await reader.read(65536):
                self.tally.peer_bytes_received += len(data)
        except ConnectionError:
            pass
        finally:
            self._conns.pop(writer, None)
            writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        # a handler left to be cancelled when the loop ends logs its CancelledError: closed here, each reads its EOF
        handlers = list(self._conns.values())
        for writer in list(self._conns):
            writer.close()
        if handlers:
            await asyncio.wait(handlers, timeout=2.0)
        if self._server is not None:
            await self._server.wait_closed()
