"""Prefill/decode dual dispatch, SGLang bootstrap mode (``--pd-mode sglang``, the default).

Per request: the prefill policy picks a prefill worker and the decode policy a decode worker, each
independently and each with its own tree.  The body gets ``bootstrap_host`` (the prefill worker's
host), ``bootstrap_port`` and a random ``bootstrap_room`` (one entry per item for batch inputs) and
goes to both workers at once; the prefill worker computes the KV cache and hands it to the decode
worker through the room, and the client receives the decode worker's answer (streamed if asked).
If either leg fails, the other is cancelled and the client gets a 502; the prefill leg is watched until it ends,
also while the decode answer is relayed (SGLang's decode worker sends a stream's head before the KV arrived, then
waits for it): a prefill that fails then ends the stream with an error event naming it.  An engine that refuses the
request itself (a 4xx, ``legs.Refused``) has its answer passed to the client as it wrote it.  There are no retries:
a leg that failed may already have been paired with the other.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import orjson

from smg_router import wire
from smg_router.attempt import AttemptGuard, Attempts
from smg_router.errors import BadRequest, UpstreamError
from smg_router.metrics import Metrics
from smg_router.pd import legs
from smg_router.relay import Relay
from smg_router.request import ProxyRequest
from smg_router.upstream import Upstream, UpstreamResponse
from smg_router.workers.worker import Worker

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
        fields = {
            "bootstrap_host": [host] * n,
            "bootstrap_port": [port] * n,
            "bootstrap_room": [random.getrandbits(63) for _ in range(n)],
        }
    for name in fields:
        if name in body:
            raise BadRequest(f"{name}: set by the router in PD mode; remove it from the request", code="invalid_field")
    return orjson.dumps({**body, **fields})


class BootstrapDispatcher:
    """Sends one request to a prefill and a decode worker at once; ``Proxy`` hands it PD-mode requests."""

    def __init__(self, *, attempts: Attempts, upstream: Upstream, relay: Relay, metrics: Metrics) -> None:
        self._attempts = attempts
        self._upstream = upstream
        self._relay = relay
        self._metrics = metrics

    async def forward(self, request: wire.Request, req: ProxyRequest) -> wire.Response:
        with self._attempts.open("prefill", req) as prefill, self._attempts.open("decode", req) as decode:
            body = with_bootstrap(req.endpoint, req.body, prefill.worker)
            prefill_leg = asyncio.ensure_future(self._prefill(prefill, req, body))
            decode_leg = asyncio.ensure_future(self._start(decode, "decode", req, body))
            relaying: asyncio.Task[wire.Response] | None = None
            outcome = "error"
            try:
                await asyncio.wait({prefill_leg, decode_leg}, return_when=asyncio.FIRST_COMPLETED)
                if prefill_leg.done() and (error := prefill_leg.exception()) is not None:
                    outcome = "prefill_failed"
                    raise error
                decode_resp = await decode_leg  # raises the decode leg's UpstreamError
                relaying = asyncio.create_task(self._relay.relay(request, req, decode_resp, decode))
                await asyncio.wait({relaying, prefill_leg}, return_when=asyncio.FIRST_COMPLETED)
                if not relaying.done() and (error := prefill_leg.exception()) is not None:
                    outcome = "prefill_failed"
                    return await self._cut(relaying, error)
                response = await relaying
                outcome = "success"
                return response
            except legs.Refused as refused:
                outcome = "refused"
                return await self._relay.relay(request, req, refused.resp, refused.guard)
            except UpstreamError as e:
                if outcome == "error":
                    outcome = "decode_failed" if e.code == "decode_failed" else "prefill_failed"
                raise
            finally:
                self._metrics.pd_requests.labels(outcome).inc()  # before any await: the client may leave now
                if relaying is not None and not relaying.done():
                    relaying.cancel()  # the client went away
                    await asyncio.gather(relaying, return_exceptions=True)
                await _settle(prefill_leg, decode_leg, succeeded=outcome == "success")

    async def _cut(self, relaying: asyncio.Task[wire.Response], error: BaseException) -> wire.Response:
        """The prefill leg failed while the decode answer was being relayed: a stream already begun ends with an
        error event saying so (the decode worker is not blamed); an answer not begun is the prefill's 502."""
        if self._relay.cut(relaying, str(error), code="prefill_failed"):
            return await relaying
        relaying.cancel()
        await asyncio.gather(relaying, return_exceptions=True)
        raise error

    async def _prefill(self, guard: AttemptGuard, req: ProxyRequest, body: bytes) -> None:
        """Run the prefill leg to the end (its answer is discarded); UpstreamError on any failure."""
        resp = await self._start(guard, "prefill", req, body)
        try:
            await resp.read()
        except Exception as e:
            guard.failed()
            raise UpstreamError(
                f"prefill worker {guard.worker.id} failed mid-request: {e}", code="prefill_failed"
            ) from None
        finally:
            resp.abort()
        guard.answered(resp.status)

    async def _start(self, guard: AttemptGuard, role: str, req: ProxyRequest, body: bytes) -> UpstreamResponse:
        return await legs.send(self._upstream, guard, role, req.endpoint, body, req.headers)


async def _settle(
    prefill_leg: asyncio.Future[None], decode_leg: asyncio.Future[UpstreamResponse], *, succeeded: bool
) -> None:
    """Cut off a leg still running: after a failure so nothing hangs, and after a success the prefill answer
    (never shown to the client) is moot, since the decode answer proves the KV arrived."""
    for leg in (prefill_leg, decode_leg):
        if not leg.done():
            leg.cancel()
        elif not leg.cancelled() and isinstance(refusal := leg.exception(), legs.Refused):
            refusal.resp.abort()  # the other leg's refusal went to the client; a no-op on the one relayed
    if not succeeded and decode_leg.done() and not decode_leg.cancelled() and decode_leg.exception() is None:
        decode_leg.result().abort()
    await asyncio.gather(prefill_leg, decode_leg, return_exceptions=True)
