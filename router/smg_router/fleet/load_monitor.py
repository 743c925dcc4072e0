"""The load monitor: poll every worker's backlog into the one shared ``LoadView``.

Asks ``GET /v1/loads`` (SGLang) first and falls back to Prometheus ``GET /metrics`` (SGLang, vLLM and
llama.cpp gauges), remembering per worker which one answered.  The engine's KV capacity (the tree's cap per
worker) comes with those figures where the engine reports it (SGLang, vLLM); a llama.cpp server's (a slot's
context times the slots) is asked from ``/props`` beside the polls, until each worker has answered once, from
its registration on (before its first health check: a slot engine's first requests already take turns by it).
Runs whenever any policy instance reads load (cache_aware included: the Rust gateway never polled for a
cache_aware-only deployment).

Every worker is polled on its own (``WorkerTasks``: a round starts the polls not still running and waits
for none), each poll within one timeout for both endpoints, so a worker that hangs delays nobody else's
figure.  A report is validated number by number (``parse_loads``, ``parse_metrics``): NaN, ±Inf, negative
or absurd counts are a bad payload, never a load.  A failed poll is counted by kind and logged once per
change of state; nothing a worker sends, and no bug while polling one worker, ends the monitor.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import re
import time
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import orjson

from smg_router.fleet.probes import ProbeClient, ProbeError, WorkerTasks
from smg_router.metrics import Metrics
from smg_router.policies.registry import PolicyRegistry
from smg_router.settings import LoadSettings
from smg_router.workers.load import LoadView
from smg_router.workers.registry import WorkerRegistry
from smg_router.workers.worker import Worker, WorkerStatus

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_BACKLOG = 10**9
"""More running + waiting requests than any engine holds: a report above it is garbage, not a load to route on."""

RUNNING_GAUGES = frozenset(
    {"sglang:num_running_reqs", "sglang_num_running_reqs", "vllm:num_requests_running", "llamacpp:requests_processing"}
)
"""Prometheus gauges of the requests an engine runs now."""
WAITING_GAUGES = frozenset(
    {"sglang:num_queue_reqs", "sglang_num_queue_reqs", "vllm:num_requests_waiting", "llamacpp:requests_deferred"}
)
"""Prometheus gauges of the requests an engine holds back until it can run them."""
BACKLOG_GAUGES = RUNNING_GAUGES | WAITING_GAUGES
"""Gauges whose sum is a worker's running + waiting requests."""
SLOT_GAUGES = frozenset({"sglang:max_running_requests", "sglang_max_running_requests"})
"""Where an exposition says how many requests the engine runs at once."""


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


KV_GAUGES = frozenset({"sglang:max_total_num_tokens", "sglang_max_total_num_tokens", "vllm:cache_config_info"})
"""Where an exposition says how many KV tokens the engine holds (vLLM: in the labels of an info gauge)."""
_LABEL = re.compile(r'(\w+)="([^"]*)"')
MAX_KV_TOKENS = 10**12
"""More KV tokens than any engine holds: a capacity above it is ignored (the tree keeps its other caps)."""


class Report(NamedTuple):
    """One poll's figures: running + waiting requests, and what the engine says of its capacity."""

    backlog: int
    kv_tokens: int | None
    """The KV cache capacity in tokens, if reported."""
    running_slots: int | None = None
    """How many requests the engine runs at once: reported (SGLang's ``max_running_requests``), else, when
    requests waited at the poll, those it was running (an engine holds a request back only when it is full)."""


def _slots(running: float, waiting: float, reported: float, seen: bool) -> int | None:
    if seen and 0 < reported <= MAX_BACKLOG:
        return int(reported)
    return int(running) if waiting > 0 and running > 0 else None


def _kv(total: float, seen: bool) -> int | None:
    return int(total) if seen and 0 < total <= MAX_KV_TOKENS else None


def parse_loads(body: bytes) -> int:
    """Sum running + waiting over the ranks of an SGLang ``/v1/loads`` answer; ValueError if it is not a sane one."""
    return parse_loads_report(body).backlog


def parse_loads_report(body: bytes) -> Report:
    """``parse_loads`` and the capacities: ``max_total_num_tokens`` and ``max_running_requests`` summed over the
    ranks (the slots only when every rank reports them)."""
    data = orjson.loads(body)  # NaN, Infinity and numbers that overflow a double are JSONDecodeError (ValueError)
    if not isinstance(data, dict) or not isinstance(data.get("loads"), list):
        raise ValueError("not a /v1/loads document")
    running = waiting = 0.0  # each term is at most MAX_BACKLOG, so the sums are exact in a double past the bound
    kv, kv_seen = 0.0, False
    slots, slots_seen = 0.0, bool(data["loads"])
    for rank in data["loads"]:
        if not isinstance(rank, dict):
            raise ValueError("malformed rank entry")
        if "num_running_reqs" in rank:  # an engine that omits a counter has none of those requests
            running += _count(rank["num_running_reqs"], "num_running_reqs")
        if "num_waiting_reqs" in rank:
            waiting += _count(rank["num_waiting_reqs"], "num_waiting_reqs")
        capacity = _hint(rank.get("max_total_num_tokens"))
        if capacity is not None:
            kv, kv_seen = kv + capacity, True  # a capacity that makes no sense is left out, not an error
        rank_slots = _hint(rank.get("max_running_requests"))
        slots, slots_seen = slots + (rank_slots or 0), slots_seen and rank_slots is not None
    return Report(_backlog(running + waiting), _kv(kv, kv_seen), _slots(running, waiting, slots, slots_seen))


def _hint(value: object) -> float | None:
    """A capacity as reported, or None when it is not a finite number (a hint: never an error)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return value
    return None


def parse_metrics(text: str) -> int:
    """Sum the backlog gauges of a Prometheus exposition; ValueError if none is present or one is not sane."""
    return parse_metrics_report(text).backlog


def parse_metrics_report(text: str) -> Report:
    """``parse_metrics`` and the capacities: KV from SGLang's ``sglang:max_total_num_tokens`` gauge or vLLM's
    ``vllm:cache_config_info`` labels ``num_gpu_blocks`` times ``block_size``; running slots from SGLang's
    ``sglang:max_running_requests`` (vLLM reports none: learned when requests wait)."""
    running = waiting = 0.0
    seen = False
    kv, kv_seen = 0.0, False
    slots, slots_seen = 0.0, False
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        if brace >= 0:
            name = line[:brace]
            rest = line[line.rfind("}") + 1 :]
        else:
            name, _, rest = line.partition(" ")
        if name in BACKLOG_GAUGES:
            fields = rest.split()
            if not fields:
                raise ValueError(f"{name} has no value")
            count = _count(float(fields[0]), name)  # float() of a non-number is ValueError too
            if name in RUNNING_GAUGES:
                running += count
            else:
                waiting += count
            seen = True
        elif name in KV_GAUGES:
            capacity = _capacity_of(name, line, rest)
            if capacity is not None:
                kv, kv_seen = kv + capacity, True
        elif name in SLOT_GAUGES:
            capacity = _capacity_of(name, line, rest)
            if capacity is not None:
                slots, slots_seen = slots + capacity, True
    if not seen:
        raise ValueError("no backlog gauges in /metrics")
    return Report(_backlog(running + waiting), _kv(kv, kv_seen), _slots(running, waiting, slots, slots_seen))


def _capacity_of(name: str, line: str, rest: str) -> float | None:
    """One capacity line's figure (KV tokens, running slots), or None when it does not make sense (never an error:
    it is a hint)."""
    try:
        if name == "vllm:cache_config_info":
            labels = dict(_LABEL.findall(line[: line.rfind("}")]))
            value = float(labels["num_gpu_blocks"]) * float(labels["block_size"])
        else:
            value = float(rest.split()[0])
    except (KeyError, ValueError, IndexError):
        return None
    return value if math.isfinite(value) and value > 0 else None


def _parse_metrics_body(body: bytes) -> Report:
    return parse_metrics_report(body.decode())  # UnicodeDecodeError is a ValueError


class Slots(NamedTuple):
    """A llama.cpp server's KV: ``tokens`` in all, in ``slots`` slots that each keep one prompt."""

    tokens: int
    slots: int


def parse_props(body: bytes) -> Slots | None:
    """KV of a llama.cpp server from its ``/props``: ``total_slots`` slots of ``default_generation_settings.n_ctx``
    tokens each; None when either is missing or makes no sense.  ValueError when the answer is not a JSON object."""
    data = orjson.loads(body)
    if not isinstance(data, dict):
        raise ValueError("not a /props document")
    settings = data.get("default_generation_settings")
    n_ctx = _positive_int(settings.get("n_ctx") if isinstance(settings, dict) else None)
    slots = _positive_int(data.get("total_slots"))
    if n_ctx is None or slots is None:
        return None
    tokens = _kv(float(n_ctx * slots), True)
    return None if tokens is None else Slots(tokens, slots)


def _positive_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class LoadMonitor:
    """Polls each worker on its own: one poll in flight per worker, each within one timeout, none ever raising.

    A failed poll (kinds: ``timeout``, ``connect``, ``http_status``, ``bad_payload``, ``error`` for a bug of
    ours) is counted in ``smg_worker_poll_errors_total`` and logged once per change of state of the worker.
    """

    def __init__(
        self,
        *,
        probes: ProbeClient,
        registry: WorkerRegistry,
        policies: PolicyRegistry,
        loads: LoadView,
        metrics: Metrics,
        settings: LoadSettings,
    ) -> None:
        self._probes = probes
        self._registry = registry
        self._policies = policies
        self._loads = loads
        self._metrics = metrics
        self._settings = settings
        self._source: dict[str, str] = {}
        """Worker id → "loads" or "metrics", whichever answered last time."""
        self._failing: dict[str, str] = {}
        """Worker id → kind of its failing polls, while they fail (the log line is written on each change)."""
        self._props_read: set[str] = set()
        """Workers whose ``/props`` gave an answer (a capacity, or none: never asked again while registered)."""
        self._props = WorkerTasks("props-read")
        self._polls = WorkerTasks("load-poll")

    async def run(self) -> None:
        """Every interval, start a poll of each worker not still busy with its last one; ends only when cancelled."""
        failed = False
        try:
            while True:
                try:
                    if self._policies.needs_load():
                        self.start_round()
                    failed = False
                except Exception:  # a bug in a round must not end polling for every worker
                    if not failed:
                        log.exception("load monitor round failed; trying again every %ss", self._settings.interval)
                    failed = True
                await asyncio.sleep(self._settings.interval)
        finally:
            await self._polls.close()
            await self._props.close()

    def start_round(self) -> list[asyncio.Task[None]]:
        """Start a poll of every polled worker that has none running; the tasks of the round, to wait on or not."""
        workers = [
            w for w in self._registry if w.status in (WorkerStatus.READY, WorkerStatus.DRAINING, WorkerStatus.NOT_READY)
        ]
        polled = {w.id for w in workers}
        for table in (self._source, self._failing):
            for stale in set(table) - polled:
                del table[stale]
        self._props_read &= {w.id for w in self._registry}
        for w in self._registry:  # not yet probed too: a slot engine's first requests already need its slots
            if w.id not in self._props_read:
                _ = self._props.start(w.id, functools.partial(self._read_props, w))
        return [self._polls.start(w.id, functools.partial(self._poll_task, w)) for w in workers]

    async def poll_all(self) -> None:
        """One round, waited for."""
        await asyncio.gather(*self.start_round())

    async def _poll_task(self, worker: Worker) -> None:
        await self.poll(worker)

    async def poll(self, worker: Worker) -> int | None:
        """Poll one worker now: record its backlog, or count and log why there is none.  Never raises."""
        error: BaseException | None = None
        inflight = worker.inflight  # what the engine's figure already counts of ours
        try:
            async with asyncio.timeout(self._settings.timeout):
                report = await self._read(worker)
        except ProbeError as e:
            kind, detail = e.kind, e.detail
        except TimeoutError:
            kind, detail = "timeout", f"no answer within {self._settings.timeout}s"
        except Exception as e:  # a bug of ours with one worker must not end the monitor for every worker
            kind, detail, error = "error", repr(e), e
        else:
            load = report.backlog
            if self._registry.get(worker.id) is worker:  # not removed while we were polling
                self._loads.record(worker.id, load, at=time.monotonic(), inflight=inflight)
                self._metrics.worker_backend_load.labels(worker.url, worker.role).set(load)
                if self._failing.pop(worker.id, None) is not None:
                    log.info("worker %s load poll recovered", worker.url)
                if report.kv_tokens is not None:
                    self._record_kv(worker, report.kv_tokens)
                if report.running_slots is not None:
                    self._loads.record_running_slots(worker.id, report.running_slots)
            return load
        if self._registry.get(worker.id) is worker:  # a removed worker's series stay gone
            self._metrics.worker_poll_errors.labels(worker.url, kind).inc()
            if self._failing.get(worker.id) != kind:
                self._failing[worker.id] = kind
                log.log(
                    logging.ERROR if error else logging.WARNING,
                    "worker %s load poll failing: %s (%s)",
                    worker.url,
                    kind,
                    detail[:200],
                    exc_info=error,
                )
        return None

    async def _read(self, worker: Worker) -> Report:
        """The backlog from the endpoint that answered last time, else ``/v1/loads`` then ``/metrics``.

        Both attempts share one deadline, so a poll never takes more than one timeout.
        """
        deadline = asyncio.get_running_loop().time() + self._settings.timeout
        source = self._source.pop(worker.id, None)  # set again by a success: a failure tries both next time
        first: ProbeError | None = None
        if source in (None, "loads"):
            try:
                load = await self._fetch(worker, "/v1/loads", parse_loads_report, deadline)
            except ProbeError as e:
                if source == "loads" or e.kind not in ("http_status", "bad_payload"):
                    raise  # a worker that times out or refuses would not answer /metrics either
                first = e
            else:
                self._source[worker.id] = "loads"
                return load
        try:
            load = await self._fetch(worker, "/metrics", _parse_metrics_body, deadline)
        except ProbeError as e:
            # no /metrics either (a 404) says less than what was wrong with /v1/loads
            if first is not None and e.kind == "http_status":
                raise first from None
            raise
        self._source[worker.id] = "metrics"
        return load

    async def _read_props(self, worker: Worker) -> None:
        """A llama.cpp server's KV tokens and slots from ``/props`` (its ``/metrics`` has neither), asked beside the
        polls (a task of its own per worker, within one timeout: a llama.cpp server busy with a prefill answers
        ``/props`` but not ``/metrics``) at every round until the worker answers once (a capacity, or none: an
        engine without the document, SGLang or vLLM, answers 404 once and is asked no more)."""
        deadline = asyncio.get_running_loop().time() + self._settings.timeout
        try:
            async with asyncio.timeout_at(deadline):
                kv = await self._fetch(worker, "/props", parse_props, deadline)
        except ProbeError as e:
            if e.kind not in ("http_status", "bad_payload"):
                return  # out of time or no connection: next poll
            kv = None
        except TimeoutError:
            return
        if self._registry.get(worker.id) is not worker:
            return
        self._props_read.add(worker.id)
        if kv is not None:
            log.info("worker %s: %d KV tokens in %d slots from /props", worker.url, kv.tokens, kv.slots)
            self._record_kv(worker, kv.tokens, slots=kv.slots)

    def _record_kv(self, worker: Worker, tokens: int, *, slots: int | None = None) -> None:
        self._loads.record_kv(worker.id, tokens, slots=slots)
        self._metrics.worker_kv_capacity.labels(worker.url, worker.role).set(tokens)

    async def _fetch(self, worker: Worker, path: str, parse: Callable[[bytes], T], deadline: float) -> T:
        seconds = deadline - asyncio.get_running_loop().time()
        if seconds <= 0:
            raise ProbeError("timeout", f"no answer within {self._settings.timeout}s")
        status, body = await self._probes.fetch(worker.url + path, seconds=seconds)
        if status != 200:
            raise ProbeError("http_status", f"{path} answered {status}")
        try:
            return parse(body)
        except ValueError as e:
            raise ProbeError("bad_payload", f"{path}: {str(e)[:200]}") from None
