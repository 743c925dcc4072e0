"""One Envoy ext_proc stream (one HTTP request at the gateway), as a state machine: messages in, answers out.

Envoy sends the request's headers, its body (whole, in chunks, or not at all: the request body mode), then the
response's headers (and its body and trailers when asked); every message but a full-duplex body chunk wants one
answer, in order.  Synchronous: the pick never waits (``pick``), so the server's coroutine only relays.

The pick needs the body (the model, the prompt), and the destination goes in a request header, so the answer that
carries it depends on the request body mode (``protocol_config``, which Envoy sends with the first message):

- no body (headers with end of stream): picked at once; the headers' answer carries it.
- ``BUFFERED``: the headers' answer is "continue"; the body comes whole, and its answer carries the header (Envoy
  still holds the headers then).
- ``STREAMED`` (with ``send_body_without_waiting_for_header_response``): the headers' answer is held until the body's
  end, then sent with the destination, then one "continue" per chunk.  Without that setting Envoy would wait for the
  headers' answer before sending any body: refused with a 500 naming the setting.
- ``FULL_DUPLEX_STREAMED`` (the protocol's own, and what is assumed when Envoy does not say): the headers' answer is
  held until the body's end (or its trailers), then the body is sent back in chunks of at most ``CHUNK`` bytes.
- ``NONE``: the body never comes; routed as a request without body (by load, among the one model's workers).

A request the router refuses gets an immediate response (the router's JSON error): 400, 404 unknown model, 413 over
the body cap, 429 over the admission limits (the protocol's shedding), 501 in PD mode, 503 no endpoint (or none in the
subset hint).  The response's headers say which endpoint served (``x-gateway-destination-endpoint-served``, in the
``envoy.lb`` metadata or as a header) and the status, the attempt's outcome; response bodies are answered untouched
(echoed in full duplex), never read.  ``close`` (the stream ended: the request is over at the gateway) closes the
attempt's guard and counts the request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from smg_router.epp.pick import Pick, Picker
from smg_router.errors import Overloaded, RouterError

log = logging.getLogger(__name__)

DESTINATION = "x-gateway-destination-endpoint"
"""The request header, and the key in the ``envoy.lb`` metadata, naming the endpoints picked."""
DESTINATION_NAMESPACE = "envoy.lb"
SERVED = "x-gateway-destination-endpoint-served"
"""Where the gateway says which endpoint served: a key of the ``envoy.lb`` metadata, or a response header."""
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET = "x-gateway-destination-endpoint-subset"
"""The subset hint: endpoints the pick must choose among (a list, or a comma-separated string)."""
CHUNK = 62_000
"""Most bytes of one streamed body answer (Envoy's limit on a gRPC message is 64 KiB by default)."""

_BodyMode = ProcessingMode.BodySendMode
NONE, STREAMED, BUFFERED, FULL_DUPLEX = (
    _BodyMode.NONE,
    _BodyMode.STREAMED,
    _BodyMode.BUFFERED,
    _BodyMode.FULL_DUPLEX_STREAMED,
)


# the answers that change nothing, built once (never mutated: each is serialized as it is, per answer)
_REQUEST_HEADERS_CONTINUE = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
_REQUEST_BODY_CONTINUE = pb.ProcessingResponse(request_body=pb.BodyResponse())
_REQUEST_TRAILERS_CONTINUE = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
_RESPONSE_HEADERS_CONTINUE = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
_RESPONSE_BODY_CONTINUE = pb.ProcessingResponse(response_body=pb.BodyResponse())
_RESPONSE_TRAILERS_CONTINUE = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def immediate(error: RouterError) -> pb.ProcessingResponse:
    """The router's JSON error as the gateway's answer; the router's overload (a 503 on its HTTP face) is the
    protocol's shedding, a 429."""
    status = 429 if isinstance(error, Overloaded) else error.status
    response = error.response()
    headers = [
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"))
    ]
    if isinstance(error, Overloaded):
        headers.append(
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key="retry-after", raw_value=str(error.retry_after).encode())
            )
        )
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=headers),
            body=response.body,
            details=f"smg_epp_{error.code}",
        )
    )


def _subset(metadata: pb.ProcessingRequest) -> list[str] | None:
    """The endpoints of the subset hint (None: no hint)."""
    namespace = metadata.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET not in namespace.fields:
        return None
    value = namespace.fields[SUBSET]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value.strip() for v in value.list_value.values if v.string_value.strip()]
    if kind == "string_value":
        return [e.strip() for e in value.string_value.split(",") if e.strip()]
    return []


def _headers(headers: pb.HttpHeaders) -> dict[str, str]:
    """Envoy's headers as a dict of lowercase names (the first of repeated ones); values come as raw bytes."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        out.setdefault(h.key.lower(), h.raw_value.decode("latin-1") if h.raw_value else h.value)
    return out


def _metadata(value: str) -> struct_pb2.Struct:
    """The ``envoy.lb`` dynamic metadata naming the endpoints (built field by field: ``Struct.update`` is slow)."""
    inner = struct_pb2.Struct()
    inner.fields[DESTINATION].string_value = value
    metadata = struct_pb2.Struct()
    metadata.fields[DESTINATION_NAMESPACE].struct_value.CopyFrom(inner)
    return metadata


def _set(headers: Mapping[str, str]) -> pb.HeaderMutation:
    return pb.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
                append_action=_OVERWRITE,
            )
            for k, v in headers.items()
        ]
    )


def streamed(body: bytes, *, request: bool, end: bool) -> list[pb.ProcessingResponse]:
    """``body`` sent back in full duplex, in chunks of at most ``CHUNK`` bytes; ``end``: the last one ends the body."""
    pieces = [body[i : i + CHUNK] for i in range(0, len(body), CHUNK)] or [b""]
    out = []
    for i, piece in enumerate(pieces):
        mutation = pb.BodyMutation(
            streamed_response=pb.StreamedBodyResponse(body=piece, end_of_stream=end and i == len(pieces) - 1)
        )
        answer = pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))
        out.append(
            pb.ProcessingResponse(request_body=answer) if request else pb.ProcessingResponse(response_body=answer)
        )
    return out


class ExtProcStream:
    """The state of one ext_proc stream (module docstring).  ``on_message`` per message, ``close`` once at its end."""

    __slots__ = (
        "_admitted",
        "_chunks",
        "_complete",
        "_headers",
        "_outcome",
        "_owed",
        "_path",
        "_picker",
        "_request_mode",
        "_response_mode",
        "_send_without_waiting",
        "_served",
        "_size",
        "_status",
        "_subset",
        "done",
        "pick",
    )

    def __init__(self, *, picker: Picker) -> None:
        self._picker = picker
        self._headers: dict[str, str] = {}
        self._path = "/"
        self._subset: list[str] | None = None
        self._chunks: list[bytes] = []
        self._size = 0
        self._owed = 0
        """Body chunks whose answers wait for the pick (``STREAMED``)."""
        self._complete = False
        self._request_mode: int = FULL_DUPLEX  # the protocol's; Envoy's first message says which it is
        self._response_mode: int = FULL_DUPLEX
        self._send_without_waiting = False
        self._admitted = False
        self._status: int | None = None
        self._served = False
        self._outcome = "abandoned"
        self.done = False
        """An immediate response was sent: Envoy ends the stream, nothing else is answered."""
        self.pick: Pick | None = None

    def on_message(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """The answers the message calls for, in order (none while a pick waits for the body)."""
        if self.done:
            return []
        if msg.HasField("protocol_config"):
            config = msg.protocol_config
            self._request_mode = config.request_body_mode
            self._response_mode = config.response_body_mode
            self._send_without_waiting = config.send_body_without_waiting_for_header_response
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            return self._on_request_headers(msg)
        if kind == "request_body":
            return self._on_request_body(msg.request_body)
        if kind == "request_trailers":
            answers = [] if self._complete else self._finish(trailers=True)
            if self._outcome == "rejected":  # an immediate response: the last answer
                return answers
            return [*answers, _REQUEST_TRAILERS_CONTINUE]
        if kind == "response_headers":
            self._on_response_headers(msg)
            return [_RESPONSE_HEADERS_CONTINUE]
        if kind == "response_body":
            body = msg.response_body
            if self._response_mode == FULL_DUPLEX:
                return streamed(body.body, request=False, end=body.end_of_stream)
            return [_RESPONSE_BODY_CONTINUE]
        if kind == "response_trailers":
            return [_RESPONSE_TRAILERS_CONTINUE]
        return []

    def _reject(self, error: RouterError) -> list[pb.ProcessingResponse]:
        self.done = True
        self._outcome = "rejected"
        if error.status >= 500:
            log.warning("epp %s -> %d %s", self._path, error.status, error.message)
        return [immediate(error)]

    def _on_request_headers(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self._headers = _headers(msg.request_headers)
        self._path = self._headers.get(":path", "/")
        self._subset = _subset(msg)
        length = self._headers.get("content-length", "")
        try:
            self._picker.admit(int(length) if length.isdigit() else None)
        except RouterError as e:
            return self._reject(e)
        self._admitted = True
        if msg.request_headers.end_of_stream:
            return self._finish(trailers=False)
        mode = self._request_mode
        if mode == BUFFERED:
            return [_REQUEST_HEADERS_CONTINUE]
        if mode == NONE:
            self._request_mode = FULL_DUPLEX  # the body is not ours to answer: picked as a request without one
            return self._finish(trailers=False, body=None)
        if mode not in (FULL_DUPLEX, STREAMED) or (mode == STREAMED and not self._send_without_waiting):
            name = _BodyMode.Name(mode)
            return self._reject(
                RouterError(
                    f"the endpoint picker cannot read a request body sent in mode {name}"
                    + (" without send_body_without_waiting_for_header_response" if mode == STREAMED else "")
                    + ": use FULL_DUPLEX_STREAMED (or BUFFERED) in the gateway's ext_proc processing_mode",
                    code="unsupported_body_mode",
                )
            )
        return []  # the headers' answer waits for the body

    def _on_request_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self._complete:
            return []
        self._chunks.append(body.body)
        self._size += len(body.body)
        if self._request_mode == STREAMED:
            self._owed += 1
        if self._size > self._picker.max_body:
            self._picker.metrics.requests_rejected.labels("payload_too_large").inc()
            return self._reject(
                RouterError(
                    f"request body of more than {self._picker.max_body} bytes exceeds the limit",
                    code="payload_too_large",
                    status=413,
                )
            )
        if body.end_of_stream:
            return self._finish(trailers=False)
        return []

    def _finish(self, *, trailers: bool, body: bytes | None = b"") -> list[pb.ProcessingResponse]:
        """The request's body is whole (``trailers``: its trailers came): pick, and the answers that were waiting."""
        self._complete = True
        raw = b"".join(self._chunks) if self._chunks else body
        try:
            pick = self.pick = self._picker.pick(path=self._path, headers=self._headers, body=raw, subset=self._subset)
        except RouterError as e:
            return self._reject(e)
        self._outcome = "routed"
        sent = pick.req.raw if raw is not None else None
        changed = sent is not None and sent is not raw  # a model alias: the body forwarded names the served model
        header = {DESTINATION: pick.value}
        metadata = _metadata(pick.value)
        if changed and sent is not None:  # Envoy refuses a body whose length the head contradicts
            header["content-length"] = str(len(sent))
        mode = self._request_mode
        if mode == BUFFERED and raw is not None and self._chunks:
            mutation = pb.BodyMutation(body=sent) if changed else None
            common = pb.CommonResponse(header_mutation=_set(header), clear_route_cache=True, body_mutation=mutation)
            return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata)]
        common = pb.CommonResponse(header_mutation=_set(header), clear_route_cache=True)
        answers = [
            pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata)
        ]
        if not self._chunks:
            return answers
        if mode == STREAMED:
            for i in range(self._owed):
                if not changed:
                    answers.append(_REQUEST_BODY_CONTINUE)
                    continue
                mutation = pb.BodyMutation(body=sent) if i == 0 else pb.BodyMutation(clear_body=True)
                answers.append(
                    pb.ProcessingResponse(
                        request_body=pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))
                    )
                )
            return answers
        return answers + streamed(sent or b"", request=True, end=not trailers)

    def _on_response_headers(self, msg: pb.ProcessingRequest) -> None:
        headers = _headers(msg.response_headers)
        status = headers.get(":status", "")
        self._status = int(status) if status.isdigit() else None
        pick = self.pick
        if pick is None or self._served:
            return
        served = ""
        namespace = msg.metadata_context.filter_metadata.get(DESTINATION_NAMESPACE)
        if namespace is not None and SERVED in namespace.fields:
            served = namespace.fields[SERVED].string_value
        served = (served or headers.get(SERVED, "")).strip()
        if not served:
            return
        self._served = True
        kind, worker = self._picker.served_by(pick, served)
        self._picker.metrics.epp_served.labels(kind).inc()
        if worker is not None and worker is not pick.guard.worker:
            self._picker.moved(pick, worker)

    def close(self) -> None:
        """The stream is over (the gateway's request ended, or the stream broke): the attempt closes, the request is
        counted.  Idempotent."""
        picker = self._picker
        m = picker.metrics
        if (pick := self.pick) is not None:
            self.pick = None
            guard = pick.guard
            if self._status is not None:
                guard.answered(self._status)
            guard.close()
            if not self._served:
                m.epp_served.labels("unreported").inc()
            req = pick.req
            m.requests.labels(req.endpoint, req.model, str(self._status or 499)).inc()
            m.request_seconds.labels(req.endpoint, req.model).observe(time.perf_counter() - req.started)
        if self._admitted:
            self._admitted = False
            picker.leave()
        if self._outcome:
            m.epp_streams.labels(self._outcome).inc()
            self._outcome = ""

    def failed(self) -> None:
        """The stream broke on a message the picker could not follow (counted ``error``, then closed)."""
        self._outcome = "error"
        self.close()
