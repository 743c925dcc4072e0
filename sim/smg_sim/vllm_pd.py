"""vLLM prefill/decode roles (``--vllm-pd prefill|decode``): ``kv_transfer_params`` on the OpenAI endpoints.

A middleware in front of ``/v1/completions`` and ``/v1/chat/completions`` (which ``openai_api`` serves as
usual) adds what vLLM with a KV connector (NixlConnector) does to them:

* prefill: a request with ``kv_transfer_params.do_remote_decode`` (``stream: false``) is served as usual; when
  its generation stopped at ``max_tokens`` (vLLM hands over only a length-capped prefill) the prompt's KV is
  held (``kv_transfer.HeldKV``) and the answer carries ``kv_transfer_params`` with ``do_remote_prefill: true``,
  ``remote_engine_id``, ``remote_block_ids``, ``remote_request_id``, ``remote_host``, ``remote_port`` (the side
  channel, ``--bootstrap-port``, default 5600) and ``tp_size``; otherwise ``kv_transfer_params: null``.  A
  request without them is served as any vLLM engine would.
* decode: every request needs ``kv_transfer_params`` with ``do_remote_prefill: true`` and the remote fields
  (a 400 naming what is missing: stricter than vLLM, which would prefill locally, so that a router that skipped
  the prefill is caught), reads the prompt's KV from that side channel (a 5xx naming the engine, host and
  port when that fails) and then decodes without a prefill.  ``usage.prompt_tokens_details.cached_tokens`` is
  then the whole prompt, as vLLM reports KV that arrived from a prefill (vllm-project/router#193).

One prompt per request (vLLM returns one ``kv_transfer_params`` per request).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from . import generation as gen
from .errors import ApiError, Handler, json_response
from .kv_transfer import (
    DEFAULT_SIDE_CHANNEL_PORT,
    REMOTE_KV,
    HeldKV,
    create_side_channel_app,
    parse_remote,
    read_remote,
)
from .openai_api import chat_prompt
from .state import STATE_KEY
from .tokens import encode

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
TRANSFER_FIELD = "kv_transfer_params"


@dataclass(eq=False, slots=True)
class SideChannel:
    """A prefill worker's held KV and the port its side channel is bound to (known once started)."""

    held: HeldKV
    port: int = 0


SIDE_CHANNEL_KEY = web.AppKey("smg_sim_side_channel", SideChannel)


def prompt_tokens(body: dict[str, Any], *, chat: bool) -> list[int]:
    """The one prompt of a request, as the engine sees it; a 400 for a batch."""
    if chat:
        return encode(chat_prompt(body.get("messages")))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise ApiError(400, "a vLLM PD worker takes one prompt per request (a string or a list of token ids)")


@web.middleware
async def _middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.method != "POST" or request.path not in ENDPOINTS:
        return await handler(request)
    chat = request.path == "/v1/chat/completions"
    state = request.app[STATE_KEY]
    body = await gen.read_json(request)  # aiohttp keeps the bytes: the handler reads them again
    if state.config.vllm_pd == "decode":
        return await _decode(request, handler, body, chat=chat)
    return await _prefill(request, handler, body, chat=chat)


async def _prefill(request: web.Request, handler: Handler, body: dict[str, Any], *, chat: bool) -> web.StreamResponse:
    params = body.get(TRANSFER_FIELD)
    if params is not None and not isinstance(params, dict):
        raise ApiError(400, f"{TRANSFER_FIELD} must be an object")
    if not params or not params.get("do_remote_decode"):
        return await handler(request)  # no remote decode asked: a plain request
    if body.get("stream"):
        raise ApiError(400, f"{TRANSFER_FIELD}.do_remote_decode needs stream: false (the answer says where the KV is)")
    tokens = prompt_tokens(body, chat=chat)
    response = await handler(request)
    if response.status != 200 or not isinstance(response, web.Response) or not isinstance(response.body, bytes):
        return response
    answer = orjson.loads(response.body)
    choices = answer.get("choices") or [{}]
    answer[TRANSFER_FIELD] = None
    if choices[0].get("finish_reason") == "length":  # vLLM: only a prefill cut by max_tokens is handed over
        channel = request.app[SIDE_CHANNEL_KEY]
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        held = channel.held.hold(tokens, request_id=rid)
        cfg = request.app[STATE_KEY].config
        answer[TRANSFER_FIELD] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(held.block_ids),
            "remote_engine_id": channel.held.engine_id,
            "remote_request_id": rid,
            "remote_host": cfg.host,
            "remote_port": channel.port,
            "tp_size": 1,
        }
    return json_response(answer)


async def _decode(request: web.Request, handler: Handler, body: dict[str, Any], *, chat: bool) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    ref = parse_remote(body.get(TRANSFER_FIELD))
    tokens = prompt_tokens(body, chat=chat)
    arrived = await read_remote(state.client(), ref, tokens, wait_s=state.config.bootstrap_timeout)
    token = REMOTE_KV.set(arrived)
    try:
        return await handler(request)
    finally:
        REMOTE_KV.reset(token)


def install(app: web.Application) -> None:
    """Give a worker its ``--vllm-pd`` role (nothing for other workers): the middleware, and on a prefill
    worker the held KV and its side channel, started and stopped with the app."""
    cfg = app[STATE_KEY].config
    if cfg.vllm_pd == "off":
        return
    app.middlewares.append(_middleware)
    if cfg.vllm_pd != "prefill":
        return
    channel = app[SIDE_CHANNEL_KEY] = SideChannel(HeldKV(engine_id=str(uuid.uuid4()), timeout=cfg.room_ttl))

    async def side_channel(app: web.Application) -> AsyncIterator[None]:
        runner = web.AppRunner(create_side_channel_app(channel.held), handler_cancellation=True, access_log=None)
        await runner.setup()
        port = DEFAULT_SIDE_CHANNEL_PORT if cfg.bootstrap_port is None else cfg.bootstrap_port
        try:
            await web.TCPSite(runner, cfg.host, port).start()
            channel.port = runner.addresses[0][1]
            app[STATE_KEY].bootstrap_port = channel.port  # shown by /get_server_info
            yield
        finally:
            with contextlib.suppress(Exception):
                await runner.cleanup()

    app.cleanup_ctx.append(side_channel)
