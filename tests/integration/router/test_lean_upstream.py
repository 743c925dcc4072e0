"""The lean upstream client against a real aiohttp server on loopback: framing, keep-alive reuse, stale
connections, streaming with backpressure, aborts, deadlines and connect errors."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from smg_router.upstream.base import Timeouts, UpstreamConnectError
from smg_router.upstream.lean import HIGH_WATER, LeanUpstream
from support.procs import free_port


class Server:
    def __init__(self) -> None:
        self.peers: list[tuple[str, int]] = []
        self.disconnects = 0
        self.sent = 0

    async def echo(self, request: web.Request) -> web.Response:
        self.peers.append(request.transport.get_extra_info("peername"))
        body = await request.read()
        return web.Response(body=b"echo:" + body, headers={"X-Seen-Auth": request.headers.get("authorization", "")})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        self.peers.append(request.transport.get_extra_info("peername"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(int(request.query.get("n", "5"))):
                await resp.write(f"data: {i}\n\n".encode() + b"x" * int(request.query.get("pad", "0")))
                self.sent += 1
                await asyncio.sleep(float(request.query.get("gap", "0")))
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnects += 1
            raise
        await resp.write_eof()
        return resp

    async def close_after(self, request: web.Request) -> web.Response:
        self.peers.append(request.transport.get_extra_info("peername"))
        return web.Response(body=b"bye", headers={"Connection": "close"})

    async def slow(self, request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.Response(body=b"late")


@pytest.fixture
async def server() -> AsyncIterator[tuple[Server, str]]:
    s = Server()
    app = web.Application()
    app.router.add_post("/echo", s.echo)
    app.router.add_post("/stream", s.stream)
    app.router.add_post("/close", s.close_after)
    app.router.add_post("/slow", s.slow)
    runner = web.AppRunner(app, handler_cancellation=True, keepalive_timeout=0.3)
    await runner.setup()
    port = free_port("127.0.0.5")
    await web.TCPSite(runner, "127.0.0.5", port).start()
    yield s, f"http://127.0.0.5:{port}"
    await runner.cleanup()


@pytest.fixture
async def client() -> AsyncIterator[LeanUpstream]:
    c = LeanUpstream(Timeouts(connect=2, total=3))
    yield c
    await c.close()


async def test_content_length_response_and_keep_alive_reuse(server, client) -> None:
    srv, url = server
    first = await client.post(url + "/echo", b"hello", {"Authorization": "Bearer t"})
    assert first.status == 200 and await first.read() == b"echo:hello"
    assert first.headers["x-seen-auth"] == "Bearer t"
    second = await client.post(url + "/echo", b"again", {})
    assert await second.read() == b"echo:again"
    assert srv.peers[0] == srv.peers[1]  # the same connection carried both requests


async def test_a_worker_that_left_keeps_no_idle_connection(server, client) -> None:
    srv, url = server
    first = await client.post(url + "/echo", b"hello", {})
    assert await first.read() == b"echo:hello"  # its connection waits idle in the pool
    client.forget(url)  # the worker was removed: the pool lets go of it at once
    second = await client.post(url + "/echo", b"again", {})
    assert await second.read() == b"echo:again"
    assert srv.peers[0] != srv.peers[1]  # a new connection: the idle one was closed


async def test_connection_close_is_honoured(server, client) -> None:
    srv, url = server
    r = await client.post(url + "/close", b"", {})
    assert await r.read() == b"bye"
    r = await client.post(url + "/echo", b"x", {})
    assert await r.read() == b"echo:x"
    assert srv.peers[0] != srv.peers[1]


async def test_an_idle_connection_the_server_closed_is_replaced_transparently(server, client) -> None:
    srv, url = server
    assert await (await client.post(url + "/echo", b"1", {})).read() == b"echo:1"
    await asyncio.sleep(0.6)  # past the server's keep-alive timeout: it closes the idle connection
    assert await (await client.post(url + "/echo", b"2", {})).read() == b"echo:2"
    assert srv.peers[0] != srv.peers[1]


async def test_chunked_stream_arrives_in_order(server, client) -> None:
    _, url = server
    r = await client.post(url + "/stream?n=20", b"", {})
    assert r.headers["content-type"] == "text/event-stream" and r.status == 200
    body = b"".join([c async for c in r.chunks()])
    assert body == b"".join(f"data: {i}\n\n".encode() for i in range(20))


async def test_a_piped_stream_reaches_its_sink_whole_and_in_order_and_says_where_it_stopped(server, client) -> None:
    srv, url = server
    r = await client.post(url + "/stream?n=30&gap=0.002", b"", {})
    got: list[tuple[bytes, bool]] = []

    def sink(chunk: bytes, last: bool) -> bool:
        got.append((chunk, last))
        return len(got) != 3  # the third piece asks to stop: pipe returns, the rest waits for the next pipe

    assert await r.pipe(sink) is False and len(got) == 3
    assert await r.pipe(lambda chunk, last: bool(got.append((chunk, last))) or True) is True
    assert b"".join(c for c, _ in got) == b"".join(f"data: {i}\n\n".encode() for i in range(30))
    assert [last for _, last in got].count(True) <= 1 and not any(last for _, last in got[:-1])
    r2 = await client.post(url + "/echo", b"again", {})  # released at the end: the connection serves the next one
    assert await r2.read() == b"echo:again"
    assert srv.peers[-1] == srv.peers[-2]


async def test_what_a_sink_raises_the_pipe_raises_and_the_connection_is_not_reused(server, client) -> None:
    srv, url = server
    r = await client.post(url + "/stream?n=5&gap=0.01", b"", {})

    def sink(chunk: bytes, last: bool) -> bool:
        raise RuntimeError("a bug in the sink")

    with pytest.raises(RuntimeError, match="a bug in the sink"):
        await r.pipe(sink)
    r.abort()
    assert await (await client.post(url + "/echo", b"1", {})).read() == b"echo:1"
    assert srv.peers[-1] != srv.peers[-2]  # a fresh connection: the broken-off one was closed


async def test_a_slow_reader_pauses_the_worker(server, client) -> None:
    srv, url = server
    r = await client.post(url + "/stream?n=2000&pad=16384", b"", {})  # 32 MB: more than the kernel buffers
    it = r.chunks().__aiter__()
    await it.__anext__()
    await asyncio.sleep(0.5)  # we do not read; the client stops reading from the socket
    assert srv.sent < 2000, "the server could send everything although nobody read it"
    rest = [c async for c in it]
    assert sum(map(len, rest)) > HIGH_WATER and srv.sent == 2000


async def test_abort_mid_stream_reaches_the_worker(server, client) -> None:
    srv, url = server
    r = await client.post(url + "/stream?n=1000&gap=0.01", b"", {})
    it = r.chunks().__aiter__()
    await it.__anext__()
    r.abort()
    for _ in range(100):
        if srv.disconnects:
            break
        await asyncio.sleep(0.02)
    assert srv.disconnects == 1


async def test_deadline_and_connect_errors(server, client) -> None:
    _, url = server
    with pytest.raises(TimeoutError):
        await client.post(url + "/slow", b"", {})
    port = free_port("127.0.0.6")
    with pytest.raises(UpstreamConnectError) as err:
        await client.post(f"http://127.0.0.6:{port}/echo", b"", {})
    assert str(err.value) == "cannot connect: Connection refused"  # its text reaches clients: no address in it
    with contextlib.suppress(Exception):
        await client.close()


async def test_chunks_that_arrive_together_are_relayed_as_one_piece_and_later_ones_on_their_own() -> None:
    """Several chunks of a chunked body in one read (an engine's SSE events) come out as one piece (one write
    to the client); a chunk that arrives later is its own piece (the stream is not held back)."""
    go_on = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        writer.write(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in (b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n"))
        )
        await writer.drain()
        await go_on.wait()
        writer.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.6", 0)
    client = LeanUpstream(Timeouts(connect=2, total=10))
    try:
        url = f"http://127.0.0.6:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
        response = await client.post(url, b"{}", {})
        pieces = []
        async for piece in response.chunks():
            pieces.append(piece)
            go_on.set()
        assert pieces == [b"data: 1\n\ndata: 2\n\ndata: 3\n\n", b"data: [DONE]\n\n"]
    finally:
        await client.close()
        server.close()
        await server.wait_closed()
