"""The health checker's state machine, driven round by round by a scripted probe client (no sleeping).

pending → ready after success_threshold good probes (discovering the model first when none was given);
ready → not_ready after failure_threshold bad ones; not_ready → ready again; draining workers are left alone.
"""

from __future__ import annotations

from smg_router.fleet.health import HealthChecker
from smg_router.fleet.lifecycle import Lifecycle
from smg_router.metrics import Metrics
from smg_router.policies.factory import PolicyFactory
from smg_router.policies.registry import PolicyRegistry
from smg_router.settings import HealthSettings, PolicySettings, RetrySettings
from smg_router.workers.load import LoadView
from smg_router.workers.registry import WorkerRegistry
from smg_router.workers.worker import WorkerSpec, WorkerStatus

URL = "http://127.0.0.2:8000"


class ScriptedProbes:
    """Answers each GET from a table the test sets; records what was asked."""

    def __init__(self) -> None:
        self.healthy = True
        self.models = b'{"data": [{"id": "discovered"}]}'
        self.asked: list[str] = []

    async def get(self, url: str, *, seconds: float) -> tuple[int, bytes] | None:
        self.asked.append(url)
        if url.endswith("/health"):
            return (200, b"{}") if self.healthy else None
        if url.endswith("/v1/models"):
            return 200, self.models
        return None


def _checker(*, model: str | None = "m", success: int = 1, failure: int = 3):  # type: ignore[no-untyped-def]
    metrics, loads, registry = Metrics(), LoadView(max_age=5), WorkerRegistry()
    policies = PolicyRegistry(PolicyFactory(settings=PolicySettings(), loads=loads, metrics=metrics), PolicySettings())
    lifecycle = Lifecycle(registry=registry, policies=policies, loads=loads, metrics=metrics, retry=RetrySettings())
    probes = ScriptedProbes()
    checker = HealthChecker(
        probes=probes,
        lifecycle=lifecycle,  # type: ignore[arg-type]
        settings=HealthSettings(success_threshold=success, failure_threshold=failure),
    )
    worker, _ = lifecycle.add(WorkerSpec(url=URL, model_id=model))
    return checker, lifecycle, probes, worker, metrics


def _healthy_gauge(metrics: Metrics) -> float | None:
    return metrics.registry.get_sample_value("smg_worker_healthy", {"worker": URL, "role": "regular"})


async def test_pending_becomes_ready_after_the_success_threshold() -> None:
    checker, _, _, worker, metrics = _checker(success=2)
    assert worker.status is WorkerStatus.PENDING
    await checker.check_all()
    assert worker.status is WorkerStatus.PENDING and _healthy_gauge(metrics) == 0
    await checker.check_all()
    assert worker.status is WorkerStatus.READY and _healthy_gauge(metrics) == 1


async def test_ready_becomes_not_ready_after_the_failure_threshold_and_recovers() -> None:
    checker, _, probes, worker, metrics = _checker(failure=3)
    await checker.check_all()
    assert worker.status is WorkerStatus.READY
    probes.healthy = False
    for _ in range(2):
        await checker.check_all()
        assert worker.status is WorkerStatus.READY
    await checker.check_all()
    assert worker.status is WorkerStatus.NOT_READY and not worker.routable and _healthy_gauge(metrics) == 0
    probes.healthy = True
    await checker.check_all()
    assert worker.status is WorkerStatus.READY and worker.routable and _healthy_gauge(metrics) == 1


async def test_a_good_probe_between_failures_restarts_the_count() -> None:
    checker, _, probes, worker, _ = _checker(failure=2)
    await checker.check_all()
    for healthy in (False, True, False, True):
        probes.healthy = healthy
        await checker.check_all()
    assert worker.status is WorkerStatus.READY


async def test_the_model_is_discovered_before_a_worker_of_unknown_model_becomes_ready() -> None:
    checker, lifecycle, probes, worker, _ = _checker(model=None)
    await checker.check_all()
    assert worker.status is WorkerStatus.READY and worker.model_id == "discovered"
    assert probes.asked == [URL + "/health", URL + "/v1/models"]
    assert lifecycle.policies.default.has_tree("discovered")  # type: ignore[attr-defined]


async def test_a_garbled_model_list_leaves_the_model_unknown_but_the_worker_ready() -> None:
    checker, _, probes, worker, _ = _checker(model=None)
    probes.models = b'{"data": "nope"}'
    await checker.check_all()
    assert worker.status is WorkerStatus.READY and worker.model_id is None


async def test_draining_workers_are_not_probed() -> None:
    checker, lifecycle, probes, worker, _ = _checker()
    await checker.check_all()
    lifecycle.set_draining(worker, True)
    probes.asked.clear()
    probes.healthy = False
    for _ in range(5):
        await checker.check_all()
    assert probes.asked == [] and worker.status is WorkerStatus.DRAINING
