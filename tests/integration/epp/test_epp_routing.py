"""Routing through a real Envoy by the router's own policy: prefixes stay on one worker, the subset hint restricts the
choice, SSE streams come whole, the served endpoint moves the accounting."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

from conftest import Gateway, post, sim_requests, wait_metric
from support.envoy import SUBSET_HEADER
from support.procs import MODEL, Router, Sim, metric_value

PREFIX = "You are a careful assistant. Answer briefly and cite the manual. " * 8


def _endpoint(sim: Sim) -> str:
    return f"{sim.host}:{sim.port}"


def test_requests_sharing_a_prefix_land_on_one_sim(gateway: Gateway, fleet: list[Sim], picker: Router) -> None:
    envoy = gateway()
    before = sim_requests(fleet)
    for i in range(20):
        status, body, _ = post(
            envoy.url + "/v1/completions", {"model": MODEL, "prompt": f"{PREFIX}q{i}", "max_tokens": 2}
        )
        assert status == 200, body
    got = [a - b for a, b in zip(sim_requests(fleet), before, strict=True)]
    assert sorted(got) == [0, 0, 20], got  # counted by the sims themselves
    assert metric_value(picker.metrics(), "smg_cache_tree_hits_total") >= 19  # the policy's tree, as on the HTTP path


def test_subset_hint_restricts_the_choice_to_the_endpoints_it_names(gateway: Gateway, fleet: list[Sim]) -> None:
    envoy = gateway(subset_header=True)
    prompt = {"model": MODEL, "prompt": PREFIX + "subset", "max_tokens": 2}
    status, _, headers = post(envoy.url + "/v1/completions", prompt)
    assert status == 200
    favourite = headers["x-smg-sim-worker"]
    others = [s for s in fleet if _endpoint(s) != favourite]
    for _ in range(4):  # the tree prefers the favourite; the hint leaves it out
        status, body, headers = post(
            envoy.url + "/v1/completions", prompt, headers={SUBSET_HEADER: f"{_endpoint(others[0])}"}
        )
        assert status == 200, body
        assert headers["x-smg-sim-worker"] == _endpoint(others[0])
    hint = ",".join(_endpoint(s) for s in others)
    status, _, headers = post(envoy.url + "/v1/completions", prompt, headers={SUBSET_HEADER: hint})
    assert status == 200 and headers["x-smg-sim-worker"] in hint.split(",")


def test_subset_hint_without_an_eligible_endpoint_is_a_503(gateway: Gateway) -> None:
    envoy = gateway(subset_header=True)
    status, body, _ = post(
        envoy.url + "/v1/completions",
        {"model": MODEL, "prompt": "x", "max_tokens": 1},
        headers={SUBSET_HEADER: "127.0.0.254:1"},
    )
    assert status == 503, body
    assert body["error"]["code"] == "no_available_workers"
    assert "subset hint" in body["error"]["message"]


def _stream(url: str, events: list[bytes], done: threading.Event) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "stream please"}],
        "max_tokens": 400,
        "stream": True,
    }
    req = urllib.request.Request(
        url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        for line in resp:
            if line.strip():
                events.append(line.strip())
    done.set()


def test_sse_stream_arrives_whole_and_counts_in_flight_until_its_end(
    gateway: Gateway, picker: Router, fleet: list[Sim]
) -> None:
    envoy = gateway()
    events: list[bytes] = []
    done = threading.Event()
    thread = threading.Thread(target=_stream, args=(envoy.url, events, done))
    thread.start()
    seen_inflight = []
    while not done.is_set():  # the ext_proc stream lasts as long as the HTTP response: so does the attempt
        if events:
            seen_inflight.append(metric_value(picker.metrics(), "smg_worker_inflight"))
        time.sleep(0.02)
    thread.join()
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) >= 300
    assert seen_inflight and seen_inflight.count(1.0) >= len(seen_inflight) - 1, (
        seen_inflight
    )  # the last may see the end
    wait_metric(picker, "smg_worker_inflight", 0.0)


def test_served_endpoint_reported_by_the_gateway_moves_the_accounting(
    gateway: Gateway, picker: Router, fleet: list[Sim]
) -> None:
    chosen, elsewhere = fleet[1], fleet[0]
    # the subset hint makes the pick ``chosen``; the gateway says ``elsewhere`` served (as after going down a list)
    envoy = gateway(served_override=_endpoint(elsewhere), subset_header=True)
    before = metric_value(picker.metrics(), "smg_epp_served_total", kind="elsewhere")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "moved"}], "max_tokens": 400, "stream": True}
    req = urllib.request.Request(
        envoy.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", SUBSET_HEADER: _endpoint(chosen)},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.headers["x-gateway-destination-endpoint-served"] == _endpoint(elsewhere)
        resp.readline()
        text = picker.metrics()  # mid-stream: the attempt is counted on the worker the gateway names
        assert metric_value(text, "smg_worker_inflight", worker=elsewhere.url) == 1
        assert metric_value(text, "smg_worker_inflight", worker=chosen.url) == 0
        assert resp.read().rstrip().endswith(b"data: [DONE]")
    wait_metric(picker, "smg_epp_served_total", before + 1, kind="elsewhere")
    wait_metric(picker, "smg_worker_inflight", 0.0)


def test_health_service_answers_serving_on_both_ports(picker: Router) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    for port in (picker.epp_health_port, picker.epp_port):
        with grpc.insecure_channel(f"{picker.host}:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor", ""):
                answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING, (port, service)
            try:
                stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.NOT_FOUND
            else:
                raise AssertionError("an unknown service must be NOT_FOUND")


def test_unknown_model_is_the_routers_404(gateway: Gateway, picker: Router, logs: Path) -> None:
    envoy = gateway()
    status, body, _ = post(
        envoy.url + "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}
    )
    assert status == 404
    assert body["error"]["code"] == "model_not_found"
    status, body, _ = post(envoy.url + "/v1/chat/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
