"""/v1/messages takes the data-plane key as Anthropic's clients send it (``x-api-key``), and never forwards it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import anthropic
import pytest
from aiohttp import web
from support.inproc_worker import serving
from support.procs import MODEL, start_router

API_KEY = "messages-key-789"


class MessagesWorker:
    """Answers /v1/messages and remembers the headers each request brought."""

    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []

    async def messages(self, request: web.Request) -> web.Response:
        await request.read()
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        return web.json_response(
            {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "model": MODEL,
                "content": [{"type": "text", "text": "hi"}],
                "stop_reason": "end_turn",
                "stop_sequence": None,
                "usage": {"input_tokens": 3, "output_tokens": 1},
            }
        )


async def _ask(base: str, key: str) -> str:
    """Through the official client (this version sends its api_key as ``Authorization: Bearer``)."""
    async with anthropic.AsyncAnthropic(base_url=base, api_key=key, max_retries=0) as client:
        reply = await client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    return reply.content[0].text


async def _ask_with_x_api_key(base: str, key: str) -> tuple[int, dict]:
    """As Anthropic's API reference and older clients send it: the bare key in ``x-api-key``."""
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
    async with aiohttp.ClientSession() as s, s.post(base + "/v1/messages", json=body, headers=headers) as r:
        return r.status, await r.json()


@pytest.mark.parametrize("router_key", [API_KEY, None])
async def test_messages_accept_the_key_as_x_api_key_and_keep_it_from_the_worker(
    logs: Path, router_key: str | None
) -> None:
    worker = MessagesWorker()
    async with serving("127.0.0.97", {"/v1/messages": worker.messages}) as url:
        r = start_router(logs, workers=[url], args=["--api-key", router_key] if router_key else [])
        try:
            await asyncio.to_thread(r.wait_routable, 1)
            if router_key:
                status, answer = await _ask_with_x_api_key(r.url, "wrong")
                assert status == 401 and answer["error"]["code"] == "invalid_api_key", answer
                with pytest.raises(anthropic.AuthenticationError):
                    await _ask(r.url, "wrong")
                assert await _ask(r.url, API_KEY) == "hi"
            status, answer = await _ask_with_x_api_key(r.url, API_KEY)
            assert status == 200 and answer["content"][0]["text"] == "hi", answer
            seen = worker.headers[-1]
            assert seen["anthropic-version"] == "2023-06-01"  # the client's API version reaches the worker
            if router_key:  # the router's key stays with it, whichever way it came
                assert all("x-api-key" not in h and "authorization" not in h for h in worker.headers)
            else:
                assert seen["x-api-key"] == API_KEY  # no key at the router: the worker may check its own
        finally:
            r.stop()
        assert API_KEY not in r.log()
