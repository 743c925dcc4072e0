"""vLLM-style KV hand-over between a prefill and a decode worker (``--vllm-pd``): held blocks, side channel, reads.

Models what vLLM's NixlConnector does without moving any KV.  A prefill worker asked for a remote decode
(``kv_transfer_params.do_remote_decode``) keeps the prompt's KV blocks after its answer (``HeldKV.hold``) and
tells the client where they wait: its engine id, the block ids, and the host and port of its side channel.  A
decode worker given those parameters reads the blocks from that side channel (``read_remote``: an HTTP
``POST /kv/read``, where NIXL would do an RDMA read after a ZMQ handshake), and the prefill frees them once read,
or after ``timeout`` seconds if nobody reads them (vLLM's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s by default).
A wrong engine id, host, port or block list, blocks already read or freed, or a prompt other than the one
prefilled all fail with a clear error, the way a misrouted PD request fails on real engines.

``REMOTE_KV`` carries, for one decode request, how many prompt tokens arrived that way into
``generation.prepare``, which then skips the prefill (``EngineRequest.transferred_cached``).
"""

from __future__ import annotations

import contextvars
import hashlib
import time
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
from aiohttp import web

from .errors import ApiError, error_middleware, json_response

BLOCK_SIZE = 16
"""Tokens per KV block (vLLM's default ``--block-size``)."""
DEFAULT_SIDE_CHANNEL_PORT = 5600
"""vLLM's ``VLLM_NIXL_SIDE_CHANNEL_PORT`` default: where a decode engine reaches a prefill engine."""

REMOTE_KV: contextvars.ContextVar[int | None] = contextvars.ContextVar("smg_sim_remote_kv", default=None)
"""Set by ``vllm_pd`` around one decode request: the prompt tokens whose KV was read from a prefill worker."""


def digest(tokens: Sequence[int]) -> str:
    """A short fingerprint of a prompt, so a decode can tell that the blocks it read hold its own prompt."""
    return hashlib.blake2b(array("I", tokens).tobytes(), digest_size=8).hexdigest()


@dataclass(frozen=True, slots=True)
class Held:
    """KV blocks a prefill keeps for one decode."""

    block_ids: tuple[int, ...]
    num_tokens: int
    digest: str
    request_id: str
    expires: float


class HeldKV:
    """The blocks one prefill worker holds for decodes elsewhere, keyed by their block ids."""

    def __init__(self, *, engine_id: str, timeout: float) -> None:
        self.engine_id = engine_id
        self.timeout = timeout
        self._held: dict[tuple[int, ...], Held] = {}
        self._next_block = 0

    def hold(self, tokens: Sequence[int], *, request_id: str) -> Held:
        """Keep a finished prefill's KV: one block per BLOCK_SIZE prompt tokens, freed after ``timeout``."""
        self._purge()
        count = -(-len(tokens) // BLOCK_SIZE)
        ids = tuple(range(self._next_block, self._next_block + count))
        self._next_block += count
        held = Held(ids, len(tokens), digest(tokens), request_id, time.monotonic() + self.timeout)
        self._held[ids] = held
        return held

    def read(self, *, engine_id: str, block_ids: Sequence[int]) -> Held:
        """A decode reads the blocks (which frees them); a 404 naming what does not match."""
        self._purge()
        if engine_id != self.engine_id:
            raise ApiError(
                404,
                f"engine {engine_id!r} is not served by this side channel (it serves engine {self.engine_id!r}): "
                "the kv_transfer_params point at another prefill worker",
                type="not_found_error",
                code="unknown_engine",
            )
        held = self._held.pop(tuple(block_ids), None)
        if held is None:
            raise ApiError(
                404,
                f"engine {self.engine_id!r} holds no KV in blocks {list(block_ids)[:8]}: never prefilled here, "
                f"already read by a decode, or freed after the {self.timeout:g} s abort timeout",
                type="not_found_error",
                code="blocks_not_held",
            )
        return held

    def snapshot(self) -> list[dict[str, Any]]:
        self._purge()
        return [{**asdict(h), "block_ids": list(h.block_ids)} for h in self._held.values()]

    def _purge(self) -> None:
        now = time.monotonic()
        for key in [k for k, h in self._held.items() if h.expires <= now]:
            del self._held[key]


# -- side channel (on the prefill worker) -------------------------------------------------------

HELD_KEY = web.AppKey("smg_sim_held_kv", HeldKV)


async def _read(request: web.Request) -> web.Response:
    try:
        body = await request.json()
        engine_id, block_ids = body["engine_id"], body["block_ids"]
    except (ValueError, TypeError, KeyError) as exc:
        raise ApiError(400, f"a KV read needs engine_id and block_ids: {exc!r}") from exc
    if not isinstance(engine_id, str) or not isinstance(block_ids, list):
        raise ApiError(400, "engine_id must be a string and block_ids a list")
    held = request.app[HELD_KEY].read(engine_id=engine_id, block_ids=block_ids)
    return json_response({"num_tokens": held.num_tokens, "digest": held.digest, "request_id": held.request_id})


async def _list(request: web.Request) -> web.Response:
    held = request.app[HELD_KEY]
    return json_response({"engine_id": held.engine_id, "held": held.snapshot()})


def create_side_channel_app(held: HeldKV) -> web.Application:
    """The small HTTP app a prefill worker serves on its side-channel port (``--bootstrap-port``)."""
    app = web.Application(middlewares=[error_middleware])
    app[HELD_KEY] = held
    app.router.add_post("/kv/read", _read)
    app.router.add_get("/kv/held", _list)
    return app


# -- reading (on the decode worker) -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RemoteRef:
    """Where a prefill left a prompt's KV: the prefill's answer's ``kv_transfer_params``."""

    engine_id: str
    host: str
    port: int
    block_ids: tuple[int, ...]


REQUIRED = ("remote_engine_id", "remote_host", "remote_port", "remote_block_ids")


def parse_remote(params: Any) -> RemoteRef:
    """The remote KV of a decode request's ``kv_transfer_params``; a 400 naming what is missing or wrong."""
    hint = (
        "send the request to a prefill worker first (kv_transfer_params.do_remote_decode: true) and pass on the "
        "kv_transfer_params it answers"
    )
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        raise ApiError(
            400,
            f"this is a vLLM decode worker: it needs kv_transfer_params with do_remote_prefill: true; {hint}",
            code="missing_kv_transfer_params",
        )
    missing = [name for name in REQUIRED if params.get(name) is None]
    if missing:
        raise ApiError(400, f"kv_transfer_params lacks {', '.join(missing)}; {hint}", code="invalid_kv_transfer_params")
    engine, host, port, blocks = (params[name] for name in REQUIRED)
    if not isinstance(engine, str) or not isinstance(host, str) or not host:
        raise ApiError(400, "kv_transfer_params.remote_engine_id and remote_host must be strings")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ApiError(400, f"kv_transfer_params.remote_port must be a port number, got {port!r}")
    if not isinstance(blocks, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks):
        raise ApiError(400, "kv_transfer_params.remote_block_ids must be a list of block ids")
    return RemoteRef(engine, host, port, tuple(blocks))


async def read_remote(session: aiohttp.ClientSession, ref: RemoteRef, tokens: Sequence[int], *, wait_s: float) -> int:
    """Read a prompt's KV from the prefill's side channel; the number of tokens it holds, or a clear 5xx."""
    where = f"[{ref.host}]:{ref.port}" if ":" in ref.host else f"{ref.host}:{ref.port}"
    what = f"engine {ref.engine_id!r} at {where}"
    try:
        async with session.post(
            f"http://{where}/kv/read",
            json={"engine_id": ref.engine_id, "block_ids": list(ref.block_ids)},
            timeout=aiohttp.ClientTimeout(total=wait_s),
        ) as resp:
            status, body = resp.status, await resp.json(content_type=None)
    except TimeoutError as exc:
        raise ApiError(
            504, f"kv transfer failed: {what} did not answer", type="server_error", code="kv_transfer_timeout"
        ) from exc
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        raise ApiError(
            502, f"kv transfer failed: {what} unreachable: {exc}", type="server_error", code="kv_transfer_failed"
        ) from exc
    if status != 200 or not isinstance(body, dict):
        detail = body.get("error", {}).get("message", body) if isinstance(body, dict) else body
        raise ApiError(500, f"kv transfer failed from {what}: {detail}", type="server_error", code="kv_transfer_failed")
    if body.get("num_tokens") != len(tokens) or body.get("digest") != digest(tokens):
        raise ApiError(
            500,
            f"kv transfer failed: the blocks read from {what} hold another prompt ({body.get('num_tokens')} tokens) "
            f"than this request ({len(tokens)} tokens): prefill and decode got different requests?",
            type="server_error",
            code="kv_transfer_failed",
        )
    return len(tokens)
