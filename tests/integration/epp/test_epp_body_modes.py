"""Every request body mode a gateway may choose gives the same answers, and the body reaches the worker intact
(a body larger than one streamed answer, 62,000 bytes, in full duplex too)."""

from __future__ import annotations

import json
import urllib.request

import pytest
from conftest import ALIAS, Gateway, post
from support.procs import MODEL, Sim

MODES = ["BUFFERED", "STREAMED", "FULL_DUPLEX_STREAMED"]


def _direct(sim_url: str, body: bytes) -> int:
    """The prompt tokens the worker counts for ``body`` sent to it directly."""
    status, answer, _ = post(sim_url + "/v1/completions", body)
    assert status == 200, answer
    return int(answer["usage"]["prompt_tokens"])


@pytest.mark.parametrize("mode", MODES)
def test_every_request_body_mode_answers_and_bodies_arrive_intact(
    gateway: Gateway, fleet: list[Sim], mode: str
) -> None:
    envoy = gateway(request_body_mode=mode)
    small = {"model": MODEL, "prompt": f"small body in {mode}", "max_tokens": 3}
    status, answer, _ = post(envoy.url + "/v1/completions", small)
    assert status == 200, answer
    assert answer["choices"][0]["text"]
    words = " ".join(f"w{i}" for i in range(30_000))  # ~200 KB: several 62,000-byte chunks each way
    large = json.dumps({"model": MODEL, "prompt": words, "max_tokens": 2}).encode()
    assert len(large) > 3 * 62_000
    status, answer, headers = post(envoy.url + "/v1/completions", large)
    assert status == 200, answer
    served = next(s for s in fleet if f"{s.host}:{s.port}" == headers["x-smg-sim-worker"])
    assert answer["usage"]["prompt_tokens"] == _direct(served.url, large)  # the same prompt, token for token
    aliased = json.dumps({"model": ALIAS, "prompt": words, "max_tokens": 2}).encode()
    status, answer, headers = post(envoy.url + "/v1/completions", aliased)  # rewritten by the picker: a new length
    assert status == 200, answer
    served = next(s for s in fleet if f"{s.host}:{s.port}" == headers["x-smg-sim-worker"])
    assert answer["usage"]["prompt_tokens"] == _direct(served.url, large)


def test_response_bodies_in_full_duplex_are_echoed_untouched(gateway: Gateway) -> None:
    envoy = gateway(response_body_mode="FULL_DUPLEX_STREAMED")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "echo"}], "max_tokens": 50, "stream": True}
    req = urllib.request.Request(
        envoy.url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        events = [line.strip() for line in resp if line.strip()]
    assert events[-1] == b"data: [DONE]"
    assert len(events) >= 51
    status, answer, _ = post(envoy.url + "/v1/completions", {"model": MODEL, "prompt": "plain", "max_tokens": 3})
    assert status == 200 and answer["choices"][0]["text"]
