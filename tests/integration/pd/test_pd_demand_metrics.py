"""The demand gauges of a PD router: one series per role (prefill, decode), each over its own engines' slots."""

from __future__ import annotations

import asyncio
import math
import uuid
from pathlib import Path

from support.load import flood
from support.pd import register_pd, start_decode, start_prefill
from support.procs import MODEL, Router, start_router, wait_until

SLOTS = 2
FLOOD = 3
CHARS_PER_TOKEN = 3.0  # the router's default --tree-chars-per-token


def _gauge(router: Router, name: str, **labels: str) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in router.metrics().splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.rpartition(" ")[2])
    return None


async def _wait(router: Router, name: str, value: float, **labels: str) -> None:
    await asyncio.to_thread(
        wait_until,
        lambda: _gauge(router, name, **labels) == value,
        timeout=20,
        what=f"{name}{labels} == {value} (last {_gauge(router, name, **labels)})",
    )


async def test_pd_demand_is_counted_per_role(logs: Path) -> None:
    slots = ["--max-running", str(SLOTS)]
    prefill = start_prefill(logs, time_scale=1.0, extra=slots)
    decode = start_decode(logs, time_scale=1.0, extra=slots)
    router = start_router(logs, args=["--pd-disaggregation"], admin_key="pd-key")
    try:
        register_pd(router, [prefill], [decode])
        router.wait_routable(2)
        for role in ("prefill", "decode"):
            await _wait(router, "smg_model_saturation", 0.0, model=MODEL, role=role)
            assert _gauge(router, "smg_model_workers", model=MODEL, role=role, state="routable") == 1
        assert _gauge(router, "smg_model_requests_inflight", model=MODEL, role="regular") is None

        prompt = f"{uuid.uuid4()} a long prompt to prefill " * 12
        tokens = sum(math.ceil(len(f"{i}: {prompt}") / CHARS_PER_TOKEN) for i in range(FLOOD))
        async with flood(router.url, FLOOD, prompt=prompt, distinct=True):
            for role in ("prefill", "decode"):  # each request holds one attempt at each role until it ends
                await _wait(router, "smg_model_requests_inflight", FLOOD, model=MODEL, role=role)
                assert _gauge(router, "smg_model_prompt_tokens_inflight", model=MODEL, role=role) == tokens
            # the decode engine runs 2 and holds 1: 3 over its 2 slots
            await _wait(router, "smg_model_saturation", FLOOD / SLOTS, model=MODEL, role="decode")
            assert (_gauge(router, "smg_model_saturation", model=MODEL, role="prefill") or 0) > 0
        for role in ("prefill", "decode"):
            await _wait(router, "smg_model_requests_inflight", 0, model=MODEL, role=role)
            await _wait(router, "smg_model_saturation", 0.0, model=MODEL, role=role)
    finally:
        router.stop()
        prefill[0].stop()
        decode.stop()
