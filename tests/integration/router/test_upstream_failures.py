"""A worker that fails after its response began: a stream ends with an error event and [DONE], a JSON answer is a 502.

Never a second HTTP response inside a started stream, never a cut chunked encoding, and the failure counts
against the worker's circuit breaker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from support.procs import MODEL, http_json, start_router, start_sim, wait_until
from support.raw_http import read_request


async def test_a_worker_killed_mid_stream_ends_the_stream_with_an_error_event(logs: Path) -> None:
    sim = start_sim(logs, time_scale=1.0)
    r = start_router(logs, workers=[sim.url])
    try:
        r.wait_routable(1)
        body = {"model": MODEL, "prompt": f"{uuid.uuid4()} a long story", "max_tokens": 3000, "stream": True}
        async with aiohttp.ClientSession() as s, s.post(r.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            raw = b""
            async for chunk in resp.content.iter_any():
                raw += chunk
                if raw.count(b"data: ") == 3:
                    sim.kill()
            # the chunked encoding ended properly: iter_any finished without ClientPayloadError
        events = [line[len("data: ") :] for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == "upstream_disconnected" and error["type"] == "upstream_error", error
        assert error["message"]
        worker = r.workers()[0]
        assert worker["load"]["inflight"] == 0
        assert "Traceback" not in r.log()
    finally:
        r.stop()
        sim.stop()


@contextlib.asynccontextmanager
async def _worker_that_breaks_off(host: str) -> AsyncIterator[str]:
    """A raw-socket worker: healthy /health and /v1/models, then a completion cut off mid-body."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            path = await read_request(reader)
            if path == b"/health":
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
            elif path == b"/v1/models":
                models = json.dumps({"data": [{"id": MODEL}]}).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(models), models)
                )
            elif path == b"/v1/completions":
                writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"id":')
            else:
                writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, host, 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{port}"
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("host", ["127.0.0.91"])
async def test_a_json_answer_broken_off_by_the_worker_is_a_502_counted_by_the_breaker(logs: Path, host: str) -> None:
    async with _worker_that_breaks_off(host) as url:
        r = start_router(
            logs,
            workers=[url],
            args=["--max-retries", "0", "--breaker-failure-threshold", "2", "--breaker-cooldown", "60"],
        )
        try:
            await asyncio.to_thread(r.wait_routable, 1)
            for _ in range(2):
                status, body = await asyncio.to_thread(
                    http_json, "POST", r.url + "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}
                )
                assert status == 502, body
                assert body["error"]["code"] == "upstream_disconnected" and body["error"]["type"] == "upstream_error"
            await asyncio.to_thread(
                wait_until,
                lambda: r.workers()[0]["breaker"] == "open",
                what="the breaker to open after two broken answers",
            )
            assert "Traceback" not in r.log()
        finally:
            r.stop()


async def test_a_messages_stream_cut_by_the_worker_ends_with_anthropics_error_event(logs: Path) -> None:
    """The anthropic client ignores a nameless event: an OpenAI-shaped error would end the message silently,
    short of message_stop.  Anthropic's own ``event: error`` makes the client raise."""
    import anthropic

    sim = start_sim(logs, time_scale=1.0)
    r = start_router(logs, workers=[sim.url])
    try:
        r.wait_routable(1)
        async with anthropic.AsyncAnthropic(base_url=r.url, api_key="none", max_retries=0) as claude:
            seen = 0
            with pytest.raises(anthropic.APIStatusError) as e:
                async with claude.messages.stream(
                    model=MODEL, max_tokens=3000, messages=[{"role": "user", "content": f"{uuid.uuid4()} a story"}]
                ) as stream:
                    async for _ in stream:
                        seen += 1
                        if seen == 4:
                            sim.kill()
        assert "broke off the stream" in str(e.value), e.value
        assert r.workers()[0]["load"]["inflight"] == 0
    finally:
        r.stop()
        sim.stop()


async def test_a_responses_stream_cut_by_the_worker_ends_with_an_error_event(logs: Path) -> None:
    import openai

    sim = start_sim(logs, time_scale=1.0)
    r = start_router(logs, workers=[sim.url])
    try:
        r.wait_routable(1)
        async with openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="none", max_retries=0) as client:
            events = []
            stream = await client.responses.create(
                model=MODEL, input=f"{uuid.uuid4()} a long story", max_output_tokens=3000, stream=True
            )
            async for event in stream:
                events.append(event)
                if len(events) == 4:
                    sim.kill()
        assert events[-1].type == "error", [e.type for e in events[-3:]]
        assert events[-1].code == "upstream_disconnected" and "broke off" in events[-1].message
    finally:
        r.stop()
        sim.stop()
