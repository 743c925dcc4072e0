"""The demand gauges per model and role (``workers.demand``, ``Metrics.add_demand_source``): an autoscaler's view."""

from __future__ import annotations

from smg_router.metrics import Metrics, merge_expositions
from smg_router.workers.breaker import CircuitBreaker
from smg_router.workers.demand import SATURATED, demand_rows, model_demand
from smg_router.workers.load import LoadView
from smg_router.workers.worker import Worker, WorkerSpec, WorkerStatus

NOW = 1000.0


def _worker(n: int, *, model: str | None = "m", role: str = "regular", ready: bool = True) -> Worker:
    w = Worker(
        WorkerSpec(url=f"http://127.0.0.{n}:8000", model_id=model, role=role),
        CircuitBreaker(failure_threshold=1, cooldown=60.0),
    )
    w.status = WorkerStatus.READY if ready else WorkerStatus.NOT_READY
    return w


def _loads() -> LoadView:
    return LoadView(max_age=5.0)


def test_in_flight_requests_and_prompt_tokens_add_up_per_model_and_role() -> None:
    a, b, c = _worker(2), _worker(3), _worker(4, role="decode")
    a.inflight, a.prompt_tokens = 3, 300
    b.inflight, b.prompt_tokens = 2, 50
    c.inflight, c.prompt_tokens = 1, 7
    got = model_demand([a, b, c], _loads(), now=NOW)
    assert (got["m", "regular"].inflight, got["m", "regular"].prompt_tokens) == (5, 350)
    assert (got["m", "decode"].inflight, got["m", "decode"].prompt_tokens) == (1, 7)


def test_saturation_is_the_polled_backlog_over_the_reported_running_slots() -> None:
    a, b = _worker(2), _worker(3)
    loads = _loads()
    loads.record(a.id, 6, at=NOW)
    loads.record(b.id, 2, at=NOW)
    loads.record_running_slots(a.id, 4)
    loads.record_running_slots(b.id, 4)
    assert model_demand([a, b], loads, now=NOW)["m", "regular"].saturation == 1.0  # 8 / 8
    loads.record(a.id, 1, at=NOW)
    assert model_demand([a, b], loads, now=NOW)["m", "regular"].saturation == 3 / 8


def test_a_stale_poll_leaves_the_routers_own_in_flight_as_the_backlog() -> None:
    a = _worker(2)
    loads = _loads()
    loads.record(a.id, 50, at=NOW - 60)  # long stale
    loads.record_running_slots(a.id, 10)
    a.inflight = 3
    assert model_demand([a], loads, now=NOW)["m", "regular"].saturation == 0.3


def test_requests_sent_since_the_poll_count_on_top_of_the_polled_backlog() -> None:
    a = _worker(2)
    loads = _loads()
    loads.record(a.id, 4, at=NOW, inflight=1)  # the poll counted 1 of ours
    loads.record_running_slots(a.id, 8)
    a.inflight = 3  # 2 sent since
    assert model_demand([a], loads, now=NOW)["m", "regular"].saturation == 6 / 8


def test_unroutable_workers_and_unknown_slots_stay_out_of_the_ratio() -> None:
    a, down, unknown = _worker(2), _worker(3, ready=False), _worker(4)
    loads = _loads()
    for w, load in ((a, 2), (down, 9), (unknown, 5)):
        loads.record(w.id, load, at=NOW)
    loads.record_running_slots(a.id, 4)
    loads.record_running_slots(down.id, 4)
    d = model_demand([a, down, unknown], loads, now=NOW)["m", "regular"]
    assert d.saturation == 0.5
    assert (d.routable, d.unroutable) == (2, 1)


def test_no_routable_worker_with_a_backlog_is_saturated_and_without_one_idle() -> None:
    down = _worker(2, ready=False)
    loads = _loads()
    assert model_demand([down], loads, now=NOW)["m", "regular"].saturation == 0.0
    down.inflight = 1  # still answering a request from before it went down
    assert model_demand([down], loads, now=NOW)["m", "regular"].saturation == SATURATED == 1.0


def test_an_open_breaker_makes_a_ready_worker_unroutable() -> None:
    a = _worker(2)
    a.breaker.record_failure()
    d = model_demand([a], _loads(), now=NOW)["m", "regular"]
    assert (d.routable, d.unroutable) == (0, 1)


def test_routable_workers_whose_slots_are_unknown_give_no_saturation() -> None:
    a = _worker(2)
    a.inflight = 4
    assert model_demand([a], _loads(), now=NOW)["m", "regular"].saturation is None


def test_a_worker_of_unknown_model_is_counted_under_the_empty_model() -> None:
    assert list(model_demand([_worker(2, model=None)], _loads(), now=NOW)) == [("", "regular")]


def test_the_gauges_expose_every_model_and_role_with_their_labels() -> None:
    a, b, down = _worker(2), _worker(3, model="n", role="prefill"), _worker(4, model="n", role="prefill", ready=False)
    a.inflight, a.prompt_tokens = 2, 40
    loads = _loads()
    loads.record(a.id, 3, at=NOW, inflight=2)  # the engine's 3 include our 2
    loads.record_running_slots(a.id, 4)
    m = Metrics()
    m.add_demand_source(lambda: demand_rows([a, b, down], loads, now=NOW))
    get = m.registry.get_sample_value
    assert get("smg_model_requests_inflight", {"model": "m", "role": "regular"}) == 2
    assert get("smg_model_prompt_tokens_inflight", {"model": "m", "role": "regular"}) == 40
    assert get("smg_model_saturation", {"model": "m", "role": "regular"}) == 0.75
    assert get("smg_model_saturation", {"model": "n", "role": "prefill"}) is None  # b's slots are not known
    assert get("smg_model_workers", {"model": "n", "role": "prefill", "state": "routable"}) == 1
    assert get("smg_model_workers", {"model": "n", "role": "prefill", "state": "unroutable"}) == 1
    assert get("smg_model_requests_inflight", {"model": "n", "role": "prefill"}) == 0
    text = m.exposition().decode()
    for name in ("requests_inflight", "prompt_tokens_inflight", "saturation", "workers"):
        assert f"# TYPE smg_model_{name} gauge" in text


def test_processes_add_their_in_flight_and_keep_the_largest_saturation() -> None:
    loads = _loads()
    texts = []
    for inflight, backlog in ((2, 6), (5, 7)):
        w = _worker(2)
        w.inflight, w.prompt_tokens = inflight, 10 * inflight
        loads.record(w.id, backlog, at=NOW, inflight=inflight)
        loads.record_running_slots(w.id, 10)
        m = Metrics()
        m.add_demand_source(lambda w=w: demand_rows([w], loads, now=NOW))  # type: ignore[misc]
        texts.append(m.exposition())
    pod = merge_expositions(texts).decode()
    assert 'smg_model_requests_inflight{model="m",role="regular"} 7.0' in pod
    assert 'smg_model_prompt_tokens_inflight{model="m",role="regular"} 70.0' in pod
    assert 'smg_model_saturation{model="m",role="regular"} 0.7' in pod
    assert 'smg_model_workers{model="m",role="regular",state="routable"} 1.0' in pod
