"""POST /v1/messages: Anthropic's Messages API on the simulated engine (vLLM and SGLang serve it too).

The system prompt and the messages go through the same chat template as /v1/chat/completions, so a
conversation shares its cached prefix across both APIs.  ``usage.cache_read_input_tokens`` is what the
engine's prefix cache really held; ``input_tokens`` the rest of the prompt (Anthropic counts them apart).
A stream is the event sequence the official client parses: ``message_start`` (sent once prefill is done,
so its usage is true), ``content_block_start``, ``ping``, ``content_block_delta``..., ``content_block_stop``,
``message_delta`` (stop reason, output tokens), ``message_stop``.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from . import generation as gen
from .engine import FinishReason, StepOutput
from .errors import ApiError, json_response
from .openai_api import chat_prompt
from .sse import respond_named_sse
from .state import SimState
from .tokens import encode


@dataclass(frozen=True, slots=True)
class _Call:
    id: str
    model: str
    stream: bool
    prepared: list[gen.Prepared]


def _system_message(system: Any) -> list[dict[str, Any]]:
    if system is None or system == "":
        return []
    if isinstance(system, str | list):
        return [{"role": "system", "content": system}]
    raise ApiError(400, "system must be a string or a list of text blocks")


async def _parse(request: web.Request) -> tuple[SimState, _Call]:
    state, body = await gen.admit(request)
    cfg = state.config
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list")
    prompt = encode(chat_prompt(_system_message(body.get("system")) + messages))
    max_tokens = gen.parse_max_tokens(body.get("max_tokens"), name="max_tokens", default=cfg.max_tokens_default)
    if max_tokens < 1:
        raise ApiError(400, "max_tokens must be at least 1")
    stop = gen.parse_stop(body.get("stop_sequences"))
    (ref,) = gen.parse_bootstrap(body, count=1, role=cfg.role)
    call_id = "msg_" + uuid.uuid4().hex
    item = gen.GenItem(prompt, max_tokens, stop, ref)
    return state, _Call(call_id, cfg.model, body.get("stream") is True, await gen.prepare(state, [item], rid=call_id))


def stop_reason(finish: FinishReason | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) in Anthropic's terms."""
    if finish is None:
        return None, None
    if finish.type == "length":
        return "max_tokens", None
    if finish.matched:
        return "stop_sequence", finish.matched
    return "end_turn", None


def usage(out: StepOutput) -> dict[str, int]:
    return {
        "input_tokens": out.prompt_tokens - out.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": out.cached_tokens,
        "output_tokens": out.completion_tokens,
    }


def _message(call: _Call, content: list[dict[str, Any]], out: StepOutput | None) -> dict[str, Any]:
    reason, sequence = stop_reason(out.finish if out is not None else None)
    return {
        "id": call.id,
        "type": "message",
        "role": "assistant",
        "model": call.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(out) if out is not None else {"input_tokens": 0, "output_tokens": 0},
    }


async def messages(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages."""
    state, call = await _parse(request)
    if call.stream:
        return await respond_named_sse(request, _events(state, call), on_error=_error_event)
    ((text, out),) = await gen.collect(state, call.prepared)
    return json_response(_message(call, [{"type": "text", "text": text}], out))


def _error_event(err: ApiError) -> tuple[str, dict[str, Any]]:
    return "error", {"type": "error", "error": {"type": err.type, "message": err.message}}


async def _events(state: SimState, call: _Call) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
    started = False
    async with contextlib.aclosing(gen.run(state, call.prepared)) as outputs:
        async for _, out in outputs:
            if not started:  # the first output ends prefill: its counters are the prompt's
                started = True
                first = _message(call, [], None)
                first["usage"] = {**usage(out), "output_tokens": 0}
                yield "message_start", {"type": "message_start", "message": first}
                yield (
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": 0,
                        "content_block": {"type": "text", "text": ""},
                    },
                )
                yield "ping", {"type": "ping"}
            if out.text:
                yield (
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": 0,
                        "delta": {"type": "text_delta", "text": out.text},
                    },
                )
            if out.finish is not None:
                reason, sequence = stop_reason(out.finish)
                yield "content_block_stop", {"type": "content_block_stop", "index": 0}
                yield (
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": {"output_tokens": out.completion_tokens},
                    },
                )
                yield "message_stop", {"type": "message_stop"}
