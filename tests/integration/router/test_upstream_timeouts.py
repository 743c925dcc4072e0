"""The first-byte and stream-idle timeouts: both transports in process against a raw-socket
worker, then the router as a real process in front of hung, stalled and stopped workers.

A worker that sends no response headers in time fails the attempt (counted by its breaker; a 504, or retried
on another worker when the client sent an ``Idempotency-Key``, since the worker may still be running it); one
that falls silent in the middle of its body ends a stream with an ``upstream_timeout`` error event and
``[DONE]``, a non-streaming answer with a 504.  Neither bound counts time the router itself spends not reading,
nor bounds a body that keeps coming.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import struct
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from smg_router.upstream.base import Timeouts
from smg_router.upstream.lean import HIGH_WATER, LeanUpstream
from smg_router.upstream.session import SessionUpstream
from support.procs import MODEL, http_json, start_router, start_sim, wait_until
from support.raw_http import read_request

HOST = "127.0.0.72"
LIMIT = 20.0
"""Seconds any in-process test may take (generous: a hang fails here, not at the suite's timeout)."""

Script = Callable[[bytes, asyncio.StreamWriter], Awaitable[None]]
"""Writes the answer to one request (given its path); returning closes the connection."""


@contextlib.asynccontextmanager
async def raw_worker(script: Script, host: str = HOST) -> AsyncIterator[str]:
    """Reads one request per connection and lets ``script`` answer it; torn down without leaking a task."""
    tasks: set[asyncio.Task[None]] = set()
    writers: list[asyncio.StreamWriter] = []
    stop = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        writers.append(writer)
        try:
            answer = asyncio.ensure_future(script(await read_request(reader), writer))
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait([answer, stopped], return_when=asyncio.FIRST_COMPLETED)
            for f in (answer, stopped):
                f.cancel()
            await asyncio.gather(answer, stopped, return_exceptions=True)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            tasks.discard(task)

    server = await asyncio.start_server(serve, host, 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{port}"
    finally:
        server.close()
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


async def forever() -> None:
    await asyncio.Event().wait()


async def no_headers(path: bytes, writer: asyncio.StreamWriter) -> None:
    await forever()  # read the request, never answer: a hung engine


async def one_event_then_silence(path: bytes, writer: asyncio.StreamWriter) -> None:
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n"
    )
    await writer.drain()
    await forever()


def trickle(*, gap: float, count: int, pad: int = 0) -> Script:
    """Headers at once, then ``count`` events ``gap`` seconds apart, then the end."""

    async def script(path: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(count):
            await asyncio.sleep(gap)
            event = b"data: %d\n\n" % i + b"x" * pad
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await forever()  # keep-alive: the connection stays open

    return script


async def reset_mid_body(path: bytes, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 100)
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()  # an RST, as from a crashed worker


Client = LeanUpstream | SessionUpstream


@pytest.fixture(params=["lean", "session"])
async def make_client(request: pytest.FixtureRequest) -> AsyncIterator[Callable[..., Awaitable[Client]]]:
    """Builds the transport under test (both speak plain http; ``Upstream`` sends only https to ``session``)."""
    made: list[Client] = []

    async def make(*, first_byte: float | None = None, idle: float | None = None) -> Client:
        cls = LeanUpstream if request.param == "lean" else SessionUpstream
        c = cls(Timeouts(connect=2, total=LIMIT * 2, first_byte=first_byte, stream_idle=idle))
        await c.start()
        made.append(c)
        return c

    yield make
    for c in made:
        await c.close()


# -- both transports, in process ------------------------------------------------------------------------------


async def test_no_response_headers_within_the_first_byte_timeout_is_a_timeout_error(make_client) -> None:
    client = await make_client(first_byte=0.5, idle=5)
    async with asyncio.timeout(LIMIT), raw_worker(no_headers) as url:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await client.post(url + "/v1/completions", b"{}", {})
        assert 0.45 <= time.monotonic() - t0 < 3


async def test_a_worker_silent_mid_body_past_the_idle_timeout_is_a_timeout_error(make_client) -> None:
    client = await make_client(first_byte=5, idle=0.5)
    async with asyncio.timeout(LIMIT), raw_worker(one_event_then_silence) as url:
        r = await client.post(url + "/v1/completions", b"{}", {})
        assert r.status == 200
        got = []
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            async for chunk in r.chunks():
                got.append(chunk)
                t0 = time.monotonic()
        assert 0.45 <= time.monotonic() - t0 < 3
        assert b"".join(got) == b"data: 1\n\n"
        r.abort()


async def test_a_piped_body_reaches_the_sink_in_order_and_piping_again_goes_on_where_the_sink_stopped(
    make_client,
) -> None:
    client = await make_client(first_byte=5, idle=5)
    async with asyncio.timeout(LIMIT), raw_worker(trickle(gap=0.01, count=12)) as url:
        r = await client.post(url + "/v1/completions", b"{}", {})
        got: list[bytes] = []

        def stop_after_four(chunk: bytes, last: bool) -> bool:
            got.append(chunk)
            return len(got) < 4

        assert await r.pipe(stop_after_four) is False and len(got) == 4
        assert await r.pipe(lambda chunk, last: got.append(chunk) is None) is True
        assert b"".join(got) == b"".join(b"data: %d\n\n" % i for i in range(12))


async def test_a_piped_stream_silent_past_the_idle_timeout_is_a_timeout_error(make_client) -> None:
    client = await make_client(first_byte=5, idle=0.5)
    async with asyncio.timeout(LIMIT), raw_worker(one_event_then_silence) as url:
        r = await client.post(url + "/v1/completions", b"{}", {})
        got: list[bytes] = []
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await r.pipe(lambda chunk, last: got.append(chunk) is None)
        assert b"".join(got) == b"data: 1\n\n"
        assert 0.45 <= time.monotonic() - t0 < 3
        r.abort()


async def test_a_piped_body_the_worker_breaks_off_is_an_os_error_not_a_timeout(make_client) -> None:
    client = await make_client(first_byte=5, idle=5)
    async with asyncio.timeout(LIMIT), raw_worker(reset_mid_body) as url:
        r = await client.post(url + "/v1/completions", b"{}", {})
        with pytest.raises(OSError) as caught:
            await r.pipe(lambda chunk, last: True)
        assert not isinstance(caught.value, TimeoutError), caught.value
        r.abort()


async def test_the_idle_timeout_bounds_each_gap_not_the_whole_body(make_client) -> None:
    client = await make_client(first_byte=0.5, idle=0.6)
    async with asyncio.timeout(LIMIT), raw_worker(trickle(gap=0.2, count=10)) as url:
        t0 = time.monotonic()
        r = await client.post(url + "/v1/completions", b"{}", {})
        body = b"".join([c async for c in r.chunks()])
        assert body == b"".join(b"data: %d\n\n" % i for i in range(10))
        assert time.monotonic() - t0 > 1.5, "the body took longer than both timeouts together"


async def test_time_the_router_spends_not_reading_does_not_count_as_the_workers_silence(make_client) -> None:
    client = await make_client(first_byte=2, idle=0.5)
    events = 200
    async with asyncio.timeout(LIMIT), raw_worker(trickle(gap=0, count=events, pad=16 * 1024)) as url:
        r = await client.post(url + "/v1/completions", b"{}", {})  # ~3 MB: far above what is buffered unread
        it = aiter(r.chunks())
        first = await anext(it)
        await asyncio.sleep(1.5)  # a slow client: three idle timeouts without reading
        rest = [c async for c in it]
        assert len(first) + sum(map(len, rest)) > 4 * HIGH_WATER
        assert (first + b"".join(rest)).count(b"data: ") == events


async def test_a_worker_that_breaks_off_mid_body_is_an_os_error_not_a_timeout(make_client) -> None:
    client = await make_client(first_byte=5, idle=5)
    async with asyncio.timeout(LIMIT), raw_worker(reset_mid_body) as url:
        r = await client.post(url + "/v1/completions", b"{}", {})
        with pytest.raises(OSError) as caught:
            await r.read()
        assert not isinstance(caught.value, TimeoutError), caught.value
        r.abort()


# -- the router, as a real process ----------------------------------------------------------------------------


def test_a_hung_worker_is_retried_on_a_healthy_one_and_its_breaker_counts_the_failures(logs: Path) -> None:
    good = start_sim(logs)
    hung = start_sim(logs, extra=["--hang-rate", "1"])
    r = start_router(
        logs,
        workers=[good.url, hung.url],
        args=[
            "--policy",
            "round_robin",
            "--first-byte-timeout",
            "1",
            "--max-retries",
            "2",
            "--breaker-failure-threshold",
            "2",
            "--breaker-cooldown",
            "60",
        ],
    )
    try:
        r.wait_routable(2)
        t0 = time.monotonic()
        for i in range(6):  # idempotent: a timed-out request may be sent again elsewhere
            status, body = http_json(
                "POST",
                r.url + "/v1/completions",
                {"model": MODEL, "prompt": f"hung {i}", "max_tokens": 1},
                headers={"Idempotency-Key": f"hung-{i}"},
                timeout=30,
            )
            assert status == 200, body
        hung_worker = next(w for w in r.workers() if w["url"] == hung.url)
        assert hung_worker["breaker"] == "open" and hung_worker["routable"] is False
        assert hung_worker["load"]["inflight"] == 0
        assert time.monotonic() - t0 < 20
        assert "Traceback" not in r.log()
    finally:
        r.stop()
        good.stop()
        hung.stop()


def test_with_only_a_hung_worker_the_client_gets_an_openai_shaped_504(logs: Path) -> None:
    hung = start_sim(logs, extra=["--hang-rate", "1"])
    r = start_router(logs, workers=[hung.url], args=["--first-byte-timeout", "1"])
    try:
        r.wait_routable(1)
        t0 = time.monotonic()
        status, body = http_json(
            "POST",
            r.url + "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert status == 504, body
        assert body["error"]["type"] == "upstream_timeout" and body["error"]["message"], body
        assert 0.9 <= time.monotonic() - t0 < 10
        assert r.workers()[0]["load"]["inflight"] == 0
    finally:
        r.stop()
        hung.stop()


async def test_a_stream_whose_worker_stops_sending_ends_with_an_upstream_timeout_event(logs: Path) -> None:
    sim = start_sim(logs, time_scale=1.0)
    idle = 1.5
    r = start_router(logs, workers=[sim.url], args=["--stream-idle-timeout", str(idle)])
    stopped = False
    try:
        await asyncio.to_thread(r.wait_routable, 1)
        body = {"model": MODEL, "prompt": f"{uuid.uuid4()} a long story", "max_tokens": 3000, "stream": True}
        raw = b""
        async with aiohttp.ClientSession() as s, s.post(r.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            async for chunk in resp.content.iter_any():
                raw += chunk
                if not stopped and raw.count(b"data: ") >= 3:
                    os.kill(sim.popen.pid, signal.SIGSTOP)  # the worker freezes: its connection stays open, silent
                    stopped, t_stop = True, time.monotonic()
            elapsed = time.monotonic() - t_stop
        events = [line[len("data: ") :] for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == "upstream_timeout" and error["type"] == "upstream_timeout" and error["message"]
        assert idle * 0.9 <= elapsed < idle + 5, elapsed
        assert "Traceback" not in r.log()
    finally:
        if stopped:
            os.kill(sim.popen.pid, signal.SIGCONT)
        r.stop()
        sim.stop()


async def _stalled_json(path: bytes, writer: asyncio.StreamWriter) -> None:
    """/health and /v1/models answer; a completion's body stops after a few bytes, the connection open."""
    if path == b"/health":
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
    elif path == b"/v1/models":
        models = json.dumps({"data": [{"id": MODEL}]}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(models), models))
    elif path == b"/v1/completions":
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"id":')
        await writer.drain()
        await forever()
    else:
        writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    await writer.drain()


async def test_a_json_answer_that_stalls_mid_body_is_a_504_counted_by_the_breaker(logs: Path) -> None:
    async with raw_worker(_stalled_json, host="127.0.0.92") as url:
        r = start_router(
            logs,
            workers=[url],
            args=[
                "--stream-idle-timeout",
                "0.5",
                "--max-retries",
                "0",
                "--breaker-failure-threshold",
                "2",
                "--breaker-cooldown",
                "60",
            ],
        )
        try:
            await asyncio.to_thread(r.wait_routable, 1)
            for _ in range(2):
                t0 = time.monotonic()
                status, body = await asyncio.to_thread(
                    http_json, "POST", r.url + "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}
                )
                assert status == 504, body
                assert body["error"]["type"] == "upstream_timeout" and body["error"]["message"], body
                assert 0.45 <= time.monotonic() - t0 < 5
            await asyncio.to_thread(
                wait_until,
                lambda: r.workers()[0]["breaker"] == "open",
                what="the breaker to open after two stalled answers",
            )
            assert "Traceback" not in r.log()
        finally:
            r.stop()


async def test_a_pooled_connections_next_request_keeps_its_own_first_byte_bound() -> None:
    """The lean client's timer outlives a request on its connection: after a stream re-armed it for the stream's
    idle bound (2 s), the next request on the same connection still times out at its first-byte bound (0.3 s)."""
    requests = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal requests
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                await read_request(reader)
                requests += 1
                if requests > 1:
                    await reader.read()  # the second request on the connection: no answer, until the client leaves
                    break
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\none\r\n")
                await writer.drain()
                await asyncio.sleep(0.5)  # the client's check fires in the gap and re-arms for idle
                writer.write(b"3\r\ntwo\r\n0\r\n\r\n")
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, HOST, 0)
    url = f"http://{HOST}:{server.sockets[0].getsockname()[1]}/generate"
    client = LeanUpstream(Timeouts(connect=2, total=LIMIT, first_byte=0.3, stream_idle=2.0))
    try:
        first = await client.post(url, b"{}", {})
        assert [c async for c in first.chunks()] == [b"one", b"two"]
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="no response headers"):
            await client.post(url, b"{}", {})
        assert requests == 2  # the same connection: the worker saw both
        assert time.monotonic() - t0 < 1.5
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


async def test_a_request_sent_again_on_a_fresh_connection_is_told_to_be_counted() -> None:
    """The worker closed the pooled connection after reading the next request on it: the lean client sends it again
    on a fresh connection (the worker may have read it: a re-send), and tells ``on_resend`` (the router counts it
    in ``smg_retries_total{outcome="resent"}``)."""
    connections = 0
    requests = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections, requests
        connections += 1
        first_connection = connections == 1
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            answered = 0
            while True:
                await read_request(reader)
                requests += 1
                if first_connection and answered:
                    break  # read, then closed unanswered: an idle timeout racing the next request
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
                answered += 1
        writer.close()

    server = await asyncio.start_server(serve, HOST, 0)
    url = f"http://{HOST}:{server.sockets[0].getsockname()[1]}/v1/completions"
    resent: list[str] = []
    client = LeanUpstream(Timeouts(connect=2, total=LIMIT, first_byte=5), on_resend=resent.append)
    try:
        assert await (await client.post(url, b"{}", {})).read() == b"ok"
        assert resent == []
        assert await (await client.post(url, b"{}", {})).read() == b"ok"
        assert (connections, requests) == (2, 3)  # the worker read the second request twice
        assert resent == [url]
    finally:
        await client.close()
        server.close()
        await server.wait_closed()
