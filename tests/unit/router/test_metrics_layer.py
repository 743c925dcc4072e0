"""The router's own metric series (``smg_router.metrics``) expose exactly what plain prometheus_client metrics
of the same definitions expose after the same operations: same bytes, so the same names, suffixes, bucket
edges (``le`` inclusive), sums, label order and series order.  The reference is built here from each family's
name, help, label names and buckets, with prometheus_client's own ``Counter``/``Gauge``/``Histogram``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from smg_router.metrics import CounterFamily, GaugeFamily, HistogramFamily, Metrics

Op = Callable[[Any], None]
"""One operation, applied alike to a ``Metrics`` and to a ``Reference`` (same attribute names)."""


class Reference:
    """Plain prometheus_client metrics with the definitions of a ``Metrics``, attribute for attribute."""

    def __init__(self, m: Metrics) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        for attr, family in vars(m).items():
            if isinstance(family, CounterFamily):
                metric: Any = Counter(family.name, family.documentation, family.labelnames, registry=self.registry)
            elif isinstance(family, GaugeFamily):
                metric = Gauge(family.name, family.documentation, family.labelnames, registry=self.registry)
            elif isinstance(family, HistogramFamily):
                metric = Histogram(
                    family.name,
                    family.documentation,
                    family.labelnames,
                    buckets=family._bounds,
                    registry=self.registry,
                )
            else:
                continue
            setattr(self, attr, metric)
        self.loop_lag = self.loop_lag_family  # unlabelled: the metric is its own series

    def forget_worker(self, worker: str, role: str) -> None:
        for gauge in (self.worker_inflight, self.worker_backend_load, self.worker_kv_capacity, self.worker_healthy):
            gauge.remove(worker, role)
        self.worker_poll_errors.remove_by_labels({"worker": worker})

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def _both(ops: list[Op]) -> tuple[str, str]:
    m = Metrics()
    ref = Reference(m)
    for op in ops:
        op(m)
        op(ref)
    return m.exposition().decode(), ref.exposition().decode()


W1, W2 = "http://10.0.0.1:8000", "http://10.0.0.2:8000"

SCRIPT: list[Op] = [
    # counters: default and explicit amounts, several series in a family, a float amount
    lambda m: m.requests.labels("/v1/chat/completions", "llama", "200").inc(),
    lambda m: m.requests.labels("/v1/chat/completions", "llama", "200").inc(),
    lambda m: m.requests.labels("/v1/completions", "llama", "503").inc(3),
    lambda m: m.matched_chars.labels("llama", "regular", "fleet").inc(1234),
    lambda m: m.matched_chars.labels("llama", "regular", "chosen").inc(0.5),
    lambda m: m.decisions.labels("llama", "regular", "hit").inc(),
    lambda m: m.fallbacks.labels("llama", "prefill", "cache_aware", "no_load_data").inc(),
    lambda m: m.evictions.labels("llama", "regular").inc(0),
    # histograms: values on every kind of edge (exactly a bound, just above, below the first, above the last)
    lambda m: m.request_seconds.labels("/v1/chat/completions", "llama").observe(0.005),  # == first bound
    lambda m: m.request_seconds.labels("/v1/chat/completions", "llama").observe(0.0050001),
    lambda m: m.request_seconds.labels("/v1/chat/completions", "llama").observe(1),  # an int, == bound 1
    lambda m: m.request_seconds.labels("/v1/chat/completions", "llama").observe(0.0),
    lambda m: m.request_seconds.labels("/v1/chat/completions", "llama").observe(300),  # == last finite bound
    lambda m: m.request_seconds.labels("/v1/chat/completions", "llama").observe(300.5),  # +Inf only
    lambda m: m.request_seconds.labels("/v1/chat/completions", "llama").observe(math.inf),
    lambda m: m.ttft_seconds.labels("/v1/chat/completions", "llama").observe(0.1),
    lambda m: m.match_ratio.labels("llama", "regular").observe(0.0),  # the first bound is 0.0
    lambda m: m.match_ratio.labels("llama", "regular").observe(1.0),
    lambda m: m.match_ratio.labels("llama", "regular").observe(0.95),
    lambda m: m.match_ratio.labels("llama", "regular").observe(0.3333),
    lambda m: m.match_ratio.labels("llama", "regular").observe(-0.1),  # below every bound: the first bucket
    lambda m: m.decision_seconds.labels("cache_aware").observe(1e-6),
    lambda m: m.decision_seconds.labels("cache_aware").observe(2.5e-5),
    lambda m: m.decision_seconds.labels("round_robin").observe(0.0100000001),
    lambda m: m.loop_lag.observe(0.0025),
    lambda m: m.loop_lag.observe(0.0),
    lambda m: m.loop_lag.observe(7.0),
    # gauges: set (int, float, bool), inc, dec
    lambda m: m.worker_inflight.labels(W1, "regular").set(5),
    lambda m: m.worker_inflight.labels(W1, "regular").inc(),
    lambda m: m.worker_inflight.labels(W1, "regular").dec(2),
    lambda m: m.worker_inflight.labels(W2, "regular").set(0.25),
    lambda m: m.worker_backend_load.labels(W1, "regular").set(17),
    lambda m: m.worker_backend_load.labels(W2, "regular").set(-3),
    lambda m: m.worker_healthy.labels(W1, "regular").set(True),
    lambda m: m.worker_healthy.labels(W2, "regular").set(0),
    lambda m: m.worker_poll_errors.labels(W1, "timeout").inc(),
    lambda m: m.worker_poll_errors.labels(W1, "connect").inc(2),
    lambda m: m.worker_poll_errors.labels(W2, "timeout").inc(),
    lambda m: m.lifecycle_events.labels("registered", "regular").inc(),
    # removal: one series; a missing one (no error); a partial match; a whole worker; a worker that comes back
    lambda m: m.requests.remove("/v1/completions", "llama", "503"),
    lambda m: m.requests.remove("/v1/completions", "llama", "418"),
    lambda m: m.fallbacks.remove_by_labels({"role": "prefill"}),
    lambda m: m.worker_poll_errors.remove_by_labels({}),
    lambda m: m.forget_worker(W1, "regular"),
    lambda m: m.forget_worker("http://never.seen:1", "decode"),
    lambda m: m.worker_inflight.labels(W1, "regular").inc(),  # back, after W2's series
    lambda m: m.worker_poll_errors.labels(W1, "timeout").inc(),
    lambda m: m.requests.labels("/v1/completions", "llama", "503").inc(),  # back from zero, last
    lambda m: m.pd_requests.labels("ok").inc(),
    lambda m: m.retries.labels("/v1/chat/completions", "retried").inc(),
    lambda m: m.retries.labels("/v1/chat/completions", "budget_exhausted").inc(),
    lambda m: m.breaker_panics.labels("llama", "regular").inc(),
    lambda m: m.requests_rejected.labels("queue_full").inc(),
]


def test_a_fresh_router_exposes_what_prometheus_client_did() -> None:
    ours, reference = _both([])
    assert ours == reference
    assert 'smg_event_loop_lag_seconds_bucket{le="+Inf"} 0.0' in ours  # the unlabelled histogram, at zero
    assert "_created" not in ours


def test_a_scripted_sequence_exposes_the_same_text_as_prometheus_client() -> None:
    ours, reference = _both(SCRIPT)
    assert ours.splitlines() == reference.splitlines()  # same lines, same order
    # a few lines spelled out, so the test does not only trust the reference
    assert 'smg_requests_total{endpoint="/v1/chat/completions",model="llama",status="200"} 2.0' in ours
    # (prometheus_client 0.26 writes the labels of a sample sorted by name, ``le`` among them)
    b = 'smg_request_duration_seconds_bucket{endpoint="/v1/chat/completions",le="%s",model="llama"}'
    assert f"{b % '0.005'} 2.0" in ours  # 0.0 and the bound itself
    assert f"{b % '0.01'} 3.0" in ours
    assert f"{b % '300.0'} 5.0" in ours
    assert f"{b % '+Inf'} 7.0" in ours
    chat = 'endpoint="/v1/chat/completions",model="llama"'
    assert f"smg_request_duration_seconds_count{{{chat}}} 7.0" in ours
    assert f"smg_request_duration_seconds_sum{{{chat}}} +Inf" in ours
    assert 'smg_prefix_match_ratio_bucket{le="0.0",model="llama",role="regular"} 2.0' in ours
    assert "# TYPE smg_worker_inflight gauge" in ours and "# TYPE smg_requests_total counter" in ours
    assert f'smg_worker_inflight{{role="regular",worker="{W1}"}} 1.0' in ours
    assert 'role="prefill"' not in ours and 'kind="connect"' not in ours


def test_nan_joins_the_sum_but_no_bucket_as_in_prometheus_client() -> None:
    ours, reference = _both([lambda m: m.loop_lag.observe(math.nan), lambda m: m.loop_lag.observe(0.01)])
    assert ours == reference
    assert "smg_event_loop_lag_seconds_count 1.0" in ours


def test_errors_are_prometheus_client_s() -> None:
    m = Metrics()
    with pytest.raises(ValueError, match="non-negative"):
        m.requests.labels("/v1/completions", "m", "200").inc(-1)
    with pytest.raises(ValueError, match="label count"):
        m.requests.labels("/v1/completions", "m")
    with pytest.raises(ValueError, match="label count"):
        m.worker_inflight.remove(W1)
    with pytest.raises(ValueError, match="Unknown label names"):
        m.worker_poll_errors.remove_by_labels({"role": "regular"})
    with pytest.raises(ValueError, match="sorted"):
        HistogramFamily("x_seconds", "x", (), buckets=(2, 1), registry=CollectorRegistry())


def test_label_values_are_strings_as_prometheus_client_makes_them() -> None:
    m = Metrics()
    series = m.pd_requests.labels(200)  # type: ignore[arg-type]  # no call site does; prometheus_client str()s it
    series.inc()
    assert m.pd_requests.labels("200") is series
    assert m.registry.get_sample_value("smg_pd_requests_total", {"status": "200"}) == 1
    m.pd_requests.remove(200)  # type: ignore[arg-type]
    assert m.registry.get_sample_value("smg_pd_requests_total", {"status": "200"}) is None


def test_families_lists_every_metric_in_exposition_order() -> None:
    m = Metrics()
    names = [f.name for f in m.families]
    exposed = [line.split()[2] for line in m.exposition().decode().splitlines() if line.startswith("# TYPE")]
    assert [n.removesuffix("_total") for n in exposed] == names
    assert len(names) == len(set(names)) == 37


_value = st.one_of(
    st.sampled_from([0.0, 0.005, 0.01, 0.1, 0.25, 0.5, 1.0, 0.95, 1e-6, 5e-3, 300.0, 301.0, math.inf]),
    st.floats(min_value=-1.0, max_value=400.0, allow_nan=False),
)
_worker = st.sampled_from([W1, W2, "http://10.0.0.3:8000"])
_op = st.one_of(
    st.builds(lambda v: lambda m: m.request_seconds.labels("/v1/completions", "m").observe(v), _value),
    st.builds(lambda v: lambda m: m.match_ratio.labels("m", "regular").observe(v), _value),
    st.builds(lambda v: lambda m: m.decision_seconds.labels("cache_aware").observe(v), _value),
    st.builds(lambda v: lambda m: m.loop_lag.observe(v), _value),
    st.builds(lambda w, n: lambda m: m.worker_poll_errors.labels(w, "timeout").inc(n), _worker, st.integers(0, 5)),
    st.builds(lambda w, v: lambda m: m.worker_inflight.labels(w, "regular").set(v), _worker, st.integers(0, 9)),
    st.builds(lambda w: lambda m: m.worker_inflight.labels(w, "regular").inc(), _worker),
    st.builds(lambda w: lambda m: m.worker_inflight.labels(w, "regular").dec(), _worker),
    st.builds(lambda w: lambda m: m.worker_backend_load.labels(w, "decode").set(3.5), _worker),
    st.builds(lambda w: lambda m: m.worker_kv_capacity.labels(w, "regular").set(8192), _worker),
    st.builds(lambda w: lambda m: m.forget_worker(w, "regular"), _worker),
    st.builds(lambda w: lambda m: m.worker_inflight.remove(w, "regular"), _worker),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_op, max_size=40))
def test_random_sequences_expose_the_same_text_as_prometheus_client(ops: list[Op]) -> None:
    ours, reference = _both(ops)
    assert ours == reference
