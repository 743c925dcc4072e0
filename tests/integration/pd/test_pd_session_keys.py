"""Session keys in PD mode: the same pinning step before the prefill and the decode slot's policies, so one key
keeps one prefill and one decode worker while other keys use both of each."""

from __future__ import annotations

import uuid

import openai
from support.pd import register_pd
from support.procs import MODEL, Router, metric_value


def _processed(router: Router, role: str) -> dict[str, int]:
    return {w["url"]: w["load"]["processed"] for w in router.workers() if w["role"] == role}


def test_a_session_key_pins_one_prefill_and_one_decode_worker(pd_router: Router, pd_fleet) -> None:
    prefills, decodes = pd_fleet
    register_pd(pd_router, prefills, decodes)
    pd_router.wait_routable(4)
    client = openai.OpenAI(base_url=pd_router.url + "/v1", api_key="none", max_retries=0)

    def chat(key: str) -> str:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            max_tokens=2,
            messages=[{"role": "user", "content": f"a new question {uuid.uuid4()}"}],
            extra_headers={"x-smg-routing-key": key},
        )
        assert raw.parse().choices[0].message.content
        return raw.headers["x-smg-routed-worker-id"]

    assert len({chat("one session") for _ in range(10)}) == 1  # the decode worker that answered
    assert sorted(_processed(pd_router, "prefill").values()) == [0, 10]
    assert sorted(_processed(pd_router, "decode").values()) == [0, 10]
    for k in range(16):  # 16 keys on 2 workers of each role all on one: 1 in 2^15
        chat(f"key {k}")
    assert all(v > 0 for v in _processed(pd_router, "prefill").values())
    assert all(v > 0 for v in _processed(pd_router, "decode").values())
    text = pd_router.metrics()
    for role in ("prefill", "decode"):
        assert metric_value(text, "smg_routing_decisions_total", model=MODEL, role=role, branch="session") == 26
    assert metric_value(text, "smg_pd_requests_total", status="success") == 26
