"""What the server holds of request bodies (``smg_router.server`` with a ``wire.Budget``): bytes counted as they
arrive and until the answer is over, a connection's waiting bytes bounded (pipelined requests' included), a body
that takes the server past its budget shed, a stream's reader holding only what waits and what it keeps."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable

from smg_router.server import Server
from smg_router.wire import BodyOverBudget, Budget, Request, Response
from support.procs import wait_until_async

KIB = 1024
READ = 256 * KIB
"""The most one socket read brings: what a connection may hold past its limit."""

Handler = Callable[[Request], Awaitable[Response]]


@contextlib.asynccontextmanager
async def serving(handler: Handler, **kwargs: object) -> AsyncIterator[tuple[Server, int]]:
    server = Server(handler, max_body=10 * 1024 * KIB, **kwargs)  # type: ignore[arg-type]
    listener = await server.listen("127.0.0.1", 0)
    try:
        yield server, listener.sockets[0].getsockname()[1]
    finally:
        await server.shutdown(1.0)


def post(path: str, body: bytes) -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


async def status_of(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(v) for k, _, v in (ln.partition(b":") for ln in head.split(b"\r\n")) if k.lower() == b"content-length"
    )
    return int(head.split(b" ")[1]), await reader.readexactly(length)


async def test_pipelined_bodies_behind_a_slow_answer_wait_in_the_kernel_not_in_the_server() -> None:
    release = asyncio.Event()
    seen: list[int] = []

    async def handler(request: Request) -> Response:
        body = await request.read()
        if request.path == "/slow":
            await release.wait()
        seen.append(len(body))
        return Response(body=b"ok")

    budget = Budget(100 * 1024 * KIB)
    async with serving(handler, budget=budget, max_buffer=64 * KIB) as (server, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/slow", b"s") + b"".join(post("/big", b"x" * (200 * KIB)) for _ in range(10)))
        await asyncio.sleep(0.3)  # the client's 2 MB are written; the server reads what it may
        (conn,) = server.connections
        assert conn.buffered <= 64 * KIB + READ, conn.buffered
        assert budget.held <= 64 * KIB + READ + 1, budget.held
        release.set()
        assert [await status_of(reader) for _ in range(11)] == [(200, b"ok")] * 11
        assert seen == [1] + [200 * KIB] * 10
        await wait_until_async(lambda: budget.held == 0, timeout=5, what="the budget empty")
        writer.close()


async def test_a_body_that_takes_the_server_past_its_budget_is_shed_and_its_bytes_given_back() -> None:
    release = asyncio.Event()

    async def handler(request: Request) -> Response:
        try:
            body = await request.read()
        except BodyOverBudget as e:
            return Response(status=503, body=str(e).encode())
        if request.path == "/hold":
            await release.wait()
        return Response(body=b"%d" % len(body))

    budget = Budget(100 * KIB)
    async with serving(handler, budget=budget) as (_, port):
        holder_reader, holder = await asyncio.open_connection("127.0.0.1", port)
        holder.write(post("/hold", b"h" * (80 * KIB)))
        await wait_until_async(
            lambda: budget.held == 80 * KIB, timeout=5, what="80 KiB held"
        )  # held while its answer is not over
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/big", b"b" * (50 * KIB)))
        status, body = await status_of(reader)
        assert status == 503 and b"--max-inflight-bytes" in body, body
        assert budget.held == 80 * KIB  # the shed body's bytes are dropped, not held
        small_reader, small = await asyncio.open_connection("127.0.0.1", port)
        small.write(post("/small", b"s" * (10 * KIB)))
        assert await status_of(small_reader) == (200, b"10240")  # room for what fits
        release.set()
        assert await status_of(holder_reader) == (200, b"81920")
        await wait_until_async(lambda: budget.held == 0, timeout=5, what="the budget empty")
        for w in (holder, writer, small):
            w.close()


async def test_a_streamed_body_holds_what_waits_and_what_its_reader_keeps_not_what_passed_through() -> None:
    """A reader that passes a 4 MB body on in pieces, keeping its first 1,000 bytes: the budget never holds more
    than those, the connection's limit and one read."""
    peak = 0
    passed = 0
    budget = Budget(100 * 1024 * KIB)

    async def handler(request: Request) -> Response:
        nonlocal peak, passed
        first = await request.readany()
        request.hold(1000)
        passed += len(first)
        while chunk := await request.readany():
            passed += len(chunk)
            peak = max(peak, budget.held)
            await asyncio.sleep(0.002)  # a worker that reads slower than the client sends
        return Response(body=json.dumps({"passed": passed}).encode())

    async with serving(handler, budget=budget, max_buffer=64 * KIB) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/upload", b"u" * (4 * 1024 * KIB)))
        status, body = await status_of(reader)
        assert status == 200 and json.loads(body) == {"passed": 4 * 1024 * KIB}
        assert 0 < peak <= 1000 + 64 * KIB + READ, peak
        await wait_until_async(lambda: budget.held == 0, timeout=5, what="the budget empty")
        writer.close()
