"""The pod's ``/metrics`` (``--processes``): every process's exposition merged into one, the format unchanged."""

from __future__ import annotations

from smg_router.metrics import COUNTER_MERGE, GAUGE_MERGE, Metrics, merge_expositions
from smg_router.workers.demand import ModelDemand
from support.procs import metric_value


def _process(requests: int, inflight: float, healthy: float, lag: float, *, extra: bool = False) -> Metrics:
    m = Metrics()
    m.requests.labels("/v1/completions", "m", "200").inc(requests)
    m.request_seconds.labels("/v1/completions", "m").observe(0.02)
    m.worker_inflight.labels("http://w", "regular").set(inflight)
    m.worker_healthy.labels("http://w", "regular").set(healthy)
    m.worker_backend_load.labels("http://w", "regular").set(7)
    m.loop_lag.observe(lag)
    m.lifecycle_events.labels("added", "regular").inc()  # the parent applied one change to each process
    if extra:
        m.requests.labels("/v1/completions", "m", "503").inc()
    return m


def test_one_exposition_comes_out_byte_for_byte() -> None:
    text = _process(3, 1, 1, 0.001, extra=True).exposition()
    assert merge_expositions([text]) == text


def test_counters_and_histograms_add_up_and_each_gauge_merges_by_its_rule() -> None:
    a, b = _process(3, 1, 1, 0.001), _process(4, 2, 0, 0.2, extra=True)
    merged = merge_expositions([a.exposition(), b.exposition()]).decode()
    assert metric_value(merged, "smg_requests_total", status="200") == 7
    assert metric_value(merged, "smg_requests_total", status="503") == 1  # a series only one process has
    assert metric_value(merged, "smg_request_duration_seconds_count") == 2
    assert metric_value(merged, "smg_request_duration_seconds_bucket", le="0.025") == 2
    assert metric_value(merged, "smg_event_loop_lag_seconds_bucket", le="0.001") == 1
    assert metric_value(merged, "smg_event_loop_lag_seconds_bucket", le="+Inf") == 2
    assert metric_value(merged, "smg_worker_inflight") == 3  # summed: the pod's requests in flight
    assert metric_value(merged, "smg_worker_healthy") == 0  # healthy only when healthy in every process
    assert metric_value(merged, "smg_worker_backend_load") == 7  # the same engine's figure, not twice it
    assert metric_value(merged, "smg_worker_lifecycle_events_total", event="added") == 1  # one change, not two
    assert merged.count("# TYPE smg_requests_total counter") == 1
    names = [line.split()[2] for line in merged.splitlines() if line.startswith("# TYPE")]
    assert names == [line.split()[2] for line in a.exposition().decode().splitlines() if line.startswith("# TYPE")]
    lines = merged.splitlines()
    first_503 = next(i for i, line in enumerate(lines) if 'status="503"' in line)
    assert lines[first_503 - 1].startswith("smg_requests_total{")  # after the other series of its family


def test_every_gauge_of_the_router_has_a_merge_rule() -> None:
    m = Metrics()
    m.add_tree_size_source(lambda: [("m", "regular", "http://w", 1)])
    m.add_tree_bytes_source(lambda: [("m", "regular", 1)])
    m.add_peers_in_sync_source(lambda: 1.0)
    m.add_kv_index_sources(lambda: [("m", 1)], lambda: [("m", "http://w", 1)])
    m.add_demand_source(lambda: [("m", "regular", ModelDemand(inflight=1, backlog=1, capacity=2, routable=1))])
    gauges = {line.split()[2] for line in m.exposition().decode().splitlines() if line.endswith(" gauge")}
    assert gauges == set(GAUGE_MERGE)


def test_the_counters_merged_otherwise_are_the_router_s() -> None:
    counters = {line.split()[2] for line in Metrics().exposition().decode().splitlines() if line.endswith(" counter")}
    assert set(COUNTER_MERGE) <= counters
