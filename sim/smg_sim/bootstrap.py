"""Prefill/decode disaggregation: the bootstrap room table, its HTTP server and its client.

Models SGLang's PD handshake without moving any KV. The router sends one request to a prefill worker
and the same request to a decode worker, both tagged with `bootstrap_host/port/room`. The prefill
worker records the room here when its prefill finishes; the decode worker long-polls the prefill
worker's bootstrap server (`GET /bootstrap/room/{room}`) to "receive the KV" and then decodes. A wrong
room, host or port therefore fails the way a misrouted PD request would fail in production.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass, field
from typing import Literal

import aiohttp
from aiohttp import web

from .errors import ApiError, error_middleware, json_response

RoomStatus = Literal["unseen", "pending", "ready", "failed"]


@dataclass(frozen=True, slots=True)
class RoomInfo:
    """What a decode worker learns from a finished prefill."""

    room: str
    prompt_tokens: int
    cached_tokens: int
    ready_time: float
    worker: str


@dataclass(eq=False, slots=True)
class _Room:
    status: RoomStatus = "unseen"
    info: RoomInfo | None = None
    error: str = ""
    touched: float = field(default_factory=time.monotonic)
    event: asyncio.Event = field(default_factory=asyncio.Event)

    def set(self, status: RoomStatus) -> None:
        self.status = status
        self.touched = time.monotonic()
        if status in ("ready", "failed"):
            self.event.set()
        else:
            self.event.clear()


class RoomTable:
    """Rooms of one prefill worker, keyed by the room id as a string; entries expire after `ttl` s."""

    def __init__(self, *, ttl: float) -> None:
        self._ttl = ttl
        self._rooms: dict[str, _Room] = {}

    def announce(self, room: str) -> None:
        """A prefill for `room` started: decode workers asking now wait instead of getting 404."""
        self._get(room).set("pending")

    def complete(self, info: RoomInfo) -> None:
        entry = self._get(info.room)
        entry.info = info
        entry.set("ready")

    def fail(self, room: str, reason: str) -> None:
        entry = self._get(room)
        entry.error = reason
        entry.set("failed")

    async def wait(self, room: str, *, wait_s: float) -> tuple[RoomStatus, RoomInfo | None, str]:
        """Wait up to `wait_s` seconds for the room to be ready or failed; return (status, info, error)."""
        entry = self._get(room)
        if entry.status not in ("ready", "failed"):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await entry.event.wait()
        return entry.status, entry.info, entry.error

    def snapshot(self) -> dict[str, dict[str, object]]:
        self._purge()
        return {k: {"status": r.status, **(asdict(r.info) if r.info else {})} for k, r in self._rooms.items()}

    def _get(self, room: str) -> _Room:
        self._purge()
        entry = self._rooms.get(room)
        if entry is None:
            entry = self._rooms[room] = _Room()
        return entry

    def _purge(self) -> None:
        deadline = time.monotonic() - self._ttl
        for key in [k for k, r in self._rooms.items() if r.touched < deadline]:
            del self._rooms[key]


# -- bootstrap HTTP server (runs on the prefill worker's --bootstrap-port) ------------------------

ROOMS_KEY = web.AppKey("smg_sim_rooms", RoomTable)
WAIT_CEILING_KEY = web.AppKey("smg_sim_bootstrap_wait_ceiling", float)


async def _get_room(request: web.Request) -> web.Response:
    room = request.match_info["room"]
    ceiling = request.app[WAIT_CEILING_KEY]
    try:
        timeout = min(float(request.query.get("timeout", ceiling)), ceiling)
    except ValueError as exc:
        raise ApiError(400, f"bad timeout: {request.query.get('timeout')!r}") from exc
    status, info, error = await request.app[ROOMS_KEY].wait(room, wait_s=max(timeout, 0.0))
    if status == "ready" and info is not None:
        return json_response({"status": "ready", **asdict(info)})
    if status == "failed":
        raise ApiError(410, f"prefill for bootstrap room {room} failed: {error}", code="room_failed")
    if status == "pending":
        raise ApiError(
            504,
            f"prefill for bootstrap room {room} did not finish within {timeout:g}s",
            type="server_error",
            code="room_timeout",
        )
    raise ApiError(404, f"bootstrap room {room} not found", code="room_not_found")


async def _list_rooms(request: web.Request) -> web.Response:
    return json_response(request.app[ROOMS_KEY].snapshot())


async def _health(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


def create_bootstrap_app(rooms: RoomTable, *, wait_ceiling: float) -> web.Application:
    """The small HTTP app served on a prefill worker's bootstrap port."""
    app = web.Application(middlewares=[error_middleware])
    app[ROOMS_KEY] = rooms
    app[WAIT_CEILING_KEY] = wait_ceiling
    app.router.add_get("/bootstrap/room/{room}", _get_room)
    app.router.add_get("/bootstrap/rooms", _list_rooms)
    app.router.add_get("/health", _health)
    return app


# -- client side (decode worker) ----------------------------------------------------------------


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def fetch_room(session: aiohttp.ClientSession, *, host: str, port: int, room: str, wait_s: float) -> RoomInfo:
    """Simulated KV transfer: fetch the room from the prefill worker or raise a clear ApiError."""
    where = _hostport(host, port)
    url = f"http://{where}/bootstrap/room/{room}"
    try:
        async with session.get(
            url, params={"timeout": str(wait_s)}, timeout=aiohttp.ClientTimeout(total=wait_s + 5.0)
        ) as resp:
            body = await resp.json(content_type=None)
            status = resp.status
    except TimeoutError as exc:
        raise ApiError(
            504,
            f"kv transfer failed: bootstrap server {where} did not answer for room {room}",
            type="server_error",
            code="kv_transfer_timeout",
        ) from exc
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        raise ApiError(
            502,
            f"kv transfer failed: bootstrap server {where} unreachable for room {room}: {exc}",
            type="server_error",
            code="bootstrap_unreachable",
        ) from exc
    if status == 200 and isinstance(body, dict):
        try:
            return RoomInfo(
                room=str(body["room"]),
                prompt_tokens=int(body["prompt_tokens"]),
                cached_tokens=int(body["cached_tokens"]),
                ready_time=float(body["ready_time"]),
                worker=str(body["worker"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ApiError(
                502,
                f"kv transfer failed: bootstrap server {where} sent a malformed room {room}: {exc!r}",
                type="server_error",
                code="bootstrap_malformed",
            ) from exc
    if status == 404:
        raise ApiError(
            500,
            f"kv transfer failed: bootstrap room {room} not found on {where}",
            type="server_error",
            code="kv_transfer_failed",
        )
    detail = body.get("error", {}).get("message", body) if isinstance(body, dict) else body
    raise ApiError(
        500,
        f"kv transfer failed: bootstrap room {room} on {where}: {detail}",
        type="server_error",
        code="kv_transfer_failed",
    )
