"""Prefill/decode dual dispatch (SGLang bootstrap mode, DESIGN 2.6).

Per request: the prefill policy picks a prefill worker and the decode policy a decode worker, each
independently and each with its own tree.  The body gets ``bootstrap_host`` (the prefill worker's
host), ``bootstrap_port`` and a random ``bootstrap_room`` (one entry per item for batch inputs) and
goes to both workers at once; the prefill worker computes the KV cache and hands it to the decode
worker through the room, and the client receives the decode worker's answer (streamed if asked).
If either leg fails, the other is cancelled and the client gets a 502.  There are no retries: a leg
that failed may already have been paired with the other.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import orjson
from aiohttp import web

from smg_router.errors import BadRequest, UpstreamError
from smg_router.policies.base import RouteRequest
from smg_router.upstream import UpstreamConnectError, UpstreamResponse
from smg_router.workers.worker import Worker

if TYPE_CHECKING:
    from smg_router.proxy import Proxy, Routed

log = logging.getLogger(__name__)
DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default


def batch_size(endpoint: str, body: Mapping[str, Any]) -> int | None:
    """Number of items of a batch request, or None for a single one."""
    if endpoint == "/generate":
        value = body.get("text") if body.get("text") is not None else body.get("input_ids")
    elif endpoint == "/v1/completions":
        value = body.get("prompt")
    else:
        return None
    if isinstance(value, list) and value and all(isinstance(v, str | list) for v in value):
        return len(value)
    return None


def with_bootstrap(endpoint: str, body: dict[str, Any], prefill: Worker) -> bytes:
    """The request body for both legs: the client's JSON plus the bootstrap fields."""
    host = urlsplit(prefill.url).hostname or ""
    port = prefill.spec.bootstrap_port or DEFAULT_BOOTSTRAP_PORT
    n = batch_size(endpoint, body)
    fields: dict[str, Any]
    if n is None:
        fields = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": random.getrandbits(63)}
    else:
        fields = {"bootstrap_host": [host] * n, "bootstrap_port": [port] * n,
                  "bootstrap_room": [random.getrandbits(63) for _ in range(n)]}
    for name in fields:
        if name in body:
            raise BadRequest(f"{name}: set by the router in PD mode; remove it from the request",
                             code="invalid_field")
    return orjson.dumps({**body, **fields})


class PDDispatcher:
    """Sends one request to a prefill and a decode worker; used by ``Proxy`` in PD mode."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy

    async def forward(self, request: web.Request, routed: Routed, started: float) -> web.StreamResponse:
        p = self.proxy
        route = RouteRequest(routed.model, routed.text)
        prefill = p.select("prefill", route, set())
        decode = p.select("decode", route, set())
        assert routed.parsed is not None
        body = with_bootstrap(routed.endpoint, routed.parsed, prefill)
        headers = p.forward_headers(request)
        p.track(prefill, +1)
        p.track(decode, +1)
        prefill_leg = asyncio.ensure_future(self._prefill(prefill, routed.endpoint, body, headers))
        decode_leg = asyncio.ensure_future(self._decode(decode, routed.endpoint, body, headers))
        outcome = "error"
        try:
            await asyncio.wait({prefill_leg, decode_leg}, return_when=asyncio.FIRST_COMPLETED)
            if prefill_leg.done() and prefill_leg.exception() is not None:
                outcome = "prefill_failed"
                raise prefill_leg.exception()  # type: ignore[misc]
            decode_resp = await decode_leg  # raises the decode leg's UpstreamError
            response = await p.respond(request, routed, decode, decode_resp, started)
            outcome = "success"
            return response
        except UpstreamError as e:
            if outcome == "error":
                outcome = "decode_failed" if e.code == "decode_failed" else "prefill_failed"
            raise
        finally:
            # A leg still running now is cut off: after a failure so nothing hangs, and after a success the prefill
            # answer (never shown to the client) is moot, since the decode answer proves the KV arrived.
            for leg in (prefill_leg, decode_leg):
                if not leg.done():
                    leg.cancel()
            if outcome != "success" and decode_leg.done() and not decode_leg.cancelled() \
                    and decode_leg.exception() is None:
                decode_leg.result().abort()
            await asyncio.gather(prefill_leg, decode_leg, return_exceptions=True)
            p.track(prefill, -1)
            p.track(decode, -1)
            p.metrics.pd_requests.labels(outcome).inc()

    async def _prefill(self, worker: Worker, path: str, body: bytes, headers: dict[str, str]) -> None:
        """Run the prefill leg to the end (its answer is discarded); UpstreamError on any failure."""
        resp = await self._start(worker, "prefill", path, body, headers)
        try:
            await resp.read()
        except Exception as e:
            worker.breaker.record_failure()
            raise UpstreamError(f"prefill worker {worker.url} failed mid-request: {e}",
                                code="prefill_failed") from None
        finally:
            resp.abort()
        worker.breaker.record_success()

    async def _decode(self, worker: Worker, path: str, body: bytes, headers: dict[str, str]) -> UpstreamResponse:
        return await self._start(worker, "decode", path, body, headers)

    async def _start(self, worker: Worker, role: str, path: str, body: bytes,
                     headers: dict[str, str]) -> UpstreamResponse:
        try:
            resp = await self.proxy.upstream.post(worker.url + path, body, headers)
        except (UpstreamConnectError, TimeoutError) as e:
            worker.breaker.record_failure()
            raise UpstreamError(f"{role} worker {worker.url} failed: {e}", code=f"{role}_failed") from None
        if resp.status >= 400:
            if resp.status >= 500:
                worker.breaker.record_failure()
            detail = (await resp.read())[:300].decode(errors="replace")
            resp.abort()
            raise UpstreamError(f"{role} worker {worker.url} answered {resp.status}: {detail}",
                                code=f"{role}_failed")
        return resp
