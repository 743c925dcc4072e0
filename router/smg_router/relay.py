"""Relaying a worker's answer to the client, for the regular and the PD paths alike.

A non-streaming answer is read whole and returned; an SSE answer to a streaming request is passed through as it
arrives, each read of the worker's connection written to the client from within that read
(``UpstreamResponse.pipe``), stopping while the client is slow (backpressure: the worker's connection is not read
meanwhile).  The attempt's guard learns the outcome: the status once the body is complete, or a failure when the
worker's side times out or breaks off.  A stream that fails after its first byte ends with an OpenAI-shaped error event
and ``data: [DONE]`` (never a second response, never a cut chunked encoding); a non-streaming answer the
worker breaks off becomes a 502.  A client that goes away cancels the handler; the connection to the
worker is then aborted, so the worker stops generating.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Mapping
from typing import Any

import orjson

from smg_router import wire
from smg_router.attempt import AttemptGuard
from smg_router.errors import UpstreamError, UpstreamTimeout
from smg_router.metrics import Metrics
from smg_router.request import ProxyRequest
from smg_router.response_ids import SCAN_LIMIT, ResponseIdTags, id_of_body, id_of_events, quoted
from smg_router.upstream.base import ResponseTooLarge, UpstreamResponse
from smg_router.workers.worker import Worker

DROP_RESPONSE_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "date",
        "server",
        "proxy-connection",
        "upgrade",
        "te",
        "trailer",
    }
)


SSE_DONE = b"data: [DONE]\n\n"
"""The event that ends an OpenAI or SGLang stream."""
LAST_EVENT = {"/v1/messages": b"event: message_stop\n", "/v1/responses": b"event: response.completed\n"}
"""The event that ends the streams of the endpoints whose streams do not end with ``[DONE]``."""
RESPONSES = "/v1/responses"
"""The endpoint whose response ids are tagged with their worker (``response_ids``)."""
WORKER_ID_HEADER = "x-smg-worker-id"
"""The routed worker's opaque id (a hash of its URL), as SGLang's gateway names it."""
ROUTED_WORKER_HEADER = "x-smg-routed-worker-id"
"""The routed worker's URL, as the Rust SMG names it (the decode worker in PD mode); only with
``--expose-worker-url``: a worker's address inside the cluster is not the client's business."""


class Relay:
    """Relays answers; keeps the task of every stream it is passing through, for ``end_streams``."""

    def __init__(
        self, *, metrics: Metrics, response_ids: ResponseIdTags | None = None, expose_worker_url: bool = False
    ) -> None:
        self._metrics = metrics
        self.response_ids = response_ids
        """Tags the ids of relayed Responses answers with their worker (None: they go through as they are)."""
        self.expose_worker_url = expose_worker_url
        """Whether answers name the worker's URL (``ROUTED_WORKER_HEADER``), not only its opaque id."""
        self._streams: set[asyncio.Task[object]] = set()
        self._cuts: dict[asyncio.Task[object], tuple[str, str]] = {}
        """Streams ``cut`` asked to end, with the (message, code) of their error event."""
        self.closing = False
        """True once ``end_streams`` ran: a cancelled stream then ends with an error event."""
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop the streams run on, asked once (``_stream``)."""

    def end_streams(self) -> int:
        """At the shutdown deadline: cancel every stream still running (each ends with an error event and
        ``[DONE]`` instead of a cut connection); returns how many."""
        self.closing = True
        for task in self._streams:
            task.cancel()
        return len(self._streams)

    def cut(self, task: asyncio.Task[Any], message: str, *, code: str) -> bool:
        """End the stream ``task`` is passing through with an error event saying ``message``, through no fault of its
        worker (PD: the other leg failed); False when ``task`` passes no stream (nothing reached the client yet)."""
        if task not in self._streams:
            return False
        self._cuts[task] = (message, code)
        task.cancel()
        return True

    async def relay(
        self, request: wire.Request, req: ProxyRequest, upstream: UpstreamResponse, guard: AttemptGuard
    ) -> wire.Response:
        """Pass the worker's answer through; the caller closes the guard."""
        try:
            head = relayed_head(upstream.headers, guard.worker, url=self.expose_worker_url)
            if req.stream and upstream.headers.get("content-type", "").startswith("text/event-stream"):
                return await self._stream(request, req, upstream, guard, head)
            try:
                body = await upstream.read()
            except TimeoutError:
                guard.failed()
                raise UpstreamTimeout(f"worker {guard.worker.id} did not finish in time") from None
            except ResponseTooLarge as e:
                guard.failed()
                raise UpstreamError(f"worker {guard.worker.id}: {e}", code="upstream_response_too_large") from None
            except OSError as e:
                guard.failed()
                raise UpstreamError(
                    f"worker {guard.worker.id} broke off its answer: {e}", code="upstream_disconnected"
                ) from None
            guard.answered(upstream.status)
            if self._records(req, upstream.status) and (rid := id_of_body(body)) is not None:
                for old, new in self._tagging(req, rid, guard.worker):
                    body = body.replace(old, new)
            response = wire.Response(status=upstream.status, body=body, head=head)
            response.send_now(request)  # the client has it before the guard's and the metrics' bookkeeping
            return response
        finally:
            upstream.abort()  # no-op once the body was read; cuts the worker off if the client left

    async def _stream(
        self,
        request: wire.Request,
        req: ProxyRequest,
        upstream: UpstreamResponse,
        guard: AttemptGuard,
        head: bytes,
    ) -> wire.StreamResponse:
        """SSE through as it arrives: each read of the worker's stream goes to the client from within the read
        (``UpstreamResponse.pipe``, the sink ``_Passing.pass_on``); this coroutine wakes when the client is slow, the
        stream ends or fails, not for every read."""
        out = wire.StreamResponse(status=upstream.status, head=head)
        await out.prepare(request, hold=upstream.waiting())  # the body is here: the head goes with it, one write
        if self._loop is None:  # asked once: each ask is a getpid(2) on Python 3.11 (its running-loop check)
            self._loop = asyncio.get_running_loop()
        task = asyncio.current_task(self._loop)
        assert task is not None
        self._streams.add(task)
        passing = _Passing(self, req, out, guard)
        try:
            while True:
                try:
                    ended = await upstream.pipe(passing.pass_on)
                except TimeoutError:
                    guard.failed()
                    await _end_with_error(
                        out,
                        req.endpoint,
                        "the worker did not finish in time",
                        type="upstream_timeout",
                        code="upstream_timeout",
                    )
                    return out
                except OSError as e:
                    guard.failed()
                    await _end_with_error(
                        out,
                        req.endpoint,
                        f"the worker broke off the stream: {e}",
                        type="upstream_error",
                        code="upstream_disconnected",
                    )
                    return out
                if passing.gone:  # the client hung up; the finally of relay() cuts the worker off
                    req.client_gone = True
                    return out
                if ended:
                    if passing.retag is not None and (rest := passing.retag.flush()):
                        await out.write(rest)  # the end of a stream whose end the transport did not mark
                    break
                try:
                    await out.drain()  # the client reads slower than the worker writes (backpressure)
                except ConnectionError:
                    req.client_gone = True
                    return out
        except asyncio.CancelledError:
            if passing.done:  # the client left after the last event, before the worker closed its stream: served
                task.uncancel()
                guard.answered(upstream.status)
                return out
            cut = self._cuts.pop(task, None)
            if cut is not None:
                task.uncancel()
                message, code = cut
                await _end_with_error(out, req.endpoint, message, type="upstream_error", code=code)
                return out
            if not self.closing:
                raise  # the client went away
            task.uncancel()
            await _end_with_error(
                out,
                req.endpoint,
                "the router is shutting down; retry the request",
                type="service_unavailable",
                code="router_shutting_down",
            )
            return out
        finally:
            self._streams.discard(task)
            self._cuts.pop(task, None)
        with contextlib.suppress(ConnectionError):  # gone after the last event: only the chunked body's end is lost
            await out.write_eof()
        guard.answered(upstream.status)
        return out

    def _records(self, req: ProxyRequest, status: int) -> bool:
        return self.response_ids is not None and req.endpoint == RESPONSES and 200 <= status < 300

    def _tagging(self, req: ProxyRequest, response_id: str, worker: Worker) -> list[tuple[bytes, bytes]]:
        """(engine's form, client's form) of the ids in a Responses answer: its own id, tagged with its worker, and
        the ``previous_response_id`` it repeats, as the client sent it."""
        assert self.response_ids is not None
        pairs = [(quoted(response_id), quoted(self.response_ids.tag(response_id, worker.url)))]
        forwarded = req.body.get("previous_response_id")
        if req.previous_response_id is not None and isinstance(forwarded, str):
            pairs.append((quoted(forwarded), quoted(req.previous_response_id)))
        return pairs


class _Passing:
    """One stream's chunks on their way to the client (``Relay._stream``): ``pass_on`` is the sink of
    ``UpstreamResponse.pipe``, called from within the worker connection's reads (the client gone is a state, not an
    exception; anything else it raised, ``pipe`` raises again in the relay's task)."""

    __slots__ = ("_guard", "_last", "_out", "_relay", "_req", "done", "first", "gone", "retag")

    def __init__(self, relay: Relay, req: ProxyRequest, out: wire.StreamResponse, guard: AttemptGuard) -> None:
        self._relay, self._req, self._out, self._guard = relay, req, out, guard
        self._last = LAST_EVENT.get(req.endpoint)
        self.first = True
        self.done = False
        """Whether the last chunk written ended the SSE (``data: [DONE]``): the client has the whole answer."""
        self.gone = False
        """The client went away (a write found its connection closed)."""
        self.retag = _Retag(relay, req, guard.worker) if relay._records(req, out.status) else None
        """Rewrites the response ids on the way (Responses only)."""

    def pass_on(self, chunk: bytes, last: bool) -> bool:
        """Write a piece of the stream (``last``: the body's end goes with it); whether to go on at once (False:
        the client is slow, or gone)."""
        if self.first:
            self.first = False
            self._guard.started()
            req = self._req
            self._relay._metrics.ttft_seconds.labels(req.endpoint, req.model).observe(time.perf_counter() - req.started)
        if self.retag is not None:
            chunk = self.retag.feed(chunk, last)
            if not chunk and not last:
                return True  # held until the id is known or the piece of an id is complete
        try:
            slow = self._out.write_now(chunk, last=last)
        except ConnectionError:
            self.gone = True
            return False
        self.done = chunk.endswith(SSE_DONE) or (self._last is not None and self._last in chunk)
        return not slow


class _Retag:
    """A Responses stream's ids in the client's form (``Relay._tagging``): the stream is held until its first event
    with the response's id (``response.created``, the first event; at most ``SCAN_LIMIT`` bytes), then passed on with
    every occurrence replaced, but for a last few bytes that may begin an id completed by the next piece."""

    __slots__ = ("_pairs", "_pending", "_relay", "_req", "_worker")

    def __init__(self, relay: Relay, req: ProxyRequest, worker: Worker) -> None:
        self._relay, self._req, self._worker = relay, req, worker
        self._pairs: list[tuple[bytes, bytes]] | None = None
        """Known once the id was found ([] when it was not, within ``SCAN_LIMIT``)."""
        self._pending = b""

    def feed(self, chunk: bytes, last: bool) -> bytes:
        """What of the stream so far goes to the client now."""
        data = self._pending + chunk
        if self._pairs is None:
            rid = id_of_events(data)
            if rid is None and len(data) <= SCAN_LIMIT and not last:
                self._pending = data
                return b""
            self._pairs = [] if rid is None else self._relay._tagging(self._req, rid, self._worker)
        for old, new in self._pairs:
            data = data.replace(old, new)
        keep = 0 if last else max((_held(data, old) for old, _ in self._pairs), default=0)
        self._pending = data[len(data) - keep :] if keep else b""
        return data[: len(data) - keep] if keep else data

    def flush(self) -> bytes:
        """What is still held when the stream ends."""
        data, self._pending = self._pending, b""
        for old, new in self._pairs or ():
            data = data.replace(old, new)
        return data


def _held(data: bytes, needle: bytes) -> int:
    """The length of the longest end of ``data`` that begins ``needle`` (and could be completed by what follows)."""
    for k in range(min(len(needle) - 1, len(data)), 0, -1):
        if data.endswith(needle[:k]):
            return k
    return 0


async def _end_with_error(out: wire.StreamResponse, endpoint: str, message: str, *, type: str, code: str) -> None:
    """The last events of a stream that cannot go on, in the stream's own shape (``error_event``)."""
    with contextlib.suppress(ConnectionError):  # the client may be gone too
        await out.write(error_event(endpoint, message, type=type, code=code))
        await out.write_eof()


def error_event(endpoint: str, message: str, *, type: str, code: str) -> bytes:
    """An error as the stream's clients read one: Anthropic's ``event: error`` for Messages (its SDK ignores a
    nameless event, so an OpenAI-shaped one would end the message silently), OpenAI's ``event: error`` for
    Responses, else an OpenAI-shaped error then ``[DONE]`` (chat, completions, SGLang ``/generate``)."""
    if endpoint == "/v1/messages":
        kind = "overloaded_error" if code == "router_shutting_down" else "api_error"
        body = {"type": "error", "error": {"type": kind, "message": message}}
        return b"event: error\ndata: " + orjson.dumps(body) + b"\n\n"
    if endpoint == "/v1/responses":
        error: dict[str, object] = {"type": "error", "code": code, "message": message, "param": None}
        return b"event: error\ndata: " + orjson.dumps(error) + b"\n\n"
    event = orjson.dumps({"error": {"message": message, "type": type, "code": code}})
    return b"data: " + event + b"\n\ndata: [DONE]\n\n"


def relayed_head(upstream: Mapping[str, str], worker: Worker, *, url: bool = False) -> bytes:
    """The worker's answer headers the client gets, encoded (``wire.Response.head``): all but those of the hop
    (``DROP_RESPONSE_HEADERS``: the router frames its own answer), then the routed worker's id, and its URL when
    ``url`` (``--expose-worker-url``)."""
    kept = "".join(f"{k}: {v}\r\n" for k, v in upstream.items() if k.lower() not in DROP_RESPONSE_HEADERS)
    return (kept + _worker_lines(worker.id, worker.url if url else None)).encode("latin-1", "replace")


@functools.lru_cache(maxsize=1024)
def _worker_lines(worker_id: str, url: str | None) -> str:
    lines = f"{WORKER_ID_HEADER}: {worker_id}\r\n"
    return lines if url is None else f"{lines}{ROUTED_WORKER_HEADER}: {url}\r\n"
