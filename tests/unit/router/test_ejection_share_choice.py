"""Open breakers take at most ``--max-ejection-share`` of a model's workers out; past it, panic routing."""

from __future__ import annotations

import pytest
from smg_router.attempt import Attempts
from smg_router.errors import NoWorkerAvailable
from smg_router.policies.registry import PolicyRegistry
from smg_router.workers.registry import WorkerRegistry
from smg_router.workers.worker import Worker, WorkerStatus
from support.policy_env import Env, RouteRequest, make_worker


def fleet(env: Env, n: int, *, share: float) -> tuple[Attempts, list[Worker]]:
    registry = WorkerRegistry()
    workers = [make_worker(i + 2) for i in range(n)]
    for w in workers:
        registry.add(w)
    policies = PolicyRegistry(env.factory, env.settings)
    policies.sync(registry)
    return Attempts(registry=registry, policies=policies, metrics=env.metrics, max_ejection_share=share), workers


def open_breaker(w: Worker) -> None:
    for _ in range(w.breaker.failure_threshold):
        w.breaker.record_failure()
    assert not w.breaker.allows()


def panics(env: Env) -> float:
    return env.sample("smg_breaker_panics_total", model="m", role="regular")


def route(attempts: Attempts) -> Worker:
    with attempts.open("regular", RouteRequest(model="m", text="hello")) as guard:
        return guard.worker


def test_breakers_within_the_share_keep_their_workers_out(env: Env) -> None:
    attempts, workers = fleet(env, 4, share=0.5)
    open_breaker(workers[0])
    open_breaker(workers[1])
    assert {route(attempts).id for _ in range(20)} <= {workers[2].id, workers[3].id}
    assert panics(env) == 0


def test_breakers_past_the_share_put_every_ready_worker_back_and_count_the_panic(env: Env) -> None:
    attempts, workers = fleet(env, 2, share=0.5)
    for w in workers:
        open_breaker(w)
    assert route(attempts) in workers  # not a 503: panic routing
    assert panics(env) == 1
    workers[1].status = WorkerStatus.NOT_READY  # health checks still take a worker out: it is not tried
    assert {route(attempts).id for _ in range(10)} == {workers[0].id}
    assert panics(env) == 11


def test_a_success_in_panic_routing_closes_the_breaker(env: Env) -> None:
    attempts, workers = fleet(env, 1, share=0.5)
    open_breaker(workers[0])
    with attempts.open("regular", RouteRequest(model="m", text="hello")) as guard:
        guard.answered(200)
    assert workers[0].breaker.allows() and workers[0].breaker.state == "closed"


def test_a_share_of_one_lets_breakers_take_every_worker_out(env: Env) -> None:
    attempts, workers = fleet(env, 2, share=1.0)
    for w in workers:
        open_breaker(w)
    with pytest.raises(NoWorkerAvailable):
        route(attempts)
    assert panics(env) == 0
