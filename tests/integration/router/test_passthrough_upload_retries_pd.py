"""Pass-through endpoints: the audio upload streamed (not buffered), routed by its form's model, retries of a
worker's 503 on another worker, and what PD mode does with them."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from aiohttp import web
from support.inproc_worker import serving
from support.pd import start_decode, start_prefill
from support.procs import MODEL, Router, metric_value, start_router, start_sim, wait_until_async

BOUNDARY = "smgtestboundary"


def _form(fields: list[tuple[str, str]], *, file_first: bool = False) -> tuple[bytes, bytes]:
    """(everything up to the file's bytes, the closing delimiter) of a multipart form with one file part."""
    parts = [
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
        for name, value in fields
    ]
    file_head = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        "Content-Type: audio/wav\r\n\r\n"
    ).encode()
    head = file_head if file_first else b"".join(parts) + file_head
    tail = b"\r\n" + (b"".join(parts) if file_first else b"") + f"--{BOUNDARY}--\r\n".encode()
    return head, tail


CONTENT_TYPE = f"multipart/form-data; boundary={BOUNDARY}"


async def _routable(router: Router, count: int) -> None:
    async def ready() -> bool:
        async with aiohttp.ClientSession() as s, s.get(router.url + "/workers") as r:
            return sum(w["routable"] for w in (await r.json())["workers"]) == count

    await wait_until_async(ready, what=f"{count} routable workers")


async def test_an_upload_reaches_the_worker_while_the_client_is_still_sending(logs: Path) -> None:
    seen = asyncio.Event()

    async def transcribe(request: web.Request) -> web.Response:
        data = bytearray()
        async for chunk in request.content.iter_any():
            data += chunk
            seen.set()
        return web.json_response({"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})

    head, tail = _form([("model", MODEL), ("response_format", "json")])
    audio_start, audio_rest = b"\x01" * 70_000, b"\x02" * 300_000  # the start is past the router's head limit
    sent_rest = False

    async def body() -> AsyncIterator[bytes]:
        nonlocal sent_rest
        yield head + audio_start
        # were the router to buffer the upload, the worker would see nothing before the client has sent it all
        await asyncio.wait_for(seen.wait(), timeout=10)
        sent_rest = True
        yield audio_rest + tail

    async with serving("127.0.0.95", {"/v1/audio/transcriptions": transcribe}) as url:
        router = start_router(logs, workers=[url])
        try:
            await _routable(router, 1)
            async with (
                aiohttp.ClientSession() as s,
                s.post(
                    router.url + "/v1/audio/transcriptions", data=body(), headers={"Content-Type": CONTENT_TYPE}
                ) as r,
            ):
                answer = await r.json()
                assert r.status == 200, answer
            whole = head + audio_start + audio_rest + tail
            assert sent_rest
            assert answer == {"bytes": len(whole), "sha256": hashlib.sha256(whole).hexdigest()}  # intact
            assert (
                metric_value(router.metrics(), "smg_requests_total", endpoint="/v1/audio/transcriptions", status="200")
                == 1
            )
        finally:
            router.stop()


async def test_an_upload_routes_by_the_model_field_before_its_file(logs: Path) -> None:
    mine, other = start_sim(logs), start_sim(logs, model="other-model")
    router = start_router(logs, workers=[mine.url, other.url])
    try:
        router.wait_routable(2)

        async def send(fields: list[tuple[str, str]], *, file_first: bool = False) -> tuple[int, dict, str | None]:
            head, tail = _form(fields, file_first=file_first)
            payload = head + b"\x07" * 5000 + tail
            async with (
                aiohttp.ClientSession() as s,
                s.post(
                    router.url + "/v1/audio/transcriptions", data=payload, headers={"Content-Type": CONTENT_TYPE}
                ) as r,
            ):
                return r.status, await r.json(), r.headers.get("x-smg-sim-worker")

        status, answer, worker = await send([("model", "other-model")])
        assert status == 200 and answer["text"], answer
        assert f"http://{worker}" == other.url
        status, answer, worker = await send([("model", MODEL)])
        assert status == 200 and f"http://{worker}" == mine.url
        status, answer, _ = await send([("model", MODEL)], file_first=True)
        assert status == 400, answer
        assert "before the file part" in answer["error"]["message"], answer
    finally:
        router.stop()
        mine.stop()
        other.stop()


async def test_a_worker_answering_5xx_is_retried_on_another_for_pass_through_endpoints(logs: Path) -> None:
    good, bad = start_sim(logs), start_sim(logs, extra=["--error-rate", "1.0"])
    router = start_router(logs, workers=[good.url, bad.url], args=["--breaker-failure-threshold", "100"])
    try:
        router.wait_routable(2)
        async with aiohttp.ClientSession() as s:
            for i in range(6):
                async with s.post(router.url + "/v1/embeddings", json={"model": MODEL, "input": f"text {i}"}) as r:
                    assert r.status == 200, await r.text()
                    assert f"http://{r.headers['x-smg-sim-worker']}" == good.url
            head, tail = _form([("model", MODEL)])
            for _ in range(4):  # a small upload is held whole by the router: retried like a JSON body
                payload = head + b"\x05" * 2000 + tail
                async with s.post(
                    router.url + "/v1/audio/transcriptions", data=payload, headers={"Content-Type": CONTENT_TYPE}
                ) as r:
                    assert r.status == 200, await r.text()
        text = router.metrics()
        assert metric_value(text, "smg_retries_total", endpoint="/v1/embeddings") >= 2
        assert metric_value(text, "smg_retries_total", endpoint="/v1/audio/transcriptions") >= 1
    finally:
        router.stop()
        good.stop()
        bad.stop()


async def test_pd_mode_sends_by_load_endpoints_to_decode_workers_and_refuses_other_generation(logs: Path) -> None:
    (prefill, bport), decode = start_prefill(logs), start_decode(logs)
    router = start_router(
        logs, args=["--pd-disaggregation", "--prefill", prefill.url, str(bport), "--decode", decode.url]
    )
    try:
        router.wait_routable(2)
        async with aiohttp.ClientSession() as s:
            for path, body in (
                ("/v1/tokenize", {"model": MODEL, "prompt": "abc"}),
                ("/v1/embeddings", {"model": MODEL, "input": "abc"}),
            ):
                async with s.post(router.url + path, json=body) as r:
                    assert r.status == 200, await r.text()
                    assert f"http://{r.headers['x-smg-sim-worker']}" == decode.url
            messages = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": f"{uuid.uuid4()}"}]}
            async with s.post(router.url + "/v1/messages", json=messages) as r:
                answer = await r.json()
                assert r.status == 501, answer
            assert answer["error"]["code"] == "not_supported_in_pd_mode"
            assert "/v1/messages is not served in PD mode" in answer["error"]["message"]
            async with s.post(router.url + "/v1/chat/completions", json=messages) as r:  # PD itself still works
                assert r.status == 200, await r.text()
    finally:
        router.stop()
        prefill.stop()
        decode.stop()


async def test_an_upload_past_the_payload_limit_is_a_413_streamed_or_announced(logs: Path) -> None:
    received: list[int] = []

    async def transcribe(request: web.Request) -> web.Response:
        n = 0
        async for chunk in request.content.iter_any():
            n += len(chunk)
        received.append(n)
        return web.json_response({"bytes": n})

    head, tail = _form([("model", MODEL)])

    async def chunked() -> AsyncIterator[bytes]:
        yield head
        for _ in range(10):
            yield b"\x03" * 50_000

    async with serving("127.0.0.96", {"/v1/audio/transcriptions": transcribe}) as url:
        router = start_router(logs, workers=[url], args=["--max-payload-size", "200000"])
        try:
            await _routable(router, 1)
            async with aiohttp.ClientSession() as s:
                async with s.post(
                    router.url + "/v1/audio/transcriptions", data=chunked(), headers={"Content-Type": CONTENT_TYPE}
                ) as r:
                    answer = await r.json()
                    assert r.status == 413, answer
                assert answer["error"]["code"] == "payload_too_large"
                assert not received or received[0] <= 200_000  # the worker never got more than the limit
                announced = head + b"\x03" * 300_000 + tail
                async with s.post(
                    router.url + "/v1/audio/transcriptions", data=announced, headers={"Content-Type": CONTENT_TYPE}
                ) as r:
                    assert r.status == 413, await r.text()
            assert "Traceback" not in router.log(), router.log()[-3000:]
        finally:
            router.stop()


async def test_a_worker_answering_503_is_retried_on_another_and_the_client_never_sees_it(logs: Path) -> None:
    refused = 0

    async def busy(request: web.Request) -> web.Response:
        nonlocal refused
        await request.read()
        refused += 1
        return web.json_response(
            {"error": {"message": "overloaded", "type": "server_error", "code": "busy"}}, status=503
        )

    sim = start_sim(logs)
    async with serving("127.0.0.98", {"/v1/rerank": busy}) as url:
        router = start_router(logs, workers=[url, sim.url], args=["--breaker-failure-threshold", "100"])
        try:
            await _routable(router, 2)
            async with aiohttp.ClientSession() as s:
                for i in range(4):
                    body = {"model": MODEL, "query": f"q{i}", "documents": ["a", "b"]}
                    async with s.post(router.url + "/v1/rerank", json=body) as r:
                        answer = await r.json()
                        assert r.status == 200, answer
                        assert f"http://{r.headers['x-smg-sim-worker']}" == sim.url
                    assert len(answer["results"]) == 2
            assert refused >= 1  # by load, the busy worker was chosen, answered 503, and was retried elsewhere
            retried = metric_value(router.metrics(), "smg_retries_total", endpoint="/v1/rerank", outcome="retried")
            assert retried == refused
        finally:
            router.stop()
            sim.stop()


async def test_a_hung_worker_times_out_and_pass_through_requests_go_elsewhere_or_504(logs: Path) -> None:
    good, hung = start_sim(logs), start_sim(logs, extra=["--hang-rate", "1.0"])
    router = start_router(
        logs,
        workers=[good.url, hung.url],
        args=["--first-byte-timeout", "0.5", "--breaker-failure-threshold", "100"],
    )
    try:
        router.wait_routable(2)
        async with aiohttp.ClientSession() as s:
            for i in range(3):  # the key: a request the hung worker may still be running is sent again only then
                body, key = {"model": MODEL, "prompt": f"p{i}"}, {"Idempotency-Key": f"tokenize-{i}"}
                async with s.post(router.url + "/v1/tokenize", json=body, headers=key) as r:
                    assert r.status == 200, await r.text()
        assert metric_value(router.metrics(), "smg_retries_total", endpoint="/v1/tokenize") >= 1
        good.stop()  # only the hung worker is left: a timeout, mapped as on every endpoint
        router.wait_routable(1)
        async with (
            aiohttp.ClientSession() as s,
            s.post(router.url + "/v1/tokenize", json={"model": MODEL, "prompt": "x"}) as r,
        ):
            answer = await r.json()
            assert r.status == 504, answer
        assert answer["error"]["type"] == "upstream_timeout"
    finally:
        router.stop()
        good.stop()
        hung.stop()


async def test_an_upload_that_stalls_midway_is_a_408_and_the_worker_request_ends(logs: Path) -> None:
    """The client stops sending in the middle of the file (past what was kept for a retry): the router answers
    408 after --body-timeout, and the worker sees its upload end early instead of waiting forever."""
    ended = asyncio.Event()

    async def transcribe(request: web.Request) -> web.Response:
        try:
            async for _ in request.content.iter_any():
                pass
        finally:
            ended.set()  # the body ended or broke off: the router let go of the worker's request
        return web.json_response({"text": "whole"})

    head, _ = _form([("model", MODEL)])
    never = asyncio.Event()

    async def stalled() -> AsyncIterator[bytes]:
        yield head + b"\x04" * 100_000
        await never.wait()
        yield b""

    async with serving("127.0.0.97", {"/v1/audio/transcriptions": transcribe}) as url:
        router = start_router(logs, workers=[url], args=["--body-timeout", "1"])
        try:
            await _routable(router, 1)
            async with (
                aiohttp.ClientSession() as s,
                s.post(
                    router.url + "/v1/audio/transcriptions", data=stalled(), headers={"Content-Type": CONTENT_TYPE}
                ) as r,
            ):
                answer = await r.json()
                assert r.status == 408, answer
            assert answer["error"]["code"] == "request_body_timeout", answer
            await asyncio.wait_for(ended.wait(), 10)
            assert metric_value(router.metrics(), "smg_requests_rejected_total", reason="body_timeout") == 1
            assert "Traceback" not in router.log(), router.log()[-3000:]
        finally:
            router.stop()
