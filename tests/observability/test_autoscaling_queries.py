"""The PromQL of docs/autoscaling.md, run by a real Prometheus scraping a real router that routes to smg-sim engines
of known slots, under load and after it: each query evaluates, names only metrics the router exports (or the hold
queue's, ``HOLD_QUEUE``), and returns the series and values the document promises.

Set-up (all on loopback): two ``smg-sim`` engines of 2 running slots each, one router, and Debian's Prometheus
scraping it every second with the labels the chart's ServiceMonitor gives it (``job`` the router Service,
``namespace`` the release's).  Six long requests through the router fill the 4 slots and queue 2: saturation 1.5.
"""

from __future__ import annotations

import asyncio
import math
import re
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import pytest
import pytest_asyncio
from support.helm_chart import REPO
from support.load import flood
from support.procs import MODEL, Router, Sim, start_router, start_sim, wait_until
from support.prometheus import Prometheus, exported_names, metric_names, start_prometheus

pytestmark = pytest.mark.timeout(300)

DOC = (REPO / "docs" / "autoscaling.md").read_text()
QUERIES = re.findall(r"```promql\n(.*?)\n```", DOC, re.S)
HOLD_QUEUE = "smg_model_requests_waiting"
"""Requests held while a model has no routable worker (``--hold-when-empty``), exported with that flag: the one name
of the document taken on trust; this router holds nothing, so its query answers no series."""
SLOTS = 2
FLOOD = 6
CHARS_PER_TOKEN = 3.0  # the router's default --tree-chars-per-token


@dataclass
class Stack:
    sims: list[Sim]
    router: Router
    prom: Prometheus


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("autoscaling")
    started: list[Sim | Router | Prometheus] = []
    try:
        sims = [start_sim(tmp, time_scale=1.0, extra=["--max-running", str(SLOTS)]) for _ in range(2)]
        started += sims
        router = start_router(tmp, workers=[s.url for s in sims])
        started.append(router)
        router.wait_routable(2)
        scrape = [
            {
                "job_name": "smg-router",
                "static_configs": [{"targets": [f"{router.host}:{router.port}"], "labels": {"namespace": "smg"}}],
            }
        ]
        prom = start_prometheus(tmp, scrape)
        started.append(prom)
        wait_until(lambda: prom.targets_up() == 1, timeout=30, what="the router scraped")
        yield Stack(sims=sims, router=router, prom=prom)
    finally:
        for thing in reversed(started):
            thing.stop()


def _values(prom: Prometheus, expr: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Labels (sorted pairs) -> value of each series the query answers."""
    return {tuple(sorted(s["metric"].items())): float(s["value"][1]) for s in prom.vector(expr)}


async def _wait(predicate: Callable[[], bool], what: str) -> None:
    """Wait in a thread: the flood's requests run on this event loop."""
    await asyncio.to_thread(wait_until, predicate, timeout=30, what=what)


def _query(fragment: str) -> str:
    (found,) = [q for q in QUERIES if fragment in q]
    return found


def test_the_document_has_a_query_for_each_signal() -> None:
    named = set().union(*(metric_names(q) for q in QUERIES))
    assert named == {
        "smg_model_saturation",
        HOLD_QUEUE,
        "smg_model_requests_inflight",
        "smg_model_prompt_tokens_inflight",
        "smg_model_workers",
    }


@pytest_asyncio.fixture
async def loaded(stack: Stack) -> AsyncIterator[int]:
    """Six long requests in flight through the router, until the test ends; their prompt tokens as counted."""
    prompt = f"{uuid.uuid4()} a report to read " * 8
    tokens = sum(math.ceil(len(f"{i}: {prompt}") / CHARS_PER_TOKEN) for i in range(FLOOD))
    async with flood(stack.router.url, FLOOD, prompt=prompt, distinct=True):
        yield tokens


async def test_every_query_evaluates_under_load_with_the_promised_series(stack: Stack, loaded: int) -> None:
    prom = stack.prom
    labels = (("model", MODEL), ("role", "regular"))
    saturation = _query("smg_model_saturation")
    expected = FLOOD / (2 * SLOTS)  # 6 running + waiting over 4 slots
    await _wait(lambda: _values(prom, saturation) == {labels: expected}, "saturation scraped")

    known = exported_names(stack.router.metrics()) | {HOLD_QUEUE}
    for q in QUERIES:
        for kind, answer in (("query", prom.query(q)), ("query_range", prom.query_range(q, seconds=30))):
            assert answer["status"] == "success", (kind, q, answer)
        assert metric_names(q) <= known, (q, metric_names(q) - known)

    await _wait(
        lambda: _values(prom, _query("sum by (model, role) (smg_model_requests_inflight")) == {labels: FLOOD},
        "in flight scraped",
    )
    assert _values(prom, _query("smg_model_prompt_tokens_inflight")) == {labels: loaded}
    assert _values(prom, _query("smg_model_workers")) == {labels: 2}
    assert _values(prom, _query("avg(sum by (instance)")) == {(): FLOOD}
    assert _values(prom, _query(HOLD_QUEUE)) == {}


async def test_the_queries_fall_back_to_idle_when_the_load_ends(stack: Stack) -> None:
    prom = stack.prom
    labels = (("model", MODEL), ("role", "regular"))
    for fragment in ("smg_model_saturation", "sum by (model, role) (smg_model_requests_inflight", "prompt_tokens"):
        await _wait(lambda fragment=fragment: _values(prom, _query(fragment)) == {labels: 0.0}, f"{fragment} at 0")
    assert _values(prom, _query("smg_model_workers")) == {labels: 2}
