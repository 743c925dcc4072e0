"""Relaying a worker's answer to the client, for the regular and the PD paths alike.

A non-streaming answer is read whole and returned; an SSE answer to a streaming request is passed
through chunk by chunk as it arrives, waiting while the client is slow (backpressure).  The attempt's
guard learns the outcome: the status once the body is complete, or a failure when the worker's side
times out or breaks off.  A client that goes away cancels the handler; the connection to the worker is
then aborted, so the worker stops generating.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from aiohttp import web

from smg_router.attempt import AttemptGuard
from smg_router.errors import UpstreamTimeout
from smg_router.metrics import Metrics
from smg_router.request import ProxyRequest
from smg_router.upstream.base import UpstreamResponse
from smg_router.workers.worker import Worker

DROP_RESPONSE_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "date",
                                   "server", "proxy-connection", "upgrade", "te", "trailer"})


async def relay(request: web.Request, req: ProxyRequest, upstream: UpstreamResponse, guard: AttemptGuard,
                metrics: Metrics) -> web.StreamResponse:
    """Pass the worker's answer through; the caller closes the guard.

    A timeout or a broken connection while reading the worker's side is the worker's failure; the reads
    are awaited inline (no wrapper coroutine per chunk) because this loop runs for every chunk of every stream.
    """
    worker = guard.worker
    try:
        headers = response_headers(upstream.headers, worker)
        if not (req.stream and upstream.headers.get("content-type", "").startswith("text/event-stream")):
            try:
                body = await upstream.read()
            except (TimeoutError, OSError) as e:
                raise _worker_failed(guard, e) from None
            guard.answered(upstream.status)
            return web.Response(status=upstream.status, body=body, headers=headers)
        out = web.StreamResponse(status=upstream.status, headers=headers)
        await out.prepare(request)
        chunks = aiter(upstream.chunks())
        first = True
        while True:
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                break
            except (TimeoutError, OSError) as e:
                raise _worker_failed(guard, e) from None
            if first:
                first = False
                metrics.ttft_seconds.labels(req.endpoint, req.model).observe(time.perf_counter() - req.started)
            await out.write(chunk)  # waits while the client is slow: backpressure
        await out.write_eof()
        guard.answered(upstream.status)
        return out
    finally:
        upstream.abort()  # no-op once the body was read; cuts the worker off if the client left


def _worker_failed(guard: AttemptGuard, error: BaseException) -> BaseException:
    """Count the worker's failure; a timeout becomes a 504, a broken connection propagates as it is."""
    guard.failed()
    if isinstance(error, TimeoutError):
        return UpstreamTimeout(f"worker {guard.worker.id} did not finish in time")
    return error


def response_headers(upstream: Mapping[str, str], worker: Worker) -> dict[str, str]:
    headers = {k: v for k, v in upstream.items() if k.lower() not in DROP_RESPONSE_HEADERS}
    headers["x-smg-worker-id"] = worker.id
    return headers
