"""The lean upstream client against a raw-socket worker that sends what a well-behaved server rarely does.

Chunk extensions and trailers, close-delimited bodies, 1xx responses before the final one, a large error
body on a keep-alive connection, a response in 1-byte writes, garbage, resets, a body above the high-water
mark read slowly, stray bytes after a complete response.  Nothing may hang, nothing may leak into the next
request on the same connection, and every failure is an ``UpstreamConnectError`` before the response
headers, an ``OSError`` or ``TimeoutError`` after them (the exceptions the request path maps to a retry, a
502 or a 504).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
from smg_router.upstream.base import Timeouts, UpstreamConnectError
from smg_router.upstream.lean import HIGH_WATER, LeanResponse, LeanUpstream

HOST = "127.0.0.71"
LIMIT = 10.0
"""Seconds any test may take: generous, so that a hang fails here with a clear error instead of at the
suite's per-test timeout."""

CLOSE = "close"
"""An answer returns this to close the connection after it (FIN); anything else keeps it open."""


@dataclass
class Exchange:
    """One request as the raw worker read it."""

    conn: int
    """Which connection carried it: 0 for the first the worker accepted, 1 for the next, ..."""
    index: int
    """Its place among all the requests the worker read: 0, 1, ..."""
    path: str
    body: bytes
    writer: asyncio.StreamWriter


Answer = Callable[[Exchange], Awaitable[str | None]]


def ok(body: bytes, *, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST instead of a FIN (SO_LINGER 0), as a crashed worker's kernel would."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class RawWorker:
    """Reads each request (head and Content-Length body) and lets the test's ``answer`` write the bytes back."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.exchanges: list[Exchange] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.tasks: set[asyncio.Task[None]] = set()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        conn = len(self.writers)
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                length = next(
                    (
                        int(v)
                        for k, _, v in (line.partition(":") for line in lines[1:])
                        if k.strip().lower() == "content-length"
                    ),
                    0,
                )
                body = await reader.readexactly(length)
                exchange = Exchange(
                    conn=conn, index=len(self.exchanges), path=lines[0].split(" ")[1], body=body, writer=writer
                )
                self.exchanges.append(exchange)
                if await self.answer(exchange) == CLOSE:
                    break
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed or reset the connection
        finally:
            writer.close()
            self.tasks.discard(task)

    @property
    def connections(self) -> list[int]:
        """The connection of every request, in order: [0, 0] means the second reused the first's."""
        return [e.conn for e in self.exchanges]


@contextlib.asynccontextmanager
async def raw_worker(answer: Answer) -> AsyncIterator[tuple[RawWorker, str]]:
    worker = RawWorker(answer)
    server = await asyncio.start_server(worker.serve, HOST, 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield worker, f"http://{HOST}:{port}"
    finally:
        server.close()
        for writer in worker.writers:
            writer.transport.abort()  # every handler's next read ends; it returns on its own
        await asyncio.gather(*worker.tasks, return_exceptions=True)
        await server.wait_closed()


@pytest.fixture
async def client() -> AsyncIterator[LeanUpstream]:
    c = LeanUpstream(Timeouts(connect=2, total=LIMIT * 2))
    yield c
    await c.close()


async def answers_then_numbers(ex: Exchange, first: Callable[[Exchange], Awaitable[str | None]]) -> str | None:
    """The first request gets the test's special answer; every later one ``answer <index>``."""
    if ex.index == 0:
        return await first(ex)
    ex.writer.write(ok(b"answer %d" % ex.index))
    return None


async def post_and_read(client: LeanUpstream, url: str) -> tuple[LeanResponse, bytes]:
    r = await client.post(url + "/v1/completions", b'{"prompt": "x"}', {})
    return r, await r.read()


# -- framing ---------------------------------------------------------------------------------------------------


async def test_a_chunked_body_with_chunk_extensions_and_trailers_is_the_chunks_data_only(client) -> None:
    async def first(ex: Exchange) -> None:
        ex.writer.write(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Checksum\r\n\r\n"
            b"5;name=value\r\nhello\r\n"
            b'6;quoted="a;b";bare\r\n world\r\n'
            b"0\r\nX-Checksum: abc\r\n\r\n"
        )

    async with asyncio.timeout(LIMIT), raw_worker(lambda ex: answers_then_numbers(ex, first)) as (worker, url):
        r, body = await post_and_read(client, url)
        assert (r.status, body) == (200, b"hello world")
        assert "x-checksum" not in r.headers, "a trailer is not a response header"
        _, body2 = await post_and_read(client, url)
        assert body2 == b"answer 1"
        assert worker.connections == [0, 0], "a complete chunked response leaves the connection reusable"


@pytest.mark.parametrize("how", ["read", "chunks"])
async def test_a_close_delimited_body_completes_when_the_worker_closes(client, how: str) -> None:
    async def first(ex: Exchange) -> str:
        ex.writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\ndata: 1\n\n")
        await ex.writer.drain()
        await asyncio.sleep(0.05)
        ex.writer.write(b"data: 2\n\n")
        return CLOSE

    async with asyncio.timeout(LIMIT), raw_worker(lambda ex: answers_then_numbers(ex, first)) as (worker, url):
        r = await client.post(url + "/v1/completions", b"{}", {})
        body = await r.read() if how == "read" else b"".join([c async for c in r.chunks()])
        assert (r.status, body) == (200, b"data: 1\n\ndata: 2\n\n")
        _, body2 = await post_and_read(client, url)
        assert body2 == b"answer 1"
        assert worker.connections == [0, 1], "a closed connection is not reused"


@pytest.mark.parametrize("writes", ["one write", "separate writes"])
async def test_informational_responses_are_skipped_for_the_final_one(client, writes: str) -> None:
    parts = [
        b"HTTP/1.1 100 Continue\r\n\r\n",
        b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n",
        ok(b"final", extra=b"X-Final: yes\r\n"),
    ]

    async def first(ex: Exchange) -> None:
        if writes == "one write":
            ex.writer.write(b"".join(parts))
            return
        for part in parts:
            ex.writer.write(part)
            await ex.writer.drain()
            await asyncio.sleep(0.05)

    async with asyncio.timeout(LIMIT), raw_worker(lambda ex: answers_then_numbers(ex, first)) as (worker, url):
        r, body = await post_and_read(client, url)
        assert (r.status, body) == (200, b"final")
        assert r.headers.get("x-final") == "yes" and "link" not in r.headers
        _, body2 = await post_and_read(client, url)
        assert body2 == b"answer 1"
        assert worker.connections == [0, 0]


async def test_a_response_in_one_byte_writes(client) -> None:
    response = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n"
    )

    async def first(ex: Exchange) -> None:
        for i in range(len(response)):
            ex.writer.write(response[i : i + 1])
            await ex.writer.drain()
            await asyncio.sleep(0.001)

    async with asyncio.timeout(LIMIT), raw_worker(lambda ex: answers_then_numbers(ex, first)) as (worker, url):
        r = await client.post(url + "/v1/completions", b"{}", {})
        assert r.status == 200 and r.headers["content-type"] == "text/event-stream"
        assert b"".join([c async for c in r.chunks()]) == b"data: 1\n\ndata: 2\n\n"
        _, body2 = await post_and_read(client, url)
        assert body2 == b"answer 1"
        assert worker.connections == [0, 0]


# -- keep-alive after large bodies -----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["read", "released unread"])
async def test_a_keep_alive_connection_is_reused_after_a_large_error_body(client, how: str) -> None:
    # The body's last bytes arrive in one piece that both crosses the high-water mark (reading pauses) and
    # completes the response: the state in which the connection goes back to the pool.
    size = HIGH_WATER + 1900
    head = b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % size

    async def first(ex: Exchange) -> None:
        ex.writer.write(head + b"e" * (HIGH_WATER - 100))
        await ex.writer.drain()
        await asyncio.sleep(0.2)
        ex.writer.write(b"e" * 2000)

    async with asyncio.timeout(LIMIT), raw_worker(lambda ex: answers_then_numbers(ex, first)) as (worker, url):
        r = await client.post(url + "/v1/completions", b"{}", {})
        assert r.status == 500
        if how == "read":
            assert await r.read() == b"e" * size
        else:
            await asyncio.sleep(0.5)  # the whole body has arrived, nobody read it
            r.release()  # what the retry path does with a 5xx
        _, body2 = await post_and_read(client, url)
        assert body2 == b"answer 1"
        assert worker.connections == [0, 0]


async def test_a_body_above_the_high_water_mark_read_slowly_then_the_connection_is_reused(client) -> None:
    size = 8 * HIGH_WATER
    pattern = bytes(range(256)) * (size // 256)

    async def first(ex: Exchange) -> None:
        ex.writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size + pattern)

    async with asyncio.timeout(LIMIT), raw_worker(lambda ex: answers_then_numbers(ex, first)) as (worker, url):
        r = await client.post(url + "/v1/completions", b"{}", {})
        got = []
        async for chunk in r.chunks():
            got.append(chunk)
            await asyncio.sleep(0.005)  # a slow client: reading from the worker pauses and resumes
        assert b"".join(got) == pattern
        _, body2 = await post_and_read(client, url)
        assert body2 == b"answer 1"
        assert worker.connections == [0, 0]


# -- failures --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "reply",
    [
        b"garbage\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n",
        b"",
        b"HTTP/1.1 200 OK\r\nContent-Le",
    ],
    ids=["garbage", "an upgrade nobody asked for", "closed at once", "closed inside the head"],
)
async def test_a_failure_before_the_response_headers_is_a_connect_error(client, reply: bytes) -> None:
    async def first(ex: Exchange) -> str:
        ex.writer.write(reply)
        return CLOSE

    async with asyncio.timeout(LIMIT), raw_worker(lambda ex: answers_then_numbers(ex, first)) as (worker, url):
        with pytest.raises(UpstreamConnectError):
            await client.post(url + "/v1/completions", b"{}", {})
        _, body2 = await post_and_read(client, url)
        assert body2 == b"answer 1"
        assert worker.connections == [0, 1]


@pytest.mark.parametrize("framing", ["content-length", "chunked", "close-delimited"])
@pytest.mark.parametrize("how", ["read", "chunks"])
async def test_a_reset_mid_body_is_an_os_error(client, framing: str, how: str) -> None:
    heads = {
        "content-length": b"Content-Length: 1000\r\n",
        "chunked": b"Transfer-Encoding: chunked\r\n",
        "close-delimited": b"Connection: close\r\n",
    }
    first_part = {
        "content-length": b"x" * 100,
        "chunked": b"64\r\n" + b"x" * 100 + b"\r\n",
        "close-delimited": b"x" * 100,
    }

    async def first(ex: Exchange) -> str:
        ex.writer.write(b"HTTP/1.1 200 OK\r\n" + heads[framing] + b"\r\n" + first_part[framing])
        await ex.writer.drain()
        await asyncio.sleep(0.05)
        reset(ex.writer)
        return CLOSE

    async with asyncio.timeout(LIMIT), raw_worker(lambda ex: answers_then_numbers(ex, first)) as (worker, url):
        r = await client.post(url + "/v1/completions", b"{}", {})
        assert r.status == 200
        with pytest.raises(OSError) as caught:
            if how == "read":
                await r.read()
            else:
                async for _ in r.chunks():
                    pass
        assert not isinstance(caught.value, TimeoutError)
        r.abort()
        _, body2 = await post_and_read(client, url)
        assert body2 == b"answer 1"
        assert worker.connections == [0, 1]


async def test_a_malformed_body_after_the_headers_is_an_os_error(client) -> None:
    async def first(ex: Exchange) -> None:
        ex.writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n")

    async with asyncio.timeout(LIMIT), raw_worker(lambda ex: answers_then_numbers(ex, first)) as (worker, url):
        r = await client.post(url + "/v1/completions", b"{}", {})
        assert r.status == 200
        with pytest.raises(OSError):
            await r.read()
        r.abort()
        _, body2 = await post_and_read(client, url)
        assert body2 == b"answer 1"
        assert worker.connections == [0, 1]


# -- stray bytes -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["in the same write", "while the connection is idle", "just before its reuse"])
async def test_stray_bytes_after_a_complete_response_never_reach_the_next_request(client, when: str) -> None:
    stray = ok(b"STRAY", extra=b"X-Stray: 1\r\n")

    async def first(ex: Exchange) -> None:
        if when == "in the same write":
            ex.writer.write(ok(b"first") + stray)
            return
        ex.writer.write(ok(b"first"))
        if when == "while the connection is idle":
            await ex.writer.drain()
            await asyncio.sleep(0.05)
            ex.writer.write(stray)

    async with asyncio.timeout(LIMIT), raw_worker(lambda ex: answers_then_numbers(ex, first)) as (worker, url):
        r, body = await post_and_read(client, url)
        assert (r.status, body) == (200, b"first")
        assert "x-stray" not in r.headers
        if when == "while the connection is idle":
            await asyncio.sleep(0.3)
        elif when == "just before its reuse":
            worker.writers[0].write(stray)  # lands in the client's socket buffer before it reuses the connection
        r2, body2 = await post_and_read(client, url)
        assert body2 == b"answer 1" and "x-stray" not in r2.headers
        assert worker.connections == [0, 1], "a connection that carried stray bytes must not be pooled"
