"""Micro-benchmark of the metric calls on the request path: prometheus_client's children (what the router used
as it was: a dict of cached children, then prometheus_client's ``inc``/``observe``/``set``) against the
router's own series (``smg_router.metrics``), in one run, same label values, same buckets.

Usage (from the repository root):  .venv/bin/python bench/micro_metrics.py [--number 200000] [--repeat 7]

Prints the best of --repeat runs, in ns per call, of ``labels(...).inc()``, ``labels(...).observe(v)`` (a value
in the 7th latency bucket, and one past the last finite bound: prometheus_client's loop walks every bucket) and
``labels(...).set(v)``.  Best-of, because the machine is shared: the minimum is the least disturbed figure.
"""

from __future__ import annotations

import argparse
import timeit
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from smg_router.metrics import _LATENCY_BUCKETS, Metrics


class _CachedChildren:
    """The router's ``Family`` as it was: prometheus_client children cached by label values."""

    def __init__(self, metric: Any) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child


def _before() -> dict[str, Any]:
    r = CollectorRegistry()
    return {
        "requests": _CachedChildren(Counter("smg_requests", "x", ("endpoint", "model", "status"), registry=r)),
        "request_seconds": _CachedChildren(
            Histogram("smg_request_duration_seconds", "x", ("endpoint", "model"), buckets=_LATENCY_BUCKETS, registry=r)
        ),
        "worker_inflight": _CachedChildren(Gauge("smg_worker_inflight", "x", ("worker", "role"), registry=r)),
    }


def _after() -> dict[str, Any]:
    m = Metrics()
    return {"requests": m.requests, "request_seconds": m.request_seconds, "worker_inflight": m.worker_inflight}


CALLS = {
    "labels(3).inc()": 'requests.labels("/v1/chat/completions", "llama", "200").inc()',
    "labels(2).observe(0.3)": 'request_seconds.labels("/v1/chat/completions", "llama").observe(0.3)',
    "labels(2).observe(200)": 'request_seconds.labels("/v1/chat/completions", "llama").observe(200.0)',
    "labels(2).set(3)": 'worker_inflight.labels("http://10.0.0.1:8000", "regular").set(3)',
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=200_000, help="calls per timing")
    parser.add_argument("--repeat", type=int, default=7, help="timings; the best is reported")
    args = parser.parse_args()
    layers = {"before": _before(), "after": _after()}
    print(f"{'call':<26}{'before ns':>11}{'after ns':>11}{'ratio':>8}")
    for label, stmt in CALLS.items():
        ns = {}
        for name, env in layers.items():
            times = timeit.repeat(stmt, globals=env, number=args.number, repeat=args.repeat)
            ns[name] = min(times) / args.number * 1e9
        print(f"{label:<26}{ns['before']:>11.0f}{ns['after']:>11.0f}{ns['before'] / ns['after']:>7.1f}x")


if __name__ == "__main__":
    main()
