"""Metric children resolved once per label values (``metrics.Family``): the same series as prometheus_client's,
and a removed worker's series really gone, coming back from zero if the worker does."""

from __future__ import annotations

from smg_router.metrics import Metrics


def _value(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_a_cached_child_is_the_series_prometheus_exposes() -> None:
    m = Metrics()
    for _ in range(3):
        m.requests.labels("/v1/completions", "m", "200").inc()
    assert m.requests.labels("/v1/completions", "m", "200") is m.requests.labels("/v1/completions", "m", "200")
    assert _value(m, "smg_requests_total", endpoint="/v1/completions", model="m", status="200") == 3
    m.request_seconds.labels("/v1/completions", "m").observe(0.2)
    assert _value(m, "smg_request_duration_seconds_count", endpoint="/v1/completions", model="m") == 1


def test_a_forgotten_worker_leaves_every_series_and_a_returning_one_starts_from_zero() -> None:
    m = Metrics()
    url = "http://127.0.0.2:8000"
    m.worker_inflight.labels(url, "regular").set(5)
    m.worker_poll_errors.labels(url, "timeout").inc(2)
    m.worker_poll_errors.labels("http://127.0.0.3:8000", "timeout").inc()
    m.forget_worker(url, "regular")
    text = m.exposition().decode()
    assert url not in text and "127.0.0.3" in text  # only the forgotten worker's series went
    m.worker_poll_errors.labels(url, "timeout").inc()  # the same URL registered again
    m.worker_inflight.labels(url, "regular").set(1)
    assert _value(m, "smg_worker_poll_errors_total", worker=url, kind="timeout") == 1
    assert _value(m, "smg_worker_inflight", worker=url, role="regular") == 1
