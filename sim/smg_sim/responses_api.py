"""POST /v1/responses: OpenAI's Responses API on the simulated engine, stored as vLLM and OpenAI do.

``instructions`` becomes the system message and ``input`` (a string, or input items) the conversation,
through the chat template of /v1/chat/completions, so prefixes are cached across the APIs.  Items without
a role (function calls and their outputs) enter the prompt as their textual fields.  A response is stored
(``store``, default true) in this worker's memory, the last ``STORE_LIMIT`` of them: ``previous_response_id``
continues that conversation (its input and output come before the new input; its instructions do not carry
over, as in OpenAI's API), and an id this worker does not hold is a 404 ``previous_response_not_found``, as on
vLLM: a router must send the call to the worker that produced the response.  A stream is the event sequence
the openai client parses (``response.created`` ... ``response.output_text.delta`` ... ``response.completed``).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from . import generation as gen
from .engine import StepOutput
from .errors import ApiError, json_response
from .openai_api import chat_prompt
from .sse import respond_named_sse
from .state import SimState
from .tokens import encode

STORE_LIMIT = 4096
"""Stored responses a worker keeps (the oldest is dropped first)."""


@dataclass(frozen=True, slots=True)
class _Call:
    id: str
    message_id: str
    created: int
    model: str
    instructions: str | None
    max_output_tokens: int
    stream: bool
    prepared: list[gen.Prepared]
    conversation: list[dict[str, Any]]
    """The previous response's conversation, then this input (no instructions): what is stored with the output."""
    store: bool
    previous_response_id: str | None


def input_messages(given: Any) -> list[dict[str, Any]]:
    """The chat messages of a Responses ``input``."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list):
        raise ApiError(400, "input must be a string or a list of input items")
    messages = []
    for i, item in enumerate(given):
        if not isinstance(item, dict):
            raise ApiError(400, f"input[{i}] must be an object")
        if isinstance(item.get("role"), str):
            content = item.get("content")
            if isinstance(content, list):  # input_text / output_text parts carry text like chat's text parts
                content = [
                    {**p, "type": "text"} if isinstance(p, dict) and isinstance(p.get("text"), str) else p
                    for p in content
                ]
            messages.append({"role": item["role"], "content": content})
        else:
            text = "".join(v for k in ("name", "arguments", "output", "text") if isinstance(v := item.get(k), str))
            messages.append({"role": str(item.get("type", "item")), "content": text})
    return messages


async def _parse(request: web.Request) -> tuple[SimState, _Call]:
    state, body = await gen.admit(request)
    cfg = state.config
    previous, store = body.get("previous_response_id"), body.get("store", True)
    if not isinstance(store, bool):
        raise ApiError(400, "store must be true or false")
    history: list[dict[str, Any]] = []
    if previous is not None:
        if not isinstance(previous, str):
            raise ApiError(400, "previous_response_id must be a string")
        found = state.responses.get(previous)
        if found is None:
            raise ApiError(
                404, f"Previous response with id '{previous}' not found.", code="previous_response_not_found"
            )
        history = found
    if "input" not in body:
        raise ApiError(400, "input is required")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, "instructions must be a string")
    system = [{"role": "system", "content": instructions}] if instructions else []
    conversation = history + input_messages(body["input"])
    messages = system + conversation
    if not messages:
        raise ApiError(400, "input must not be empty")
    limit = gen.parse_max_tokens(
        body.get("max_output_tokens"), name="max_output_tokens", default=cfg.max_tokens_default, minimum=1
    )
    (ref,) = gen.parse_bootstrap(body, count=1, role=cfg.role)
    call_id = "resp_" + uuid.uuid4().hex
    item = gen.GenItem(encode(chat_prompt(messages)), limit, (), ref)
    call = _Call(
        id=call_id,
        message_id="msg_" + uuid.uuid4().hex,
        created=int(time.time()),
        model=cfg.model,
        instructions=instructions,
        max_output_tokens=limit,
        stream=body.get("stream") is True,
        prepared=await gen.prepare(state, [item], rid=call_id),
        conversation=conversation,
        store=store,
        previous_response_id=previous,
    )
    return state, call


def _store(state: SimState, call: _Call, text: str) -> None:
    """Keep the finished response's conversation for a later ``previous_response_id``."""
    if not call.store:
        return
    state.responses[call.id] = [*call.conversation, {"role": "assistant", "content": text}]
    while len(state.responses) > STORE_LIMIT:
        del state.responses[next(iter(state.responses))]


def _usage(out: StepOutput) -> dict[str, Any]:
    return {
        "input_tokens": out.prompt_tokens,
        "input_tokens_details": {"cached_tokens": out.cached_tokens},
        "output_tokens": out.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": out.prompt_tokens + out.completion_tokens,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _item(call: _Call, text: str, status: str) -> dict[str, Any]:
    content = [] if status == "in_progress" else [_text_part(text)]
    return {"type": "message", "id": call.message_id, "status": status, "role": "assistant", "content": content}


def _response(call: _Call, output: list[dict[str, Any]], out: StepOutput | None) -> dict[str, Any]:
    if out is None:
        status, incomplete = "in_progress", None
    elif out.finish is not None and out.finish.type == "length":
        status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    else:
        status, incomplete = "completed", None
    return {
        "id": call.id,
        "object": "response",
        "created_at": call.created,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": call.instructions,
        "max_output_tokens": call.max_output_tokens,
        "model": call.model,
        "output": output,
        "parallel_tool_calls": False,
        "previous_response_id": call.previous_response_id,
        "store": call.store,
        "temperature": 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": _usage(out) if out is not None else None,
        "metadata": {},
    }


async def responses(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses."""
    state, call = await _parse(request)
    if call.stream:
        return await respond_named_sse(request, _events(state, call), on_error=_error_event)
    ((text, out),) = await gen.collect(state, call.prepared)
    _store(state, call, text)
    return json_response(_response(call, [_item(call, text, "completed")], out))


def _error_event(err: ApiError) -> tuple[str, dict[str, Any]]:
    return "error", {"type": "error", "code": err.code, "message": err.message, "param": None}


async def _events(state: SimState, call: _Call) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
    seq = 0

    def event(kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
        nonlocal seq
        seq += 1
        return kind, {"type": kind, "sequence_number": seq - 1, **fields}

    ids = {"item_id": call.message_id, "output_index": 0, "content_index": 0}
    yield event("response.created", response=_response(call, [], None))
    yield event("response.in_progress", response=_response(call, [], None))
    yield event("response.output_item.added", output_index=0, item=_item(call, "", "in_progress"))
    yield event("response.content_part.added", **ids, part=_text_part(""))
    texts: list[str] = []
    async with contextlib.aclosing(gen.run(state, call.prepared)) as outputs:
        async for _, out in outputs:
            if out.text:
                texts.append(out.text)
                yield event("response.output_text.delta", **ids, delta=out.text, logprobs=[])
            if out.finish is not None:
                text = "".join(texts)
                yield event("response.output_text.done", **ids, text=text, logprobs=[])
                yield event("response.content_part.done", **ids, part=_text_part(text))
                item = _item(call, text, "completed")
                yield event("response.output_item.done", output_index=0, item=item)
                final = _response(call, [item], out)
                _store(state, call, text)
                yield event(
                    "response.completed" if final["status"] == "completed" else "response.incomplete", response=final
                )
