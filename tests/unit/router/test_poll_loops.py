"""The load monitor and the health checker never die and never wait on each other's workers.

Driven by a scripted probe client (each URL answers, hangs forever, refuses or raises), on short real
intervals: a garbage report, a bug while polling one worker or a worker that never answers must neither
end a loop nor delay the polls and probes of the other workers.  Poll failures are counted by kind in
``smg_worker_poll_errors_total`` and logged once per change of state, not once per poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
from smg_router.fleet.health import HealthChecker
from smg_router.fleet.lifecycle import Lifecycle
from smg_router.fleet.load_monitor import LoadMonitor
from smg_router.fleet.probes import ProbeError
from smg_router.metrics import Metrics
from smg_router.policies.factory import PolicyFactory
from smg_router.policies.registry import PolicyRegistry
from smg_router.settings import HealthSettings, LoadSettings, PolicySettings, RetrySettings
from smg_router.workers.load import LoadView
from smg_router.workers.registry import WorkerRegistry
from smg_router.workers.worker import Worker, WorkerSpec, WorkerStatus

GOOD, BAD, HUNG = "http://127.0.0.2:8000", "http://127.0.0.3:8000", "http://127.0.0.4:8000"
HANG = "hang"
REFUSE = "refuse"
Behaviour = tuple[int, bytes] | str | Exception


def loads_body(n: int) -> tuple[int, bytes]:
    return 200, b'{"loads": [{"num_running_reqs": %d, "num_waiting_reqs": 0}]}' % n


class ScriptedProbes:
    """Answers each GET from ``script`` (URL → behaviour; anything unlisted is refused); counts what was asked."""

    def __init__(self) -> None:
        self.script: dict[str, Behaviour] = {}
        self.asked: dict[str, int] = {}

    async def fetch(self, url: str, *, seconds: float) -> tuple[int, bytes]:
        self.asked[url] = self.asked.get(url, 0) + 1
        behaviour = self.script.get(url, REFUSE)
        if behaviour == HANG:
            await asyncio.Event().wait()  # ignores ``seconds``: the caller's own deadline must end it
        if behaviour == REFUSE:
            raise ProbeError("connect", "connection refused")
        if isinstance(behaviour, Exception):
            raise behaviour
        assert isinstance(behaviour, tuple)
        return behaviour

    async def get(self, url: str, *, seconds: float) -> tuple[int, bytes] | None:
        try:
            return await self.fetch(url, seconds=seconds)
        except ProbeError:
            return None


@dataclass
class Fleet:
    probes: ScriptedProbes
    lifecycle: Lifecycle
    monitor: LoadMonitor
    health: HealthChecker
    metrics: Metrics
    loads: LoadView
    workers: dict[str, Worker] = field(default_factory=dict)

    def errors(self, url: str, kind: str) -> float:
        value = self.metrics.registry.get_sample_value("smg_worker_poll_errors_total", {"worker": url, "kind": kind})
        return 0.0 if value is None else value

    def error_series(self, url: str) -> list[str]:
        return [
            s.labels["kind"]
            for m in self.metrics.registry.collect()
            for s in m.samples
            if s.name == "smg_worker_poll_errors_total" and s.labels.get("worker") == url
        ]

    def polls(self, url: str) -> int:
        return self.probes.asked.get(url + "/v1/loads", 0)

    def probes_of(self, url: str) -> int:
        return self.probes.asked.get(url + "/health", 0)


def _fleet(*urls: str, interval: float = 0.01, timeout: float = 0.05) -> Fleet:
    metrics, loads, registry = Metrics(), LoadView(max_age=5), WorkerRegistry()
    policies = PolicyRegistry(PolicyFactory(settings=PolicySettings(), loads=loads, metrics=metrics), PolicySettings())
    lifecycle = Lifecycle(registry=registry, policies=policies, loads=loads, metrics=metrics, retry=RetrySettings())
    probes = ScriptedProbes()
    monitor = LoadMonitor(
        probes=probes,
        registry=registry,
        policies=policies,
        loads=loads,  # type: ignore[arg-type]
        metrics=metrics,
        settings=LoadSettings(interval=interval, timeout=timeout),
    )
    health = HealthChecker(
        probes=probes,
        lifecycle=lifecycle,  # type: ignore[arg-type]
        settings=HealthSettings(interval=interval, timeout=timeout, failure_threshold=1000),
    )
    fleet = Fleet(probes, lifecycle, monitor, health, metrics, loads)
    for url in urls:
        worker, _ = lifecycle.add(WorkerSpec(url=url, model_id="m"))
        lifecycle.set_status(worker, WorkerStatus.READY)
        fleet.workers[url] = worker
        probes.script[url + "/health"] = (200, b"{}")
        probes.script[url + "/v1/loads"] = loads_body(1)
    return fleet


@contextlib.asynccontextmanager
async def running(loop: Callable[[], Awaitable[None]], name: str) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(loop(), name=name)  # type: ignore[arg-type]
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def eventually(predicate: Callable[[], bool], what: str, within: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


# --- the load monitor ---------------------------------------------------------------------------------------


async def test_a_garbage_report_is_counted_as_a_bad_payload_and_the_monitor_polls_on() -> None:
    f = _fleet(GOOD, BAD)
    f.probes.script[BAD + "/v1/loads"] = (200, b'{"loads": [{"num_running_reqs": 1e308}]}')
    f.probes.script[BAD + "/metrics"] = (200, b"vllm:num_requests_running +Inf\n")
    async with running(f.monitor.run, "load-monitor") as task:
        await eventually(lambda: f.errors(BAD, "bad_payload") >= 3, "three garbage rounds")
        f.probes.script[GOOD + "/v1/loads"] = loads_body(7)
        await eventually(lambda: f.loads.backend(f.workers[GOOD].id) == 7, "the good worker's next poll")
        assert not task.done()
        assert f.loads.backend(f.workers[BAD].id) is None  # a garbage report is not a load
        f.probes.script[BAD + "/v1/loads"] = loads_body(4)
        await eventually(lambda: f.loads.backend(f.workers[BAD].id) == 4, "the repaired worker's poll")
    assert f.errors(GOOD, "bad_payload") == 0


LLAMACPP_METRICS = (200, b"llamacpp:requests_processing 1\nllamacpp:requests_deferred 0\n")


async def test_a_llamacpp_servers_kv_capacity_is_read_once_from_its_props_beside_the_polls() -> None:
    """llama.cpp's /metrics has no KV capacity: the monitor asks /props (slot context x slots) in a task of its own
    beside the polls, until the worker answers once, and keeps what it said; a worker without /props (a 404) is
    asked once.  A /props that hangs delays no poll: a llama.cpp server busy with a prefill answers it while its
    /metrics waits."""
    llama, other, busy = GOOD, BAD, HUNG
    f = _fleet(llama, other, busy)
    props = (200, b'{"default_generation_settings": {"n_ctx": 4096}, "total_slots": 2}')
    for url in (llama, other, busy):
        f.probes.script[url + "/v1/loads"] = (404, b"not found")
        f.probes.script[url + "/metrics"] = LLAMACPP_METRICS
    f.probes.script[llama + "/props"] = HANG  # the first asks run out of time: asked again
    f.probes.script[other + "/props"] = (404, b"not found")
    f.probes.script[busy + "/metrics"] = HANG  # in a long prefill: no poll answers, /props does
    f.probes.script[busy + "/props"] = props
    async with running(f.monitor.run, "load-monitor"):
        await eventually(lambda: f.loads.slots(f.workers[busy].id) == 2, "the busy server's slots")
        await eventually(lambda: f.probes.asked.get(llama + "/props", 0) >= 2, "a second ask of the hung /props")
        assert f.loads.backend(f.workers[llama].id) == 1  # polled meanwhile
        assert f.loads.kv_tokens(f.workers[llama].id) is None
        f.probes.script[llama + "/props"] = props
        await eventually(lambda: f.loads.kv_tokens(f.workers[llama].id) is not None, "the capacity")
        asked = f.probes.asked[llama + "/props"]
        polled = f.probes.asked[llama + "/metrics"]
        await eventually(lambda: f.probes.asked[llama + "/metrics"] >= polled + 5, "five more rounds")
        assert f.probes.asked[llama + "/props"] == asked  # answered once: asked no more
    assert f.loads.kv_tokens(f.workers[llama].id) == 8192 and f.loads.slots(f.workers[llama].id) == 2
    gauge = f.metrics.registry.get_sample_value("smg_worker_kv_capacity_tokens", {"worker": llama, "role": "regular"})
    assert gauge == 8192
    assert f.probes.asked[other + "/props"] == 1
    assert f.loads.kv_tokens(f.workers[other].id) is None and f.loads.slots(f.workers[other].id) is None
    assert f.loads.backend(f.workers[other].id) == 1
    assert f.errors(llama, "timeout") == 0  # a hung /props fails no poll


async def test_an_unexpected_error_polling_one_worker_neither_ends_the_monitor_nor_stops_the_others() -> None:
    f = _fleet(GOOD, BAD)
    f.probes.script[BAD + "/v1/loads"] = RuntimeError("a bug while polling")
    async with running(f.monitor.run, "load-monitor") as task:
        await eventually(lambda: f.errors(BAD, "error") >= 3, "three failed rounds")
        before = f.polls(GOOD)
        await eventually(lambda: f.polls(GOOD) >= before + 3, "the good worker polled on")
        assert not task.done()


async def test_a_hanging_worker_does_not_delay_the_other_workers_polls() -> None:
    f = _fleet(GOOD, HUNG, interval=0.01, timeout=0.5)
    f.probes.script[HUNG + "/v1/loads"] = HANG
    async with running(f.monitor.run, "load-monitor") as task:
        # 20 polls of the good worker take ~0.2 s; one hung poll alone lasts 0.5 s
        await eventually(lambda: f.polls(GOOD) >= 20, "the good worker polled every interval", within=0.45)
        assert f.polls(HUNG) == 1  # one poll in flight per worker, not one more per round
        await eventually(lambda: f.errors(HUNG, "timeout") == 1, "the hung poll to time out")
        assert not task.done()


async def test_a_poll_fails_within_one_timeout_even_when_both_endpoints_are_tried() -> None:
    f = _fleet(HUNG, timeout=0.1)
    f.probes.script[HUNG + "/v1/loads"] = (404, b"")
    f.probes.script[HUNG + "/metrics"] = HANG
    loop = asyncio.get_running_loop()
    start = loop.time()
    assert await f.monitor.poll(f.workers[HUNG]) is None
    assert loop.time() - start < 0.3
    assert f.errors(HUNG, "timeout") == 1


@pytest.mark.parametrize(
    ("loads", "metrics", "kind"),
    [
        (REFUSE, REFUSE, "connect"),
        ((404, b"not here"), (500, b"oops"), "http_status"),
        ((200, b'{"loads": [{"num_running_reqs": -1}]}'), (404, b""), "bad_payload"),
        ((404, b""), (200, b"sglang:num_queue_reqs NaN\n"), "bad_payload"),
        ((200, b"\xff\xfe"), (200, b"\xff\xfe"), "bad_payload"),
        (ProbeError("timeout", "no answer"), REFUSE, "timeout"),
    ],
)
async def test_each_failed_poll_is_counted_once_by_kind(loads: Behaviour, metrics: Behaviour, kind: str) -> None:
    f = _fleet(BAD)
    f.probes.script[BAD + "/v1/loads"], f.probes.script[BAD + "/metrics"] = loads, metrics
    for _ in range(3):
        await f.monitor.poll_all()
    assert f.error_series(BAD) == [kind] and f.errors(BAD, kind) == 3


async def test_a_failing_poll_is_logged_once_per_change_of_state(caplog: pytest.LogCaptureFixture) -> None:
    f = _fleet(BAD)
    caplog.set_level(logging.INFO, logger="smg_router.fleet.load_monitor")

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if BAD in r.getMessage()]

    await f.monitor.poll_all()
    assert lines() == []  # healthy polls say nothing
    f.probes.script[BAD + "/v1/loads"] = f.probes.script[BAD + "/metrics"] = REFUSE
    for _ in range(5):
        await f.monitor.poll_all()
    assert len(lines()) == 1 and "load poll failing: connect" in lines()[0]
    f.probes.script[BAD + "/v1/loads"] = (200, b"{}")
    f.probes.script[BAD + "/metrics"] = (200, b"")
    for _ in range(5):
        await f.monitor.poll_all()
    assert len(lines()) == 2 and "load poll failing: bad_payload" in lines()[1]
    f.probes.script[BAD + "/v1/loads"] = loads_body(2)
    for _ in range(5):
        await f.monitor.poll_all()
    assert len(lines()) == 3 and "load poll recovered" in lines()[2]
    assert [r.levelno for r in caplog.records if BAD in r.getMessage()] == [logging.WARNING] * 2 + [logging.INFO]
    assert f.errors(BAD, "connect") == 5 and f.errors(BAD, "bad_payload") == 5


async def test_a_removed_worker_takes_its_poll_error_series_with_it() -> None:
    f = _fleet(GOOD, BAD)
    f.probes.script[BAD + "/v1/loads"] = f.probes.script[BAD + "/metrics"] = REFUSE
    await f.monitor.poll_all()
    f.probes.script[BAD + "/v1/loads"] = f.probes.script[BAD + "/metrics"] = (200, b"garbage")
    await f.monitor.poll_all()
    assert sorted(f.error_series(BAD)) == ["bad_payload", "connect"]
    await f.lifecycle.remove(f.workers[BAD], drain_timeout=0)
    assert f.error_series(BAD) == []


async def test_a_poll_that_ends_after_its_worker_was_removed_records_nothing() -> None:
    f = _fleet(HUNG, timeout=0.1)
    f.probes.script[HUNG + "/v1/loads"] = HANG
    poll = asyncio.create_task(f.monitor.poll(f.workers[HUNG]))
    await eventually(lambda: f.polls(HUNG) == 1, "the poll to start")
    await f.lifecycle.remove(f.workers[HUNG], drain_timeout=0)
    assert await poll is None
    assert f.error_series(HUNG) == []


async def test_the_monitor_takes_its_per_worker_polls_with_it_when_it_stops() -> None:
    f = _fleet(HUNG, timeout=30)
    f.probes.script[HUNG + "/v1/loads"] = HANG
    async with running(f.monitor.run, "load-monitor"):
        await eventually(lambda: f.polls(HUNG) == 1, "the poll to start")
    # the suite's leaked-task check fails this test if the hung poll outlived the monitor
    assert all(t.done() or t is asyncio.current_task() for t in asyncio.all_tasks())


# --- the health checker ---------------------------------------------------------------------------------------


async def test_a_hanging_worker_does_not_delay_the_other_workers_health_probes() -> None:
    f = _fleet(GOOD, HUNG, interval=0.01, timeout=0.5)
    f.probes.script[HUNG + "/health"] = HANG
    async with running(f.health.run, "health-checker") as task:
        await eventually(lambda: f.probes_of(GOOD) >= 20, "the good worker probed every interval", within=0.45)
        assert f.probes_of(HUNG) == 1
        assert not task.done()


async def test_a_hung_health_probe_fails_within_its_timeout() -> None:
    f = _fleet(HUNG, timeout=0.05)
    f.probes.script[HUNG + "/health"] = HANG
    assert await asyncio.wait_for(f.health.probe(f.workers[HUNG]), 1.0) is False
    assert f.workers[HUNG].health_failures == 1


async def test_an_unexpected_error_probing_one_worker_neither_ends_the_checker_nor_stops_the_others() -> None:
    f = _fleet(GOOD, BAD)
    f.probes.script[BAD + "/health"] = RuntimeError("a bug while probing")
    async with running(f.health.run, "health-checker") as task:
        await eventually(lambda: f.probes_of(BAD) >= 3, "three failed rounds")
        before = f.probes_of(GOOD)
        await eventually(lambda: f.probes_of(GOOD) >= before + 3, "the good worker probed on")
        assert not task.done()
