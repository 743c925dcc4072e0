"""Optional data-plane API key, the admin token, and worker credentials that never show."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import openai
import pytest
from aiohttp import web
from support.inproc_worker import serving
from support.procs import MODEL, http_json, start_router

API_KEY, ADMIN_KEY = "data-plane-key-123", "admin-key-456"


class RecordingWorker:
    """An in-process worker that remembers the Authorization header of each completion it serves."""

    def __init__(self) -> None:
        self.authorization: list[str | None] = []

    async def chat(self, request: web.Request) -> web.Response:
        await request.read()
        self.authorization.append(request.headers.get("Authorization"))
        return web.json_response(
            {
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": MODEL,
                "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"}}],
            }
        )

    def serving(self, host: str) -> contextlib.AbstractAsyncContextManager[str]:
        return serving(host, {"/v1/chat/completions": self.chat})


def _chat(base: str, key: str) -> openai.types.chat.ChatCompletion:
    with openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0) as client:
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}])


async def test_the_data_plane_needs_the_api_key_and_workers_never_see_it(logs: Path) -> None:
    worker = RecordingWorker()
    async with worker.serving("127.0.0.94") as url:
        r = start_router(logs, workers=[url], args=["--api-key", API_KEY], admin_key=ADMIN_KEY)
        try:
            await asyncio.to_thread(r.wait_routable, 1)
            with pytest.raises(openai.AuthenticationError) as e:
                await asyncio.to_thread(_chat, r.url, "wrong")
            assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"  # type: ignore[index]
            reply = await asyncio.to_thread(_chat, r.url, API_KEY)
            assert reply.choices[0].message.content == "hi"
            assert worker.authorization == [None]  # the router's key is not forwarded
            for path in ("/v1/models",):
                status, body = await asyncio.to_thread(http_json, "GET", r.url + path)
                assert status == 401 and body["error"]["type"] == "authentication_error", body
            for path in ("/liveness", "/readiness", "/health", "/metrics"):  # probes and scrapes stay open
                status, _ = await asyncio.to_thread(http_json, "GET", r.url + path)
                assert status == 200, path
            status, _ = await asyncio.to_thread(
                http_json,
                "POST",
                r.url + "/workers",
                {"url": "http://127.0.0.95:8000"},
                headers={"Authorization": f"Bearer {API_KEY}"},
            )
            assert status == 401  # the data-plane key is not the admin key
        finally:
            r.stop()
        log = r.log()
        assert API_KEY not in log and ADMIN_KEY not in log


def test_worker_urls_with_credentials_are_refused_without_echoing_them(logs: Path) -> None:
    r = start_router(logs, admin_key=ADMIN_KEY)
    try:
        status, body = r.admin("POST", "/workers", {"url": "http://user:s3cret@127.0.0.96:8000"})
        assert status == 400 and "credentials" in body["error"]["message"], body
        assert "s3cret" not in str(body)
        assert r.workers() == []
    finally:
        r.stop()
    assert "s3cret" not in r.log()
