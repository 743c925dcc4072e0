"""The request pipeline shared by /generate, /v1/completions and /v1/chat/completions.

The API modules parse their own schema into `GenItem`s and format outputs; this module does what is
common in between: fault injection, request validation against the engine's limits, the PD role
(prefill records bootstrap rooms, decode fetches them), and running the items through the engine as
one merged stream of `(item index, StepOutput)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from .bootstrap import RoomInfo, fetch_room
from .engine import EngineRequest, StepOutput
from .errors import ApiError
from .faults import Fault
from .kv_transfer import REMOTE_KV
from .state import STATE_KEY, SimState

log = logging.getLogger(__name__)

BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


@dataclass(frozen=True, slots=True)
class BootstrapRef:
    """Where a PD request's KV lives: the prefill worker's bootstrap server and room."""

    host: str
    port: int
    room: str


@dataclass(frozen=True, slots=True)
class GenItem:
    """One sequence to generate, in engine terms."""

    tokens: list[int]
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    bootstrap: BootstrapRef | None = None


@dataclass(frozen=True, slots=True)
class Prepared:
    """An item ready for the engine, plus the PD bookkeeping that goes with it."""

    request: EngineRequest
    room: BootstrapRef | None = None
    """Set on a prefill worker: the room to announce and complete."""


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object, or a 400."""
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"malformed JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


async def apply_fault(state: SimState) -> None:
    """Count one generation request and act on the injected fault, if any."""
    fault = state.faults.next_fault()
    if fault is Fault.NONE:
        return
    if fault is Fault.CRASH:
        log.error("crashing on generation request #%d (--crash-after)", state.faults.requests_seen)
        state.crash()
        raise ApiError(500, "simulated crash", type="server_error", code="simulated_crash")
    if fault is Fault.ERROR:
        status = state.config.error_status
        kind = "rate_limit_exceeded" if status == 429 else "server_error" if status >= 500 else "invalid_request_error"
        raise ApiError(status, "simulated engine error (--error-rate)", type=kind, code="simulated_error")
    log.info("hanging generation request #%d (--hang-rate)", state.faults.requests_seen)
    await asyncio.Event().wait()  # until the client disconnects and aiohttp cancels the handler


async def admit(request: web.Request) -> tuple[SimState, dict[str, Any]]:
    """What every JSON endpoint does first: count the request and act on an injected fault, read the body as a
    JSON object, and refuse a model this worker does not serve (404, as vLLM and SGLang do)."""
    state = request.app[STATE_KEY]
    await apply_fault(state)
    body = await read_json(request)
    served = state.config.model
    model = body.get("model", served)
    if model != served:
        raise ApiError(
            404, f"The model `{model}` does not exist (this worker serves `{served}`)", code="model_not_found"
        )
    return state, body


def parse_max_tokens(value: Any, *, name: str, default: int, minimum: int = 0) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ApiError(400, f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def parse_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise ApiError(400, "stop must be a string or a list of strings")


def parse_bootstrap(body: dict[str, Any], *, count: int, role: str) -> list[BootstrapRef | None]:
    """Per-item bootstrap references; required on prefill/decode workers, ignored on regular ones.

    For batch requests each field may be a list with one entry per item (host and port may also be a
    single value shared by all items).
    """
    if role == "regular":
        return [None] * count
    for name in BOOTSTRAP_FIELDS:
        if body.get(name) is None:
            raise ApiError(400, f"{name} is required on a {role} worker (PD disaggregation)")
    columns = {name: _per_item(body[name], name=name, count=count) for name in BOOTSTRAP_FIELDS}
    refs: list[BootstrapRef | None] = []
    for host, port, room in zip(*columns.values(), strict=True):
        if not isinstance(host, str) or not host:
            raise ApiError(400, f"bootstrap_host must be a non-empty string, got {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ApiError(400, f"bootstrap_port must be an integer port, got {port!r}")
        if isinstance(room, bool) or not isinstance(room, int | str) or room == "":
            raise ApiError(400, f"bootstrap_room must be an integer or string, got {room!r}")
        refs.append(BootstrapRef(host=host, port=port, room=str(room)))
    return refs


def _per_item(value: Any, *, name: str, count: int) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise ApiError(400, f"{name} has {len(value)} entries for {count} inputs")
        return value
    if count > 1 and name == "bootstrap_room":
        raise ApiError(400, "bootstrap_room must be a list with one room per input for batch requests")
    return [value] * count


async def prepare(state: SimState, items: Sequence[GenItem], *, rid: str) -> list[Prepared]:
    """Validate items against the engine and resolve the PD role (fetching rooms on decode)."""
    capacity = state.config.kv_capacity
    for item in items:
        if not item.tokens:
            raise ApiError(400, "the prompt is empty")
        if len(item.tokens) + item.max_new_tokens > capacity:
            raise ApiError(
                400,
                f"the input ({len(item.tokens)} tokens) plus max tokens ({item.max_new_tokens}) "
                f"exceeds the KV capacity of {capacity} tokens",
            )
    role = state.config.role
    if role == "prefill":
        return [
            Prepared(EngineRequest(item.tokens, 1, (), rid=f"{rid}-{i}"), room=item.bootstrap)
            for i, item in enumerate(items)
        ]
    if role == "decode":
        infos = await asyncio.gather(*(_transfer(state, item) for item in items))
        return [
            Prepared(
                EngineRequest(
                    item.tokens,
                    item.max_new_tokens,
                    item.stop,
                    transferred_cached=info.cached_tokens,
                    rid=f"{rid}-{i}",
                )
            )
            for i, (item, info) in enumerate(zip(items, infos, strict=True))
        ]
    arrived = REMOTE_KV.get()  # a vLLM PD decode (vllm_pd): the prompt's KV was read from a prefill worker
    return [
        Prepared(
            EngineRequest(item.tokens, item.max_new_tokens, item.stop, transferred_cached=arrived, rid=f"{rid}-{i}")
        )
        for i, item in enumerate(items)
    ]


async def _transfer(state: SimState, item: GenItem) -> RoomInfo:
    ref = item.bootstrap
    assert ref is not None
    info = await fetch_room(
        state.client(), host=ref.host, port=ref.port, room=ref.room, wait_s=state.config.bootstrap_timeout
    )
    if info.prompt_tokens != len(item.tokens):
        raise ApiError(
            500,
            f"kv transfer failed: bootstrap room {ref.room} holds {info.prompt_tokens} prompt tokens "
            f"but this request has {len(item.tokens)} (prefill and decode got different requests?)",
            type="server_error",
            code="kv_transfer_failed",
        )
    return info


async def run(state: SimState, prepared: Sequence[Prepared]) -> AsyncGenerator[tuple[int, StepOutput], None]:
    """Run all items concurrently; yield `(index, output)` as the engine produces them.

    Use under `contextlib.aclosing` so that leaving early (client disconnect) aborts every item.
    """
    queue: asyncio.Queue[tuple[int, StepOutput | BaseException]] = asyncio.Queue()
    tasks = [asyncio.create_task(_run_one(state, i, p, queue)) for i, p in enumerate(prepared)]
    remaining = len(tasks)
    try:
        while remaining:
            index, out = await queue.get()
            if isinstance(out, BaseException):
                raise out
            if out.finish is not None:
                remaining -= 1
            yield index, out
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _run_one(
    state: SimState, index: int, item: Prepared, queue: asyncio.Queue[tuple[int, StepOutput | BaseException]]
) -> None:
    rooms, room = state.rooms, item.room
    if rooms is not None and room is not None:
        rooms.announce(room.room)
    completed = False
    try:
        async with state.engine.request(item.request) as handle:
            async for out in handle:
                if rooms is not None and room is not None and not completed:
                    completed = _complete_room(state, room, out)
                queue.put_nowait((index, out))
                if out.finish is not None:
                    return
        queue.put_nowait((index, ApiError(500, "engine dropped the request", type="server_error")))
    except Exception as exc:
        queue.put_nowait((index, exc))
    finally:
        if rooms is not None and room is not None and not completed:
            rooms.fail(room.room, "prefill aborted before it finished")


def _complete_room(state: SimState, room: BootstrapRef, out: StepOutput) -> bool:
    assert state.rooms is not None
    if out.finish is not None and out.finish.type == "abort":
        return False
    state.rooms.complete(
        RoomInfo(
            room=room.room,
            prompt_tokens=out.prompt_tokens,
            cached_tokens=out.cached_tokens,
            ready_time=time.time(),
            worker=state.worker_id,
        )
    )
    return True


async def collect(state: SimState, prepared: Sequence[Prepared]) -> list[tuple[str, StepOutput]]:
    """Run to completion; per item, the full text and the final output (non-streaming responses)."""
    texts: list[list[str]] = [[] for _ in prepared]
    finals: list[StepOutput | None] = [None] * len(prepared)
    async with contextlib.aclosing(run(state, prepared)) as outputs:
        async for index, out in outputs:
            texts[index].append(out.text)
            if out.finish is not None:
                finals[index] = out
    return [("".join(t), f) for t, f in zip(texts, finals, strict=True) if f is not None]


def new_timer() -> float:
    """Start time for `e2e_latency`."""
    return time.monotonic()


def elapsed(since: float) -> float:
    return round(time.monotonic() - since, 6)
