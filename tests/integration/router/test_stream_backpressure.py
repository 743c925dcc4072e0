"""A stream's backpressure through the router: a client that stops reading stops the worker too, and gets the whole
stream once it reads again.

The router passes a worker's stream on from within each read of the worker's connection (``UpstreamResponse.pipe``);
when the client reads slower than the worker writes, the relay stops piping, waits for the client, and only then
reads on, so nothing between the two grows without bound.  The router here is the real one (its server, relay and
lean upstream client) in this process, in front of a raw worker that streams as fast as its socket lets it; the
stream (32 MB) is larger than what the kernel buffers on both hops.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
from smg_router.app import RouterCore, build_server
from smg_router.settings import parse_settings
from smg_router.workers.worker import WorkerSpec, WorkerStatus
from support.procs import MODEL, free_port, next_host
from support.raw_http import read_request

EVENTS = 2000
PAD = 16 * 1024
LIMIT = 30.0


class Streamer:
    """A worker that answers every request with EVENTS SSE events of PAD bytes, as fast as its socket takes them."""

    def __init__(self) -> None:
        self.sent = 0
        self.url = ""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            for i in range(EVENTS):
                event = b"data: %d %s\n\n" % (i, b"x" * PAD)
                writer.write(b"%x\r\n%b\r\n" % (len(event), event))
                await writer.drain()
                self.sent += 1
            writer.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
            await writer.drain()
        writer.close()


@contextlib.asynccontextmanager
async def routed(streamer: Streamer) -> AsyncIterator[str]:
    """The worker on its own loopback address, the router (no background tasks) in front of it."""
    host = next_host()
    worker = await asyncio.start_server(streamer.serve, host, 0)
    streamer.url = f"http://{host}:{worker.sockets[0].getsockname()[1]}"
    port = free_port()
    core = RouterCore(parse_settings(["--port", str(port), "--policy", "round_robin"]))
    added, _ = core.fleet.lifecycle.add(WorkerSpec.from_json({"url": streamer.url, "model_id": MODEL}))
    added.status = WorkerStatus.READY
    server = build_server(core)
    await server.listen("127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await server.shutdown(1.0)
        await core.upstream.close()
        worker.close()
        await worker.wait_closed()


async def test_a_client_that_stops_reading_stops_the_worker_and_then_gets_the_whole_stream() -> None:
    streamer = Streamer()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with (
        asyncio.timeout(LIMIT),
        routed(streamer) as url,
        aiohttp.ClientSession() as client,
        client.post(url + "/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status == 200
        got = [await resp.content.readline()]
        await asyncio.sleep(1.0)  # the client reads nothing for a second
        stalled = streamer.sent
        assert stalled < EVENTS // 2, f"the worker sent {stalled} of {EVENTS} events to a client that read one"
        got += [line async for line in resp.content]
    events = [line for line in got if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]\n"
    numbers = [int(e.split()[1]) for e in events[:-1]]
    assert numbers == list(range(EVENTS)), "events lost, doubled or out of order"
    assert streamer.sent == EVENTS
