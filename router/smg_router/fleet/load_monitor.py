"""The load monitor: poll every worker's backlog into the one shared ``LoadView``.

Asks ``GET /v1/loads`` (SGLang) first and falls back to Prometheus ``GET /metrics`` (SGLang, vLLM and
llama.cpp gauges), remembering per worker which one answered.  Runs whenever any policy instance reads
load (cache_aware included: the Rust gateway never polled for a cache_aware-only deployment).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

import orjson

from smg_router.fleet.probes import ProbeClient
from smg_router.metrics import Metrics
from smg_router.policies.registry import PolicyRegistry
from smg_router.settings import LoadSettings
from smg_router.workers.load import LoadView
from smg_router.workers.registry import WorkerRegistry
from smg_router.workers.worker import Worker, WorkerStatus

log = logging.getLogger(__name__)

MAX_BACKLOG = 10**9
"""More running + waiting requests than any engine holds: a report above it is garbage, not a load to route on."""

# Prometheus gauges whose sum is a worker's running + waiting requests.
BACKLOG_GAUGES = frozenset({
    "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang_num_running_reqs", "sglang_num_queue_reqs",
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "llamacpp:requests_processing", "llamacpp:requests_deferred",
})


def _count(value: object, what: str) -> float:
    """A request count as a worker reported it, or ValueError: NaN, ±Inf, negative and absurd counts are refused.

    Refused rather than clamped: a worker that reports garbage is broken, and a clamped figure would route on it.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{what} is not a number: {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{what} is not finite: {value!r}")
    if not 0 <= value <= MAX_BACKLOG:
        raise ValueError(f"{what} out of range 0..{MAX_BACKLOG}: {value!r}")
    return value


def _backlog(total: float) -> int:
    if total > MAX_BACKLOG:
        raise ValueError(f"backlog {total!r} over {MAX_BACKLOG}")
    return int(total)


def parse_loads(body: bytes) -> int:
    """Sum running + waiting over the ranks of an SGLang ``/v1/loads`` answer; ValueError if it is not a sane one."""
    data = orjson.loads(body)  # NaN, Infinity and numbers that overflow a double are JSONDecodeError (ValueError)
    if not isinstance(data, dict) or not isinstance(data.get("loads"), list):
        raise ValueError("not a /v1/loads document")
    total = 0.0  # each term is at most MAX_BACKLOG, so the sum is exact in a double well past the bound
    for rank in data["loads"]:
        if not isinstance(rank, dict):
            raise ValueError("malformed rank entry")
        for key in ("num_running_reqs", "num_waiting_reqs"):
            if key in rank:  # an engine that omits a counter has none of those requests
                total += _count(rank[key], key)
    return _backlog(total)


def parse_metrics(text: str) -> int:
    """Sum the backlog gauges of a Prometheus exposition; ValueError if none is present or one is not sane."""
    total = 0.0
    seen = False
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        if brace >= 0:
            name = line[:brace]
            rest = line[line.rfind("}") + 1:]
        else:
            name, _, rest = line.partition(" ")
        if name in BACKLOG_GAUGES:
            fields = rest.split()
            if not fields:
                raise ValueError(f"{name} has no value")
            total += _count(float(fields[0]), name)  # float() of a non-number is ValueError too
            seen = True
    if not seen:
        raise ValueError("no backlog gauges in /metrics")
    return _backlog(total)


class LoadMonitor:
    def __init__(self, *, probes: ProbeClient, registry: WorkerRegistry, policies: PolicyRegistry,
                 loads: LoadView, metrics: Metrics, settings: LoadSettings) -> None:
        self._probes = probes
        self._registry = registry
        self._policies = policies
        self._loads = loads
        self._metrics = metrics
        self._settings = settings
        self._source: dict[str, str] = {}
        """Worker id → "loads" or "metrics", whichever answered last time."""

    async def run(self) -> None:
        while True:
            if self._policies.needs_load():
                await self.poll_all()
            await asyncio.sleep(self._settings.interval)

    async def poll_all(self) -> None:
        workers = [w for w in self._registry
                   if w.status in (WorkerStatus.READY, WorkerStatus.DRAINING, WorkerStatus.NOT_READY)]
        for stale in set(self._source) - {w.id for w in workers}:
            del self._source[stale]
        await asyncio.gather(*(self.poll(w) for w in workers))

    async def poll(self, worker: Worker) -> int | None:
        source = self._source.get(worker.id)
        load = None
        if source in (None, "loads"):
            load = await self._fetch(worker.url + "/v1/loads", parse_loads)
            if load is not None:
                self._source[worker.id] = "loads"
        if load is None and source in (None, "metrics"):
            load = await self._fetch(worker.url + "/metrics", lambda b: parse_metrics(b.decode()))
            if load is not None:
                self._source[worker.id] = "metrics"
        if load is None:
            self._source.pop(worker.id, None)  # try both again next time
            return None
        if self._registry.get(worker.id) is worker:  # not removed while we were polling
            self._loads.record(worker.id, load, at=time.monotonic())
            self._metrics.worker_backend_load.labels(worker.url, worker.role).set(load)
        return load

    async def _fetch(self, url: str, parse: Callable[[bytes], int]) -> int | None:
        answer = await self._probes.get(url, seconds=self._settings.timeout)
        if answer is None or answer[0] != 200:
            return None
        try:
            return parse(answer[1])
        except (ValueError, UnicodeDecodeError):
            return None
