"""OpenAI-compatible endpoints: /v1/models, /v1/completions and /v1/chat/completions.

Turns OpenAI requests into `GenItem`s (chat messages go through a tiny chat template so the whole
conversation is the engine prompt and earlier turns hit the prefix cache), runs them through
`generation`, and answers with standard OpenAI objects or SSE chunks that the official client parses.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from . import generation as gen
from .engine import FinishReason, StepOutput
from .errors import ApiError, json_response
from .sse import respond_sse
from .state import STATE_KEY, SimState
from .tokens import encode


def chat_prompt(messages: Any) -> str:
    """The engine prompt of a chat: `<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n`."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list")
    parts = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string role")
        parts.append(f"<|{msg['role']}|>\n{_content_text(msg.get('content'), index=i)}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


def _content_text(content: Any, *, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict):
                raise ApiError(400, f"messages[{index}].content parts must be objects")
            if part.get("type") == "text":
                texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise ApiError(400, f"messages[{index}].content must be a string or a list of parts")


def _completion_prompts(prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [encode(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [encode(p) for p in prompt]
        if all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and all(isinstance(t, int) and t >= 0 for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise ApiError(400, "prompt must be a string, a list of strings, or token ids")


def finish_reason(finish: FinishReason | None) -> str | None:
    if finish is None:
        return None
    return "length" if finish.type == "length" else "stop"


def usage(finals: Sequence[StepOutput]) -> dict[str, Any]:
    prompt = sum(o.prompt_tokens for o in finals)
    completion = sum(o.completion_tokens for o in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in finals)},
    }


@dataclass(frozen=True, slots=True)
class _Call:
    """A parsed OpenAI generation request."""

    id: str
    created: int
    model: str
    stream: bool
    include_usage: bool
    items: list[gen.GenItem]
    prepared: list[gen.Prepared] | None
    """None while a stream's head goes out first (``stream_head_first``): prepared by the stream."""


async def _parse(request: web.Request, *, chat: bool) -> tuple[SimState, _Call]:
    state, body = await gen.admit(request)
    cfg = state.config
    if body.get("n") not in (None, 1):
        raise ApiError(400, "only n=1 is supported")
    if chat:
        prompts = [encode(chat_prompt(body.get("messages")))]
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
    else:
        if "prompt" not in body:
            raise ApiError(400, "prompt is required")
        prompts = _completion_prompts(body["prompt"])
        limit = body.get("max_tokens")
    max_tokens = gen.parse_max_tokens(limit, name="max_tokens", default=cfg.max_tokens_default, minimum=1)
    stop = gen.parse_stop(body.get("stop"))
    refs = gen.parse_bootstrap(body, count=len(prompts), role=cfg.role)
    items = [gen.GenItem(p, max_tokens, stop, ref) for p, ref in zip(prompts, refs, strict=True)]
    options = body.get("stream_options") or {}
    call_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    stream = bool(body.get("stream"))
    head_first = stream and cfg.role == "decode" and cfg.stream_head_first
    call = _Call(
        id=call_id,
        created=int(time.time()),
        model=cfg.model,
        stream=stream,
        include_usage=isinstance(options, dict) and bool(options.get("include_usage")),
        items=items,
        prepared=None if head_first else await gen.prepare(state, items, rid=call_id),
    )
    return state, call


async def _prepared(state: SimState, call: _Call) -> list[gen.Prepared]:
    if call.prepared is not None:
        return call.prepared
    return await gen.prepare(state, call.items, rid=call.id)


async def models(request: web.Request) -> web.Response:
    """GET /v1/models."""
    state = request.app[STATE_KEY]
    return json_response(
        {
            "object": "list",
            "data": [{"id": state.config.model, "object": "model", "created": state.created, "owned_by": "smg-sim"}],
        }
    )


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    state, call = await _parse(request, chat=False)
    if call.stream:
        return await respond_sse(request, _stream(state, call, chat=False))
    results = await gen.collect(state, await _prepared(state, call))
    return json_response(
        {
            "id": call.id,
            "object": "text_completion",
            "created": call.created,
            "model": call.model,
            "choices": [
                {"index": i, "text": text, "logprobs": None, "finish_reason": finish_reason(out.finish)}
                for i, (text, out) in enumerate(results)
            ],
            "usage": usage([out for _, out in results]),
        }
    )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    state, call = await _parse(request, chat=True)
    if call.stream:
        return await respond_sse(request, _stream(state, call, chat=True))
    ((text, out),) = await gen.collect(state, await _prepared(state, call))
    return json_response(
        {
            "id": call.id,
            "object": "chat.completion",
            "created": call.created,
            "model": call.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": finish_reason(out.finish),
                }
            ],
            "usage": usage([out]),
        }
    )


async def _stream(state: SimState, call: _Call, *, chat: bool) -> AsyncGenerator[dict[str, Any], None]:
    """OpenAI chunks: one per decode step with new text, a finish chunk per choice, then usage."""
    head = {
        "id": call.id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": call.created,
        "model": call.model,
    }

    def chunk(index: int, text: str | None, reason: str | None) -> dict[str, Any]:
        if chat:
            delta = {} if text is None else {"content": text}
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}
        out: dict[str, Any] = {**head, "choices": [choice]}
        if call.include_usage:
            out["usage"] = None
        return out

    started = not chat
    """A chat's first chunk names the role; SGLang and vLLM send it with the first output, after the prefill."""
    finals: list[StepOutput] = []
    async with contextlib.aclosing(gen.run(state, await _prepared(state, call))) as outputs:
        async for index, out in outputs:
            if not started:
                started = True
                first = chunk(0, "", None)
                first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                yield first
            if out.text:
                yield chunk(index, out.text, None)
            if out.finish is not None:
                finals.append(out)
                yield chunk(index, None, finish_reason(out.finish))
    if call.include_usage:
        yield {**head, "choices": [], "usage": usage(finals)}
