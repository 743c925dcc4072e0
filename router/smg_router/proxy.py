"""THE request path: select → track → send → stream → retry → complete.

A request is routed by its model's policy among the routable workers, counted in the chosen worker's
in-flight total for as long as its response lasts (however it ends), sent as the bytes the client sent
(never re-serialised), and answered with the worker's response, streamed through as it arrives.  A
connect error, 5xx or 429 before anything reached the client is retried on another worker with backoff;
every outcome feeds the worker's circuit breaker.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from smg_router.errors import BadRequest, ModelNotFound, NoWorkerAvailable, UpstreamError, UpstreamTimeout
from smg_router.metrics import Metrics
from smg_router.pd import PDDispatcher
from smg_router.policies.base import RouteRequest
from smg_router.policies.registry import PolicyRegistry
from smg_router.settings import RetrySettings
from smg_router.upstream import Upstream, UpstreamConnectError, UpstreamResponse
from smg_router.workers.registry import WorkerRegistry
from smg_router.workers.worker import Worker

log = logging.getLogger(__name__)

FORWARD_REQUEST_HEADERS = ("content-type", "authorization", "accept", "x-request-id", "traceparent")
DROP_RESPONSE_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "date",
                                   "server", "proxy-connection", "upgrade", "te", "trailer"})


@dataclass(frozen=True, slots=True)
class Routed:
    """A parsed request ready to route."""

    endpoint: str
    """Metric label and upstream path: /v1/chat/completions, /v1/completions, /generate."""
    model: str
    text: str
    stream: bool
    body: bytes
    """The bytes the client sent, forwarded unchanged (regular mode)."""
    parsed: dict[str, Any] | None = None
    """The parsed body, for PD mode, which adds the bootstrap fields."""


class Proxy:
    def __init__(self, *, registry: WorkerRegistry, policies: PolicyRegistry, upstream: Upstream,
                 metrics: Metrics, retry: RetrySettings, pd_mode: bool = False) -> None:
        self.registry = registry
        self.policies = policies
        self.upstream = upstream
        self.metrics = metrics
        self.retry = retry
        self.pd_mode = pd_mode
        self._pd = PDDispatcher(self)

    # -- model and worker selection -------------------------------------------------------------
    def resolve_model(self, requested: str | None) -> str:
        """The model key a request routes by: 404 for a model no worker serves, 503 with no workers."""
        role = "decode" if self.pd_mode else "regular"
        workers = self.registry.with_role(role)
        if not workers:
            raise NoWorkerAvailable(f"no {role} workers are registered", code="no_workers")
        models = {w.model_id for w in workers}
        if requested is not None:
            if requested in models or None in models:
                return requested
            raise ModelNotFound(requested)
        known = sorted(m for m in models if m is not None)
        if len(known) == 1:
            return known[0]
        if not known:
            return ""
        raise BadRequest(f"model is required: this router serves {', '.join(known)}", code="missing_field")

    def select(self, role: str, route: RouteRequest, exclude: set[str]) -> Worker:
        candidates = [w for w in self.registry.serving(role, route.model) if w.routable and w.id not in exclude]
        if not candidates:
            what = "other " if exclude else ""
            raise NoWorkerAvailable(f"no {what}healthy {role} worker for model '{route.model}'",
                                    code="no_available_workers")
        policy = self.policies.policy_for(role, route.model)
        t0 = time.perf_counter()
        worker = policy.select(candidates, route, time.monotonic())
        self.metrics.decision_seconds.labels(policy.name).observe(time.perf_counter() - t0)
        worker.processed += 1
        return worker

    # -- the request path -----------------------------------------------------------------------
    async def handle(self, request: web.Request, routed: Routed) -> web.StreamResponse:
        started = time.perf_counter()
        status = 500
        try:
            forward = self._pd.forward if self.pd_mode else self._forward
            response = await forward(request, routed, started)
            status = response.status
            return response
        except web.HTTPException as e:
            status = e.status
            raise
        except Exception as e:
            status = getattr(e, "status", 500)  # RouterError carries its status; for the metric only
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        finally:
            m = self.metrics
            m.requests.labels(routed.endpoint, routed.model, str(status)).inc()
            m.request_seconds.labels(routed.endpoint, routed.model).observe(time.perf_counter() - started)

    async def _forward(self, request: web.Request, routed: Routed, started: float) -> web.StreamResponse:
        route = RouteRequest(routed.model, routed.text)
        headers = self.forward_headers(request)
        tried: set[str] = set()
        last_error: Exception | None = None
        for attempt in range(self.retry.max_retries + 1):
            if attempt:
                self.metrics.retries.labels(routed.endpoint).inc()
                await asyncio.sleep(self._backoff(attempt))
            try:
                worker = self.select("regular", route, tried)
            except NoWorkerAvailable:
                if last_error is not None:
                    break
                raise
            tried.add(worker.id)
            self.track(worker, +1)
            try:
                try:
                    upstream = await self.upstream.post(worker.url + routed.endpoint, routed.body, headers)
                except (UpstreamConnectError, TimeoutError) as e:
                    worker.breaker.record_failure()
                    last_error = e
                    log.warning("worker %s unreachable (%s); attempt %d", worker.url, e, attempt + 1)
                    continue
                if _retryable(upstream.status) and attempt < self.retry.max_retries:
                    worker.breaker.record_failure()
                    last_error = UpstreamError(f"worker answered {upstream.status}")
                    upstream.release()
                    log.warning("worker %s answered %d; retrying elsewhere", worker.url, upstream.status)
                    continue
                return await self.respond(request, routed, worker, upstream, started)
            finally:
                self.track(worker, -1)
        if isinstance(last_error, TimeoutError):
            raise UpstreamTimeout(f"no worker answered in time after {len(tried)} attempt(s)")
        raise UpstreamError(f"no worker could serve the request after {len(tried)} attempt(s): {last_error}",
                            code="upstream_unavailable")

    async def respond(self, request: web.Request, routed: Routed, worker: Worker,
                       upstream: UpstreamResponse, started: float) -> web.StreamResponse:
        """Pass the worker's answer through; the caller's finally drops the in-flight count."""
        ok = upstream.status < 500
        try:
            headers = _response_headers(upstream.headers, worker)
            if not (routed.stream and upstream.headers.get("content-type", "").startswith("text/event-stream")):
                body = await upstream.read()
                (worker.breaker.record_success if ok else worker.breaker.record_failure)()
                return web.Response(status=upstream.status, body=body, headers=headers)
            out = web.StreamResponse(status=upstream.status, headers=headers)
            await out.prepare(request)
            first = True
            async for chunk in upstream.chunks():
                if first:
                    first = False
                    self.metrics.ttft_seconds.labels(routed.endpoint, routed.model).observe(
                        time.perf_counter() - started)
                await out.write(chunk)  # waits while the client is slow: backpressure
            await out.write_eof()
            (worker.breaker.record_success if ok else worker.breaker.record_failure)()
            return out
        except TimeoutError:
            worker.breaker.record_failure()
            raise UpstreamTimeout(f"worker {worker.id} did not finish in time") from None
        finally:
            upstream.abort()  # no-op once the body was read; cuts the worker off if the client left

    @staticmethod
    def forward_headers(request: web.Request) -> dict[str, str]:
        return {k: v for k in FORWARD_REQUEST_HEADERS if (v := request.headers.get(k)) is not None}

    def track(self, worker: Worker, delta: int) -> None:
        worker.inflight += delta
        if self.registry.get(worker.id) is worker:  # a removed worker's series must not come back
            self.metrics.worker_inflight.labels(worker.url, worker.role).set(worker.inflight)

    def _backoff(self, attempt: int) -> float:
        r = self.retry
        return min(r.backoff_max, r.backoff_initial * 2 ** (attempt - 1)) * (0.5 + random.random() / 2)


def _retryable(status: int) -> bool:
    return status >= 500 or status == 429


def _response_headers(upstream: Mapping[str, str], worker: Worker) -> dict[str, str]:
    headers = {k: v for k, v in upstream.items() if k.lower() not in DROP_RESPONSE_HEADERS}
    headers["x-smg-worker-id"] = worker.id
    return headers
