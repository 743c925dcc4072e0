"""The router's HTTP/1.1 server (``smg_router.server``) on a loopback socket, with raw bytes on the client side:
keep-alive, pipelining, HTTP/1.0, chunked bodies, bad and oversized heads, a client that leaves, idle connections,
streams and their backpressure, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest
from smg_router import server as server_module
from smg_router.server import Server
from smg_router.wire import BodyTooLarge, Request, Response, StreamResponse


class App:
    """Handlers by path; records what it saw."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, bytes]] = []
        self.cancelled = asyncio.Event()
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, request: Request) -> Response:
        if request.path == "/slow":
            self.started.set()
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if request.path == "/stream":
            out = StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            for i in range(3):
                await out.write(b"data: %d\n\n" % i)
            await out.write_eof()
            return out
        if request.path in ("/early", "/twice"):  # answered at once, then the handler's own work goes on
            await request.read()
            early = Response(body=b"early", content_type="text/plain")
            early.send_now(request)
            self.started.set()
            await self.release.wait()
            return early if request.path == "/early" else Response(status=500, body=b"a second answer")
        if request.path == "/noread":
            return Response(status=401, body=b'{"error": "no"}', content_type="application/json")
        try:
            body = await request.read()
        except BodyTooLarge:
            return Response(status=413, body=b"too large")
        self.seen.append((request.method, request.path, body))
        answer = {"path": request.path, "len": len(body), "q": dict(request.query)}
        return Response(body=json.dumps(answer).encode(), content_type="application/json")


@contextlib.asynccontextmanager
async def serving(app: App, **kwargs: object) -> AsyncIterator[tuple[Server, int]]:
    server = Server(app, max_body=kwargs.pop("max_body", 1000), **kwargs)  # type: ignore[arg-type]
    listener = await server.listen("127.0.0.1", 0)
    try:
        yield server, listener.sockets[0].getsockname()[1]
    finally:
        await server.shutdown(1.0)


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One answer: status, headers (lower-cased), body (Content-Length or chunked, decoded)."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    lines = head.split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    body = b""
    if headers.get("transfer-encoding") == "chunked":
        while (size := int((await reader.readline()).strip(), 16)) > 0:
            body += await reader.readexactly(size)
            await reader.readexactly(2)
        await reader.readexactly(2)
    return status, headers, body


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


async def test_keep_alive_and_pipelined_requests_are_answered_in_order_on_one_connection() -> None:
    app = App()
    async with serving(app) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/a?x=1&x=2&y=", b"one") + post("/b", b"two!") + post("/c", b""))
        answers = [await read_answer(reader) for _ in range(3)]
        assert [json.loads(b)["path"] for _, _, b in answers] == ["/a", "/b", "/c"]
        assert [json.loads(b)["len"] for _, _, b in answers] == [3, 4, 0]
        assert json.loads(answers[0][2])["q"] == {"x": "1", "y": ""}  # the first of a repeated key, blank kept
        assert all(h.get("connection") != "close" and "date" in h for _, h, _ in answers)
        writer.write(post("/d", b"again"))  # still open
        assert (await read_answer(reader))[0] == 200
        writer.close()


async def test_http_1_0_closes_after_the_answer_and_keep_alive_is_honoured() -> None:
    app = App()
    async with serving(app) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /a HTTP/1.0\r\nContent-Length: 2\r\n\r\nhi")
        status, headers, _ = await read_answer(reader)
        assert status == 200 and headers["connection"] == "close"
        assert await reader.read() == b""  # closed by the server
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /a HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nhi" * 2)
        assert [(await read_answer(reader))[1]["connection"] for _ in range(2)] == ["keep-alive"] * 2
        writer.close()


async def test_a_chunked_body_arriving_in_pieces_is_read_whole() -> None:
    app = App()
    async with serving(app) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"6\r\n world\r\n0\r\n\r\n")
        status, _, body = await read_answer(reader)
        assert status == 200 and json.loads(body)["len"] == 11
        assert app.seen[-1][2] == b"hello world"
        writer.close()


@pytest.mark.parametrize(
    ("raw", "status", "words"),
    [
        (b"GARBAGE\r\n\r\n", 400, "malformed HTTP request"),
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", 414, "request target longer"),
        (b"GET / HTTP/1.1\r\nX-Big: " + b"b" * 9000 + b"\r\n\r\n", 431, "'X-Big' too large"),
        (
            b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 1000) for i in range(70)) + b"\r\n",
            431,
            "head",
        ),
    ],
)
async def test_a_bad_or_oversized_head_gets_a_json_error_and_the_connection_closes(
    raw: bytes, status: int, words: str
) -> None:
    async with serving(App()) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        got, headers, body = await read_answer(reader)
        assert got == status and headers["content-type"] == "application/json"
        assert words in json.loads(body)["error"]["message"]
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()


async def test_a_pipelined_request_before_a_bad_head_is_still_answered() -> None:
    async with serving(App()) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/a", b"ok") + b"NOT HTTP\r\n\r\n")
        assert (await read_answer(reader))[0] == 200
        assert (await read_answer(reader))[0] == 400
        writer.close()


async def test_an_idle_keep_alive_connection_serves_on_answers_a_bad_head_and_ends_when_the_client_leaves() -> None:
    """One task serves a connection from its first request to its end: it waits while the connection is idle,
    a bad head then is still answered (nothing before it to wait for), and a client leaving an idle connection
    ends the task (no task left behind)."""
    async with serving(App()) as (server, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for path in ("/a", "/b"):
            writer.write(post(path, b"x"))
            assert (await read_answer(reader))[0] == 200
            await asyncio.sleep(0.02)  # idle between requests
        writer.write(b"NOT HTTP\r\n\r\n")
        status, _, body = await read_answer(reader)
        assert status == 400 and json.loads(body)["error"]["code"] == "bad_http_request"
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()

        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/a", b"x"))
        assert (await read_answer(reader))[0] == 200
        (conn,) = [c for c in server.connections if not c.closed and c._task is not None]
        task = conn._task
        assert task is not None and not task.done()  # waiting for the next request
        writer.close()
        await asyncio.wait_for(asyncio.wait({task}), 5)
        assert task.cancelled() and conn._task is None


async def test_a_client_that_leaves_cancels_its_handler() -> None:
    app = App()
    async with serving(app) as (server, port):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/slow", b"x"))
        await asyncio.wait_for(app.started.wait(), 5)
        writer.close()
        await asyncio.wait_for(app.cancelled.wait(), 5)
        await asyncio.sleep(0.05)
        assert not server.connections


async def test_an_answer_before_the_body_ended_is_read_by_the_client_then_the_connection_closes() -> None:
    async with serving(App(), max_body=10) as (_, port):
        # a body over the limit: 413 while the client is still sending
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"z" * 20)
        status, headers, body = await read_answer(reader)
        assert status == 413 and headers["connection"] == "close" and body == b"too large"
        writer.write(b"z" * 50_000)  # what it still sends is dropped, no reset under the answer
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        # a handler that answers without reading the body
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /noread HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\nabc")
        status, headers, _ = await read_answer(reader)
        assert status == 401
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()


async def test_a_stream_is_chunked_and_a_head_request_gets_no_body() -> None:
    async with serving(App()) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = await read_answer(reader)
        assert status == 200 and headers["transfer-encoding"] == "chunked"
        assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        writer.write(b"HEAD /a HTTP/1.1\r\nHost: x\r\n\r\nGET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert b"Content-Length: " in head
        status, _, body = await read_answer(reader)  # the next answer starts right after the head
        assert status == 200 and json.loads(body)["path"] == "/a"
        writer.close()


async def test_a_slow_client_holds_the_stream_back() -> None:
    """Backpressure: a stream's write waits while the client reads nothing."""
    written = 0
    blocked = asyncio.Event()

    async def handler(request: Request) -> Response:
        nonlocal written
        out = StreamResponse()
        await out.prepare(request)
        chunk = b"x" * 65536
        for _ in range(2000):  # 128 MiB if nothing held it back
            try:
                await asyncio.wait_for(out.write(chunk), 1.0)
            except TimeoutError:
                blocked.set()
                await asyncio.sleep(3600)
            written += len(chunk)
        return out

    server = Server(handler, max_body=100)  # type: ignore[arg-type]
    listener = await server.listen("127.0.0.1", 0)
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", listener.sockets[0].getsockname()[1])
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(blocked.wait(), 10)
        assert written < 64 * 1024 * 1024  # kernel buffers and the transport's high-water mark, no more
        writer.close()
    finally:
        await server.shutdown(0.1)


async def test_idle_connections_close_after_the_keep_alive_timeout_and_shutdown_closes_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(server_module, "SWEEP_SECONDS", 0.05)
    app = App()
    async with serving(app, keepalive_timeout=0.2) as (server, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/a", b"1"))
        await read_answer(reader)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # the sweeper closed it
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/slow", b"1"))
        await asyncio.wait_for(app.started.wait(), 5)
        await server.shutdown(0.1)  # a busy connection gets its grace, then is cut off
        assert app.cancelled.is_set()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()


async def test_every_answer_says_connection_close_once_the_server_is_closing() -> None:
    closing = False
    async with serving(App(), closing=lambda: closing) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/a", b"1"))
        assert "connection" not in (await read_answer(reader))[1]
        closing = True
        writer.write(post("/a", b"1"))
        assert (await read_answer(reader))[1]["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()


@pytest.mark.parametrize(
    ("target", "path", "query"),
    [
        ("/v1/chat/completions", "/v1/chat/completions", {}),
        ("/workers/a%2Fb?url=http%3A%2F%2Fw%3A1", "/workers/a/b", {"url": "http://w:1"}),
        ("http://router:30000/a%20b?x=1", "/a b", {"x": "1"}),
        ("/frag#x", "/frag", {}),
    ],
)
async def test_the_request_target_is_split_and_decoded(target: str, path: str, query: dict[str, str]) -> None:
    async with serving(App()) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"POST {target} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode())
        status, _, body = await read_answer(reader)
        assert status == 200 and json.loads(body)["path"] == path and json.loads(body)["q"] == query
        writer.close()


@pytest.mark.parametrize("version", ["1.1", "1.0"])
async def test_a_held_head_and_a_last_chunk_go_out_in_fewer_writes_as_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    """``prepare(hold=True)`` sends the head with the first chunk and ``write(last=True)`` the body's end with the
    last one: 2 socket writes instead of 4 for a stream of two chunks, and the client reads the same answer."""
    writes: list[bytes] = []
    real = server_module._Connection.write

    def recording(self: server_module._Connection, data: bytes) -> None:
        writes.append(data)
        real(self, data)

    monkeypatch.setattr(server_module._Connection, "write", recording)

    async def handler(request: Request) -> Response:
        lean = request.path == "/lean"
        out = StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request, hold=lean)
        await out.write(b"data: 0\n\n")
        await out.write(b"data: 1\n\n", last=lean)
        await out.write_eof()
        return out

    server = Server(handler, max_body=100)  # type: ignore[arg-type]
    listener = await server.listen("127.0.0.1", 0)
    answers, counts = {}, {}
    try:
        for path in ("/plain", "/lean"):
            writes.clear()
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.sockets[0].getsockname()[1])
            writer.write(f"GET {path} HTTP/{version}\r\nHost: x\r\n\r\n".encode())
            status, headers, body = await read_answer(reader)
            if version == "1.0":  # no chunked encoding: the body runs to the close
                body = await reader.read()
                assert "transfer-encoding" not in headers
            else:
                assert headers["transfer-encoding"] == "chunked"
            answers[path] = (status, headers.get("content-type"), body)
            counts[path] = len([w for w in writes if w])
            writer.close()
    finally:
        await server.shutdown(0.1)
    assert answers["/lean"] == answers["/plain"] == (200, "text/event-stream", b"data: 0\n\ndata: 1\n\n")
    assert counts == ({"/plain": 4, "/lean": 2} if version == "1.1" else {"/plain": 3, "/lean": 2})


async def test_an_answer_sent_at_once_reaches_the_client_before_its_handler_ends_and_no_second_one_follows() -> None:
    """``Response.send_now``: a relay writes a whole answer before its bookkeeping, the client does not wait for it
    (here, for an event set only once the client read the answer); the connection serves on.  A handler that
    returns another answer after one went out (a bug) gets it dropped, logged, and the connection closed: the client
    reads the first answer and an end, never a second answer in its stream."""
    app = App()
    async with serving(app) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/early", b"x"))
        status, _, body = await asyncio.wait_for(read_answer(reader), 5)  # while the handler still waits
        assert (status, body, app.release.is_set()) == (200, b"early", False)
        app.release.set()
        writer.write(post("/a", b"next"))
        assert json.loads((await asyncio.wait_for(read_answer(reader), 5))[2])["path"] == "/a"
        writer.close()

        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/twice", b"x"))
        status, _, body = await asyncio.wait_for(read_answer(reader), 5)
        assert (status, body) == (200, b"early")
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, nothing after the first answer
        writer.close()
