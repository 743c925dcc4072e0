"""The attempt guard: in-flight, processed and the breaker outcome, counted once on every exit path."""

from __future__ import annotations

import pytest
from smg_router.attempt import AttemptGuard, is_retryable, is_worker_failure
from smg_router.metrics import Metrics
from smg_router.workers.registry import WorkerRegistry
from support.policy_env import make_worker


def _setup():  # type: ignore[no-untyped-def]
    registry, metrics = WorkerRegistry(), Metrics()
    worker = make_worker(2)
    registry.add(worker)
    return worker, registry, metrics


def _inflight_gauge(metrics: Metrics, worker) -> float | None:  # type: ignore[no-untyped-def]
    return metrics.registry.get_sample_value("smg_worker_inflight", {"worker": worker.url, "role": "regular"})


def test_counts_in_while_open_and_out_once_closed() -> None:
    worker, registry, metrics = _setup()
    with AttemptGuard(worker, registry=registry, metrics=metrics) as guard:
        assert worker.inflight == 1 and worker.processed == 1 and _inflight_gauge(metrics, worker) == 1
        guard.close()
        guard.close()  # closing twice counts out once
    assert worker.inflight == 0 and worker.processed == 1 and _inflight_gauge(metrics, worker) == 0


def test_an_attempt_prefills_until_its_answer_starts_or_it_ends() -> None:
    worker, registry, metrics = _setup()
    with AttemptGuard(worker, registry=registry, metrics=metrics, prefill_chars=300) as streamed:
        with AttemptGuard(worker, registry=registry, metrics=metrics, prefill_chars=40):  # a whole answer: to its end
            assert (worker.prefilling, worker.prefill_chars) == (2, 340)
        assert (worker.prefilling, worker.prefill_chars) == (1, 300)
        streamed.started()
        streamed.started()  # the first chunk counts it out once
        assert (worker.prefilling, worker.prefill_chars, worker.inflight) == (0, 0, 1)
    assert (worker.prefilling, worker.prefill_chars, worker.inflight) == (0, 0, 0)


@pytest.mark.parametrize(("status", "failures_after_3"), [(500, 3), (503, 3), (429, 0), (404, 0), (200, 0)])
def test_one_rule_for_what_a_status_means_to_the_breaker(status: int, failures_after_3: int) -> None:
    worker, registry, metrics = _setup()
    worker.breaker.record_failure()
    worker.breaker.record_failure()  # one more failure opens it (threshold 3)
    with AttemptGuard(worker, registry=registry, metrics=metrics) as guard:
        guard.answered(status)
    assert worker.breaker.allows() is (failures_after_3 == 0)
    if status == 429:  # back-pressure is neither a failure nor a success: the count stays at 2
        worker.breaker.record_failure()
        assert not worker.breaker.allows()


def test_an_exception_closes_the_guard_without_inventing_an_outcome() -> None:
    worker, registry, metrics = _setup()
    worker.breaker.record_failure()
    worker.breaker.record_failure()
    with pytest.raises(RuntimeError), AttemptGuard(worker, registry=registry, metrics=metrics):
        raise RuntimeError("the client went away")
    assert worker.inflight == 0 and worker.breaker.allows()
    with pytest.raises(RuntimeError), AttemptGuard(worker, registry=registry, metrics=metrics) as guard:
        guard.failed()
        raise RuntimeError("the worker cut the body off")
    assert worker.inflight == 0 and not worker.breaker.allows()


def test_a_removed_worker_gets_no_inflight_series_back() -> None:
    worker, registry, metrics = _setup()
    with AttemptGuard(worker, registry=registry, metrics=metrics):
        registry.discard(worker)
        metrics.forget_worker(worker.url, worker.role)
    assert worker.inflight == 0 and _inflight_gauge(metrics, worker) is None


def test_retry_and_failure_rules() -> None:
    assert [s for s in (200, 400, 404, 429, 500, 502, 503) if is_worker_failure(s)] == [500, 502, 503]
    assert [s for s in (200, 400, 404, 429, 500, 502, 503) if is_retryable(s)] == [429, 500, 502, 503]


def test_a_half_open_worker_takes_one_trial_and_an_outcome_less_end_frees_it() -> None:
    worker, registry, metrics = _setup()
    clock = [0.0]
    worker.breaker._clock = lambda: clock[0]  # type: ignore[attr-defined]
    for _ in range(3):
        worker.breaker.record_failure()
    clock[0] = 100.0
    assert worker.routable
    with AttemptGuard(worker, registry=registry, metrics=metrics):
        assert not worker.routable  # the trial is running
        with AttemptGuard(worker, registry=registry, metrics=metrics):  # an attempt that began before
            pass  # ends without an outcome: must not free the trial it does not hold
        assert not worker.routable
    assert worker.routable  # the trial ended without an outcome: the next request may try
    with AttemptGuard(worker, registry=registry, metrics=metrics) as trial:
        trial.answered(500)
    assert not worker.routable  # re-opened for another cooldown
    clock[0] = 200.0
    with AttemptGuard(worker, registry=registry, metrics=metrics) as trial:
        trial.answered(200)
    assert worker.routable and worker.breaker.state == "closed"


def test_a_streamed_attempt_joins_its_prefix_until_its_answer_starts_or_it_ends() -> None:
    """``Worker.joining``: a streamed attempt with leading chars counts there from its open to its first chunk (or its
    end, whichever comes first), once; other leading chars are counted apart."""
    worker, registry, metrics = _setup()
    first, second, other = (AttemptGuard(worker, registry=registry, metrics=metrics) for _ in range(3))
    first.joins("doc A")
    second.joins("doc A")
    other.joins("doc B")
    assert worker.joining == {"doc A": 2, "doc B": 1}
    first.started()
    first.close()
    assert worker.joining == {"doc A": 1, "doc B": 1}
    second.close()  # ended without a chunk (failed, or the client left)
    other.started()
    assert worker.joining == {}
