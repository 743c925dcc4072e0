"""The ext_proc stream state machine (``epp.stream``) fed Envoy's messages as protobufs, over a real routing core
(``RouterCore``: policies, attempts, admission) with workers registered and ready, no network."""

from __future__ import annotations

import json
from dataclasses import replace

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from smg_router.core import RouterCore
from smg_router.epp.pick import Picker
from smg_router.epp.stream import CHUNK, DESTINATION, SERVED, ExtProcStream
from smg_router.settings import ServerSettings, Settings
from smg_router.workers.worker import WorkerSpec, WorkerStatus

URLS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]
Mode = ProcessingMode.BodySendMode


def _core(**server: int) -> tuple[RouterCore, Picker]:
    settings = Settings(model_id="m")
    if server:
        settings = replace(settings, server=replace(ServerSettings(), **server))
    core = RouterCore(settings)
    for url in URLS:
        worker, _ = core.fleet.lifecycle.add(WorkerSpec.from_json({"url": url, "model_id": "m"}))
        worker.status = WorkerStatus.READY
    picker = Picker(
        proxy=core.proxy,
        admission=core.admission,
        registry=core.registry,
        loads=core.loads,
        metrics=core.metrics,
        forward_headers=core.forward_headers,
        fallbacks=0,
    )
    return core, picker


def _headers(
    path: str = "/v1/completions", *, eos: bool = False, mode: int | None = None, subset: object = None, **extra: str
) -> pb.ProcessingRequest:
    pairs = {":method": "POST", ":path": path, "content-type": "application/json", **extra}
    msg = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
            ),
            end_of_stream=eos,
        )
    )
    if mode is not None:
        msg.protocol_config.request_body_mode = mode
        msg.protocol_config.response_body_mode = Mode.NONE
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        msg.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return msg


def _body(data: bytes, *, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))


def _response(status: int, **extra: str) -> pb.ProcessingRequest:
    pairs = {":status": str(status), **extra}
    return pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
            )
        )
    )


def _destination(answer: pb.ProcessingResponse) -> str:
    common = getattr(answer, answer.WhichOneof("response")).response
    (value,) = [h.header.raw_value.decode() for h in common.header_mutation.set_headers if h.header.key == DESTINATION]
    assert common.clear_route_cache
    assert answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION].string_value == value
    return value


def _error(answer: pb.ProcessingResponse) -> tuple[int, dict[str, dict[str, str]]]:
    assert answer.WhichOneof("response") == "immediate_response"
    return answer.immediate_response.status.code, json.loads(answer.immediate_response.body)


BODY = json.dumps({"model": "m", "prompt": "p" * 150_000, "max_tokens": 1}).encode()


def test_full_duplex_holds_the_headers_answer_until_the_body_ends_then_echoes_it_in_chunks() -> None:
    core, picker = _core()
    stream = ExtProcStream(picker=picker)
    assert stream.on_message(_headers(mode=Mode.FULL_DUPLEX_STREAMED)) == []
    half = len(BODY) // 2
    assert stream.on_message(_body(BODY[:half], eos=False)) == []
    answers = stream.on_message(_body(BODY[half:], eos=True))
    assert answers[0].WhichOneof("response") == "request_headers"
    endpoint = _destination(answers[0])
    assert endpoint in {u.removeprefix("http://") for u in URLS}
    pieces = [a.request_body.response.body_mutation.streamed_response for a in answers[1:]]
    assert all(len(p.body) <= CHUNK for p in pieces) and len(pieces) == -(-len(BODY) // CHUNK)
    assert b"".join(p.body for p in pieces) == BODY
    assert [p.end_of_stream for p in pieces] == [False] * (len(pieces) - 1) + [True]
    worker = core.registry.by_url("http://" + endpoint)
    assert worker is not None and worker.inflight == 1  # from the pick ...
    assert stream.on_message(_response(200))[0].WhichOneof("response") == "response_headers"
    stream.close()
    assert worker.inflight == 0  # ... to the stream's end
    assert core.metrics.requests.labels("/v1/completions", "m", "200").value == 1


def test_buffered_mode_continues_the_headers_and_answers_the_body_with_the_destination() -> None:
    _, picker = _core()
    stream = ExtProcStream(picker=picker)
    (first,) = stream.on_message(_headers(mode=Mode.BUFFERED))
    assert first.WhichOneof("response") == "request_headers"
    assert not first.request_headers.response.header_mutation.set_headers
    (answer,) = stream.on_message(_body(BODY, eos=True))
    assert answer.WhichOneof("response") == "request_body"
    assert _destination(answer)
    stream.close()


def test_streamed_mode_without_sending_bodies_first_is_refused_by_name() -> None:
    _, picker = _core()
    stream = ExtProcStream(picker=picker)
    (answer,) = stream.on_message(_headers(mode=Mode.STREAMED))
    status, error = _error(answer)
    assert status == 500 and "send_body_without_waiting_for_header_response" in error["error"]["message"]
    stream.close()


def test_subset_hint_as_a_list_or_a_string_restricts_the_choice_and_an_empty_one_is_a_503() -> None:
    _, picker = _core()
    for subset in (["10.0.0.3:8000"], "10.0.0.3:8000, 10.0.0.9:1"):
        for _ in range(3):
            stream = ExtProcStream(picker=picker)
            stream.on_message(_headers(mode=Mode.BUFFERED, subset=subset))
            (answer,) = stream.on_message(_body(BODY, eos=True))
            assert _destination(answer) == "10.0.0.3:8000"
            stream.close()
    for subset in ([], "10.0.0.9:1"):
        stream = ExtProcStream(picker=picker)
        stream.on_message(_headers(mode=Mode.BUFFERED, subset=subset))
        status, error = _error(stream.on_message(_body(BODY, eos=True))[0])
        assert status == 503 and error["error"]["type"] == "service_unavailable"
        stream.close()


def test_served_endpoint_elsewhere_moves_the_in_flight_count() -> None:
    core, picker = _core()
    stream = ExtProcStream(picker=picker)
    stream.on_message(_headers(mode=Mode.BUFFERED, subset=["10.0.0.1:8000"]))
    stream.on_message(_body(BODY, eos=True))
    chosen, other = core.registry.by_url(URLS[0]), core.registry.by_url(URLS[1])
    assert chosen is not None and other is not None and chosen.inflight == 1
    stream.on_message(_response(200, **{SERVED: "10.0.0.2:8000"}))
    assert (chosen.inflight, other.inflight) == (0, 1)
    stream.close()
    assert (chosen.inflight, other.inflight) == (0, 0)
    assert core.metrics.epp_served.labels("elsewhere").value == 1


def test_refusals_are_the_routers_json_errors_and_overload_is_a_429() -> None:
    core, picker = _core(max_concurrent_requests=1)
    stream = ExtProcStream(picker=picker)
    stream.on_message(_headers(mode=Mode.BUFFERED))
    status, error = _error(stream.on_message(_body(b'{"model": "nope", "prompt": "x"}', eos=True))[0])
    assert status == 404 and error["error"]["code"] == "model_not_found"
    stream.close()
    held = ExtProcStream(picker=picker)
    held.on_message(_headers(mode=Mode.BUFFERED))  # admitted: the one slot
    shed = ExtProcStream(picker=picker)
    (answer,) = shed.on_message(_headers(mode=Mode.BUFFERED))
    status, error = _error(answer)
    assert status == 429 and error["error"]["code"] == "overloaded"
    assert [(h.header.key, h.header.raw_value) for h in answer.immediate_response.headers.set_headers][-1] == (
        "retry-after",
        b"1",
    )
    shed.close()
    held.close()
    assert len(core.admission) == 0
    assert core.metrics.epp_streams.labels("rejected").value == 2
    assert core.metrics.epp_streams.labels("abandoned").value == 1


def test_response_body_chunks_in_full_duplex_come_back_untouched() -> None:
    _, picker = _core()
    stream = ExtProcStream(picker=picker)
    stream.on_message(_headers(eos=True, path="/v1/models"))  # no body: routed at once, by load
    chunk = pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: 1\n\n", end_of_stream=False))
    (answer,) = stream.on_message(chunk)
    echoed = answer.response_body.response.body_mutation.streamed_response
    assert (echoed.body, echoed.end_of_stream) == (b"data: 1\n\n", False)
    stream.close()


def test_a_path_the_router_does_not_forward_is_counted_as_other() -> None:
    core, picker = _core()
    for path in ("/v1/models", "/anything/a-client/chose?x=1"):
        stream = ExtProcStream(picker=picker)
        (answer,) = stream.on_message(_headers(eos=True, path=path))
        assert _destination(answer)
        stream.on_message(_response(200))
        stream.close()
    assert core.metrics.requests.labels("other", "m", "200").value == 2


def test_served_endpoint_in_the_envoy_lb_metadata_is_read_too() -> None:
    core, picker = _core()
    stream = ExtProcStream(picker=picker)
    stream.on_message(_headers(mode=Mode.BUFFERED, subset=["10.0.0.1:8000"]))
    stream.on_message(_body(BODY, eos=True))
    response = _response(200)
    served = struct_pb2.Struct()
    served.update({SERVED: "10.0.0.3:8000"})
    response.metadata_context.filter_metadata["envoy.lb"].CopyFrom(served)
    stream.on_message(response)
    other = core.registry.by_url(URLS[2])
    assert other is not None and other.inflight == 1
    stream.close()
    assert other.inflight == 0


async def test_health_follows_the_routers_readiness() -> None:
    from grpc_health.v1 import health_pb2
    from smg_router.epp.server import EXT_PROC_SERVICE, Health

    core, _ = _core()
    health = Health(core)

    async def status(service: str) -> int:
        answer = await health.Check(health_pb2.HealthCheckRequest(service=service), None)
        return int(answer.status)

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert [await status(s) for s in ("liveness", "readiness", EXT_PROC_SERVICE)] == [serving] * 3
    core.shutting_down = True  # SIGTERM: not ready at once, still alive
    assert [await status(s) for s in ("liveness", "readiness", EXT_PROC_SERVICE)] == [serving, not_serving, not_serving]
