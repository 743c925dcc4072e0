"""What the router reads of a worker's answer at most (``upstream.ResponseLimits``): a head past its limit fails the
attempt, a body read whole past its limit is a ``ResponseTooLarge`` (the relay's 502), both counted by reason; a body
taken piece by piece (a stream) is not bounded."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from smg_router.upstream import ResponseLimits, ResponseTooLarge, Timeouts, UpstreamConnectError
from smg_router.upstream.lean import LeanUpstream


@contextlib.asynccontextmanager
async def worker(answer: bytes) -> AsyncIterator[str]:
    """A worker that answers every request with ``answer`` (after reading its head and a small body)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            writer.write(answer)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
    finally:
        server.close()
        await server.wait_closed()


def answer(headers: bytes, body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\n" + headers + b"Content-Length: %d\r\n\r\n" % len(body) + body


async def test_a_head_past_the_limit_fails_the_attempt_naming_the_limit() -> None:
    refused: list[str] = []
    client = LeanUpstream(Timeouts(connect=2, total=5), ResponseLimits(head=4096, refused=refused.append))
    async with worker(answer(b"".join(b"x-h%d: %s\r\n" % (i, b"v" * 100) for i in range(100)), b"{}")) as url:
        with pytest.raises(UpstreamConnectError, match="--max-response-header-size"):
            await client.post(url, b"{}", {})
    await client.close()
    assert refused == ["head_too_large"]


async def test_a_body_read_whole_past_the_limit_is_refused_and_a_stream_is_not_bounded() -> None:
    refused: list[str] = []
    client = LeanUpstream(Timeouts(connect=2, total=5), ResponseLimits(body=100_000, refused=refused.append))
    async with worker(answer(b"x-small: 1\r\n", b"b" * 300_000)) as url:
        response = await client.post(url, b"{}", {})
        with pytest.raises(ResponseTooLarge, match="100000 bytes, --max-response-size"):
            await response.read()
        assert refused == ["body_too_large"]
        streamed = await client.post(url, b"{}", {})
        assert sum([len(c) async for c in streamed.chunks()]) == 300_000
        fits = LeanUpstream(Timeouts(connect=2, total=5), ResponseLimits(body=300_000))
        assert len(await (await fits.post(url, b"{}", {})).read()) == 300_000
        await fits.close()
    await client.close()
