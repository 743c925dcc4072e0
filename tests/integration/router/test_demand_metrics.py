"""The demand gauges per model and role against a real router and smg-sim engines of known slots: they rise with the
load driven through the router and fall when it ends, in one process and with ``--processes 2``."""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from support.load import flood
from support.procs import MODEL, Router, Sim, metric_value, start_router, start_sim, wait_until

SLOTS = 2
"""Running slots of each engine (``--max-running``; smg-sim reports them as ``max_running_requests``)."""
FLOOD = 6
CHARS_PER_TOKEN = 3.0  # the router's default --tree-chars-per-token


@pytest.fixture
def engines(logs: Path) -> Iterator[list[Sim]]:
    sims = [start_sim(logs, time_scale=1.0, extra=["--max-running", str(SLOTS)]) for _ in range(2)]
    yield sims
    for s in sims:
        s.stop()


def _gauge(router: Router, name: str, **labels: str) -> float | None:
    """The sample of ``name`` with exactly these labels, or None when there is none."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in router.metrics().splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.rpartition(" ")[2])
    return None


async def _wait_gauge(router: Router, name: str, value: float, **labels: str) -> None:
    await asyncio.to_thread(
        wait_until,
        lambda: _gauge(router, name, **labels) == value,
        timeout=20,
        what=f"{name}{labels} == {value} (last {_gauge(router, name, **labels)})",
    )


async def _check_rise_and_fall(router: Router, engines: list[Sim]) -> None:
    regular = {"model": MODEL, "role": "regular"}
    await _wait_gauge(router, "smg_model_saturation", 0.0, **regular)  # both engines' slots known, nothing running
    assert _gauge(router, "smg_model_workers", **regular, state="routable") == 2
    assert _gauge(router, "smg_model_workers", **regular, state="unroutable") == 0
    assert _gauge(router, "smg_model_requests_inflight", **regular) == 0

    prompt = f"{uuid.uuid4()} a document to summarise " * 10
    # flood(distinct=True) sends f"{i}: {prompt}": the router counts ceil(chars / chars per token) of each
    tokens = sum(math.ceil(len(f"{i}: {prompt}") / CHARS_PER_TOKEN) for i in range(FLOOD))
    async with flood(router.url, FLOOD, prompt=prompt, distinct=True):
        await _wait_gauge(router, "smg_model_requests_inflight", FLOOD, **regular)
        assert _gauge(router, "smg_model_prompt_tokens_inflight", **regular) == tokens
        # the engines run 2 each and hold the rest: 6 running + waiting over 4 slots
        await asyncio.to_thread(
            wait_until,
            lambda: (
                sum(metric_value(router.metrics(), "smg_worker_backend_load", worker=s.url) for s in engines) == FLOOD
            ),
            what="the polls to find the flood on the engines",
        )
        # (a poll that went out while a request of ours was on its way may count it twice until the next poll)
        await _wait_gauge(router, "smg_model_saturation", FLOOD / (2 * SLOTS), **regular)
    await _wait_gauge(router, "smg_model_requests_inflight", 0, **regular)
    assert _gauge(router, "smg_model_prompt_tokens_inflight", **regular) == 0
    await _wait_gauge(router, "smg_model_saturation", 0.0, **regular)  # the engines dropped the cancelled requests
    assert _gauge(router, "smg_model_requests_inflight", model=MODEL, role="decode") is None  # no decode worker

    # Load another replica sent (here: straight to the engines) counts in the saturation, not in this in-flight
    async with flood(engines[0].url, 3), flood(engines[1].url, 1):
        await _wait_gauge(router, "smg_model_saturation", 4 / (2 * SLOTS), **regular)
        assert _gauge(router, "smg_model_requests_inflight", **regular) == 0
    await _wait_gauge(router, "smg_model_saturation", 0.0, **regular)


async def test_demand_gauges_rise_with_load_and_fall_when_it_ends(logs: Path, engines: list[Sim]) -> None:
    router = start_router(logs, workers=[s.url for s in engines])
    try:
        router.wait_routable(2)
        await _check_rise_and_fall(router, engines)
    finally:
        router.stop()


async def test_the_pods_demand_gauges_with_two_processes_add_in_flight_and_keep_the_engines_saturation(
    logs: Path, engines: list[Sim]
) -> None:
    pod = logs / "demand-pod"
    router = start_router(
        logs, workers=[s.url for s in engines], args=["--processes", "2", "--processes-dir", str(pod)]
    )
    try:
        await asyncio.to_thread(
            wait_until, lambda: "with 2 processes" in router.log(), what="the parent serving both processes"
        )
        router.wait_routable(2)
        await _check_rise_and_fall(router, engines)
    finally:
        router.stop()


async def test_an_engine_gone_down_leaves_its_model_without_routable_workers(logs: Path, engines: list[Sim]) -> None:
    router = start_router(logs, workers=[engines[0].url])
    try:
        router.wait_routable(1)
        regular = {"model": MODEL, "role": "regular"}
        engines[0].stop()
        await _wait_gauge(router, "smg_model_workers", 1, **regular, state="unroutable")
        assert _gauge(router, "smg_model_workers", **regular, state="routable") == 0
        assert _gauge(router, "smg_model_saturation", **regular) == 0.0  # no backlog anywhere: idle, not full
    finally:
        router.stop()


async def test_a_prompt_whose_tokens_the_router_knows_counts_them(logs: Path, engines: list[Sim]) -> None:
    router = start_router(logs, workers=[engines[0].url])
    ids = ",".join(str(i) for i in range(1000, 1050))  # 50 ids from a gateway that tokenized the prompt
    body = {"model": MODEL, "prompt": "x" * 3000, "max_tokens": 3000}  # 1000 tokens by its chars: not counted
    try:
        router.wait_routable(1)
        async with aiohttp.ClientSession() as s:
            sent = asyncio.create_task(
                s.post(router.url + "/v1/completions", json=body, headers={"x-smg-routing-tokens": ids})
            )
            regular = {"model": MODEL, "role": "regular"}
            await _wait_gauge(router, "smg_model_requests_inflight", 1, **regular)
            assert _gauge(router, "smg_model_prompt_tokens_inflight", **regular) == 50
            sent.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sent
        await _wait_gauge(router, "smg_model_prompt_tokens_inflight", 0, **regular)
    finally:
        router.stop()
