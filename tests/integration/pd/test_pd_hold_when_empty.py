"""Scale from zero in PD mode: a request waits until its model has a routable prefill AND a routable decode worker,
and the queue depth counts it under each role it still awaits."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.pd import register_pd
from support.procs import MODEL, Router, Sim, http_json, metric_value, start_router, wait_until


@pytest.fixture
def holding_pd(logs: Path) -> Iterator[Router]:
    r = start_router(logs, args=["--pd-disaggregation", "--hold-when-empty", "20"], admin_key="pd-key")
    yield r
    r.stop()


def _waiting(router: Router, role: str) -> float:
    return metric_value(router.metrics(), "smg_model_requests_waiting", model=MODEL, role=role)


def test_a_pd_request_is_held_until_both_roles_are_routable(
    holding_pd: Router, pd_fleet: tuple[list[tuple[Sim, int]], list[Sim]]
) -> None:
    prefills, decodes = pd_fleet
    status, body = holding_pd.admin("PUT", f"/models/{MODEL}", {"role": "decode"})
    assert status == 201, body
    answer: dict[str, object] = {}

    def call() -> None:
        answer["status"], answer["body"] = http_json(
            "POST", holding_pd.url + "/v1/completions", {"model": MODEL, "prompt": "cold", "max_tokens": 1}, timeout=30
        )

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    wait_until(lambda: _waiting(holding_pd, "prefill") == _waiting(holding_pd, "decode") == 1, what="held for both")
    register_pd(holding_pd, [], decodes[:1])
    wait_until(lambda: _waiting(holding_pd, "decode") == 0, what="no longer awaiting a decode worker")
    time.sleep(0.5)
    assert thread.is_alive() and _waiting(holding_pd, "prefill") == 1, "still held: no prefill worker"
    register_pd(holding_pd, prefills[:1], [])
    thread.join(30)
    assert answer.get("status") == 200, answer
    assert _waiting(holding_pd, "prefill") == 0
    assert metric_value(holding_pd.metrics(), "smg_model_holds_total", model=MODEL, outcome="sent") == 1
