"""SGLang's native `POST /generate` endpoint.

Parses `text` / `input_ids` (single or batch), `sampling_params`, `stream`, `rid` and the PD bootstrap
fields into `GenItem`s, runs them through `generation`, and answers in SGLang's shape: `{"text",
"output_ids", "meta_info"}` (a list for batch input) or SSE chunks carrying the cumulative text.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from aiohttp import web

from . import generation as gen
from .engine import FinishReason, StepOutput
from .errors import ApiError, json_response
from .sse import respond_sse
from .state import STATE_KEY, SimState
from .tokens import encode

_MAX_TOKEN_ID = 2**31 - 1


def _prompts(body: dict[str, Any]) -> tuple[list[list[int]], bool]:
    """Token lists of the inputs and whether the request is a batch."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ApiError(400, "exactly one of text or input_ids is required")
    if text is not None:
        if isinstance(text, str):
            return [encode(text)], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [encode(t) for t in text], True
        raise ApiError(400, "text must be a string or a non-empty list of strings")
    if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
        return [_check_ids(x) for x in ids], True
    return [_check_ids(ids)], False


def _check_ids(ids: Any) -> list[int]:
    if not isinstance(ids, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= _MAX_TOKEN_ID for x in ids
    ):
        raise ApiError(400, "input_ids must be a list of non-negative integers (or a list of such lists)")
    return ids


def _rids(body: dict[str, Any], count: int) -> list[str]:
    rid = body.get("rid")
    if isinstance(rid, list) and len(rid) == count:
        return [str(r) for r in rid]
    if rid is not None and count == 1 and not isinstance(rid, list):
        return [str(rid)]
    base = uuid.uuid4().hex
    return [f"{base}-{i}" if count > 1 else base for i in range(count)]


def finish_reason(finish: FinishReason | None, completion_tokens: int) -> dict[str, Any] | None:
    """SGLang's finish_reason object."""
    if finish is None:
        return None
    if finish.type == "stop":
        return {"type": "stop", "matched": finish.matched}
    if finish.type == "length":
        return {"type": "length", "length": completion_tokens}
    return {"type": "abort", "message": "aborted"}


def _result(text: str, out: StepOutput, *, rid: str, started: float, with_ids: bool = True) -> dict[str, Any]:
    result: dict[str, Any] = {"text": text}
    if with_ids:  # not in stream chunks: re-encoding the cumulative text each step is quadratic
        result["output_ids"] = encode(text)
    result["meta_info"] = {
        "id": rid,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
        "finish_reason": finish_reason(out.finish, out.completion_tokens),
        "e2e_latency": gen.elapsed(started),
    }
    return result


async def generate(request: web.Request) -> web.StreamResponse:
    """POST /generate."""
    started = gen.new_timer()
    state = request.app[STATE_KEY]
    await gen.apply_fault(state)
    body = await gen.read_json(request)
    prompts, is_batch = _prompts(body)
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise ApiError(400, "sampling_params must be an object")
    max_new = gen.parse_max_tokens(
        params.get("max_new_tokens"), name="max_new_tokens", default=state.config.max_tokens_default
    )
    stop = gen.parse_stop(params.get("stop"))
    refs = gen.parse_bootstrap(body, count=len(prompts), role=state.config.role)
    items = [gen.GenItem(p, max_new, stop, ref) for p, ref in zip(prompts, refs, strict=True)]
    rids = _rids(body, len(items))
    prepared = await gen.prepare(state, items, rid=rids[0])
    if body.get("stream"):
        return await respond_sse(request, _stream(state, prepared, rids, is_batch=is_batch, started=started))
    results = [
        _result(text, out, rid=rid, started=started)
        for (text, out), rid in zip(await gen.collect(state, prepared), rids, strict=True)
    ]
    return json_response(results if is_batch else results[0])


async def _stream(
    state: SimState, prepared: list[gen.Prepared], rids: list[str], *, is_batch: bool, started: float
) -> AsyncGenerator[dict[str, Any], None]:
    texts = [""] * len(prepared)
    async with contextlib.aclosing(gen.run(state, prepared)) as outputs:
        async for index, out in outputs:
            texts[index] += out.text
            chunk = _result(texts[index], out, rid=rids[index], started=started, with_ids=False)
            if is_batch:
                chunk["index"] = index
            yield chunk
