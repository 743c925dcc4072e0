"""Prefill/decode over plain HTTP, vLLM mode (``--pd-mode vllm``): two steps, as vLLM's disaggregated proxy does.

Per request the prefill policy picks a prefill worker and the decode policy a decode worker, both at the start
(the same slots, trees, lifecycle and per-role metrics as the bootstrap mode; no decode worker is a 503 before
anything is sent).  Then:

1. The prefill leg: the client's body with ``max_tokens: 1`` (and ``max_completion_tokens: 1`` when the client
   set it), ``stream: false``, without ``stream_options``, ``min_tokens`` and ``min_completion_tokens`` (what vLLM's
   ``toy_proxy_server.py`` sends), and ``kv_transfer_params`` asking for a remote decode (NixlConnector's
   request: ``do_remote_decode: true``, ``do_remote_prefill: false``, the remote fields null).  The engine
   computes the prompt's KV, answers one token, holds the KV for a decode to read (until its abort timeout,
   ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``) and says where it waits in the answer's ``kv_transfer_params``
   (``do_remote_prefill: true``, ``remote_engine_id``, ``remote_block_ids``, ``remote_host``, ``remote_port``, ...).
2. The decode leg: the client's body as it sent it plus those parameters, verbatim, streamed or not as the
   client asked; the client gets the decode worker's answer (``relay``).

Failures: a prefill worker that cannot be reached, times out, answers a 5xx or breaks its answer off is a 502
naming it (code ``prefill_failed``), and the decode worker gets nothing; a prefill answer without
``kv_transfer_params`` (an engine without a KV connector) is a 502 saying so (``missing_kv_transfer_params``); a
4xx from the prefill worker (the request itself is wrong: too long, unknown model) is passed to the client as
the engine wrote it; a failed decode leg is a 502 naming the decode worker (``decode_failed``).

Retries: the prefill leg is retried on another prefill worker by the regular path's loop (``retry``: connect
error, timeout, 5xx, 429, a broken-off answer; up to ``--max-retries``, with backoff, counted in
``smg_retries_total``) as long as nothing went to the decode worker: a prefill that failed holds no KV anyone
will read, and its abort timeout frees what it holds.  The decode leg is never retried: the parameters are
single-use (the prefill frees the blocks once a decode read them), so a second decode would need a second
prefill.

Only ``/v1/chat/completions`` and ``/v1/completions`` with one prompt can be split this way (vLLM returns one
``kv_transfer_params`` per request): another endpoint is a 501 (as the regular proxy answers a generation
endpoint PD does not cover), a batch a 400 naming what to change.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping
from typing import Any

import orjson

from smg_router import wire
from smg_router.attempt import AttemptGuard, Attempts
from smg_router.errors import BadRequest, NotSupported, UpstreamError
from smg_router.metrics import Metrics
from smg_router.pd import legs
from smg_router.relay import Relay, relayed_head
from smg_router.request import ProxyRequest
from smg_router.retry import RetryLoop, TryElsewhere, describe
from smg_router.upstream import Upstream, UpstreamResponse

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
"""What vLLM can prefill on one engine and decode on another (its OpenAI serving layer takes
``kv_transfer_params`` on these two)."""
REMOTE_DECODE: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""The prefill leg's ``kv_transfer_params``: compute the KV and keep it for a decode elsewhere."""
PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")
"""Fields the prefill leg goes without: it answers one token, as JSON."""
TRANSFER_FIELD = "kv_transfer_params"


def check_request(endpoint: str, body: Mapping[str, Any]) -> None:
    """501 for an endpoint vLLM cannot split, 400 for a request that cannot be split."""
    if endpoint not in ENDPOINTS:
        raise NotSupported(
            f"{endpoint} is not served in vLLM PD mode (--pd-mode vllm): its prefill/decode covers "
            f"{' and '.join(ENDPOINTS)}",
            code="not_supported_in_pd_mode",
        )
    if TRANSFER_FIELD in body:
        raise BadRequest(
            f"{TRANSFER_FIELD}: set by the router in PD mode; remove it from the request", code="invalid_field"
        )
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise BadRequest(
            f"prompt: a batch of {len(prompt)} prompts cannot be split into prefill and decode (vLLM hands over "
            "one prompt's KV per request); send one prompt per request",
            code="invalid_field",
        )


def prefill_body(body: Mapping[str, Any]) -> bytes:
    """The prefill leg's body: the client's, for one token, as JSON, with the remote-decode request."""
    out = {k: v for k, v in body.items() if k not in PREFILL_DROPPED}
    out["max_tokens"] = 1
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out[TRANSFER_FIELD] = dict(REMOTE_DECODE)
    return orjson.dumps(out)


def decode_body(body: Mapping[str, Any], params: Mapping[str, Any]) -> bytes:
    """The decode leg's body: the client's as sent, plus where the prefill left the KV."""
    return orjson.dumps({**body, TRANSFER_FIELD: params})


def transfer_params(answer: bytes, worker: str) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a prefill answer; a 502 that says what is wrong when there are none."""
    try:
        parsed = orjson.loads(answer)
    except orjson.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise UpstreamError(
            f"prefill worker {worker} answered with no JSON object: {answer[:120].decode(errors='replace')!r}",
            code="prefill_failed",
        )
    params = parsed.get(TRANSFER_FIELD)
    if not isinstance(params, dict) or not params:
        raise UpstreamError(
            f"prefill worker {worker} answered without {TRANSFER_FIELD}, so no decode worker can take over: "
            "is it a vLLM engine with a KV connector (--kv-transfer-config, e.g. NixlConnector)?",
            code="missing_kv_transfer_params",
        )
    return params


class VllmDispatcher:
    """The two-step PD request path; ``Proxy`` hands it PD-mode requests when ``--pd-mode vllm``."""

    def __init__(
        self, *, attempts: Attempts, upstream: Upstream, relay: Relay, metrics: Metrics, retries: RetryLoop
    ) -> None:
        self._attempts = attempts
        self._upstream = upstream
        self._relay = relay
        self._metrics = metrics
        self._retries = retries

    async def forward(self, request: wire.Request, req: ProxyRequest) -> wire.Response:
        check_request(req.endpoint, req.body)
        # one id for both legs, as vLLM's proxy sends it (engines started with --enable-request-id-headers use it)
        headers = {**req.headers, "x-request-id": req.headers.get("x-request-id") or uuid.uuid4().hex}
        prefill = self._attempts.open("prefill", req)
        try:
            decode = self._attempts.open("decode", req)
        except BaseException:
            prefill.close()
            raise
        outcome = "prefill_failed"
        try:
            with decode:
                params = await self._prefill(prefill, req, headers)
                if isinstance(params, wire.Response):
                    outcome = "refused"
                    return params  # the engine refused the request itself: its 4xx, as it wrote it
                outcome = "decode_failed"
                body = decode_body(req.body, params)
                try:
                    resp = await legs.send(self._upstream, decode, "decode", req.endpoint, body, headers)
                except legs.Refused as refused:
                    outcome = "refused"
                    return await self._relay.relay(request, req, refused.resp, refused.guard)
                response = await self._relay.relay(request, req, resp, decode)
                outcome = "success"
                return response
        except asyncio.CancelledError:
            outcome = "error"  # the client went away
            raise
        finally:
            self._metrics.pd_requests.labels(outcome).inc()

    async def _prefill(
        self, first: AttemptGuard, req: ProxyRequest, headers: Mapping[str, str]
    ) -> dict[str, Any] | wire.Response:
        """Run the prefill leg, on another prefill worker after a failure (``retry``); the transfer parameters it
        returned, or the engine's 4xx as it wrote it."""
        body = prefill_body(req.body)
        return await self._retries.run(
            "prefill",
            req,
            send=lambda guard: self._upstream.post(guard.worker.url + req.endpoint, body, headers),
            use=self._prefilled,
            first=first,
            unreachable=lambda guard, e: legs.unreachable(guard, "prefill", e),
            set_aside=lambda guard, resp: legs.failed_answer(guard, "prefill", resp),
            gave_up=_decode_not_asked,
        )

    async def _prefilled(self, guard: AttemptGuard, resp: UpstreamResponse) -> dict[str, Any] | wire.Response:
        """The prefill answer the retry loop kept: a 4xx passed on, a 5xx a 502, else its transfer parameters."""
        if 400 <= resp.status < 500:
            return await self._passed_on(guard, resp)
        if resp.status >= 500:
            raise await legs.failed_answer(guard, "prefill", resp)
        try:
            answer = await resp.read()
        except (OSError, TimeoutError) as e:
            raise TryElsewhere(
                UpstreamError(
                    f"prefill worker {guard.worker.id} broke off its answer: {describe(e)}", code="prefill_failed"
                )
            ) from None
        finally:
            resp.abort()
        guard.answered(resp.status)
        return transfer_params(answer, guard.worker.id)

    async def _passed_on(self, guard: AttemptGuard, resp: UpstreamResponse) -> wire.Response:
        try:
            data = await resp.read()
        except (OSError, TimeoutError) as e:
            guard.failed()
            raise UpstreamError(
                f"prefill worker {guard.worker.id} broke off its {resp.status} answer: {e}", code="prefill_failed"
            ) from None
        finally:
            resp.abort()
        guard.answered(resp.status)
        return wire.Response(
            status=resp.status,
            body=data,
            head=relayed_head(resp.headers, guard.worker, url=self._relay.expose_worker_url),
        )


def _decode_not_asked(last: Exception, tried: int) -> UpstreamError:
    """The 502 once every prefill attempt failed: nothing went to the decode worker, so the client may retry."""
    return UpstreamError(
        f"{last} (after {tried} prefill attempt(s); the decode worker was not asked)", code="prefill_failed"
    )
