"""Every metric the router exports, under the names of DESIGN 2.8; nothing else imports prometheus_client.

Each router app owns its own ``CollectorRegistry`` (several routers can live in one test process).
Tree sizes are read at scrape time from a callback, so the request path never touches that gauge and a
removed worker's series disappears with its tenant.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TreeSizeSource = Callable[[], Iterable[tuple[str, str, str, int]]]
"""Yields (model, role, worker, chars) for every tenant of every tree."""
TreeBytesSource = Callable[[], Iterable[tuple[str, str, int]]]
"""Yields (model, role, estimated bytes) for every (model, policy slot) holding trees."""

disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped in prometheus_client; the *_created series double the exposition and no dashboard reads them

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_DECISION_BUCKETS = (1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 0.01)
_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class _TreeSizeCollector(Collector):
    def __init__(self, source: TreeSizeSource) -> None:
        self._source = source

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "smg_cache_tree_size_chars",
            "Characters each worker holds in a cache-aware tree",
            labels=("model", "role", "worker"),
        )
        for model, role, worker, chars in self._source():
            family.add_metric((model, role, worker), chars)
        yield family


class _TreeBytesCollector(Collector):
    def __init__(self, source: TreeBytesSource) -> None:
        self._source = source

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "smg_cache_tree_bytes",
            "Estimated memory of the cache-aware trees (their sum is what --tree-memory-budget bounds)",
            labels=("model", "role"),
        )
        for model, role, n in self._source():
            family.add_metric((model, role), n)
        yield family


M = TypeVar("M", Counter, Gauge, Histogram)


class Family(Generic[M]):
    """A labelled metric whose children are resolved once per label values: ``labels`` is a dict lookup
    on the request path, where prometheus_client's validates and converts the values and takes a lock on
    every call (several per request, ~1-2 us each).  Same names, same exposition; ``remove`` drops both."""

    __slots__ = ("_children", "metric")

    def __init__(self, metric: M) -> None:
        self.metric: M = metric
        self._children: dict[tuple[str, ...], M] = {}

    def labels(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child

    def remove(self, *values: str) -> None:
        """KeyError when there is no such series (as prometheus_client's)."""
        self._children.pop(values, None)
        self.metric.remove(*values)

    def remove_by_labels(self, labels: dict[str, str]) -> None:
        names = self.metric._labelnames  # prometheus_client keeps no public accessor
        wanted = [(names.index(k), v) for k, v in labels.items()]
        for values in [v for v in self._children if all(v[i] == want for i, want in wanted)]:
            del self._children[values]
        self.metric.remove_by_labels(labels)


class Metrics:
    """The router's metrics.  Label values are server-controlled and bounded (workers leave with their series)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.cache_hits = Family(
            Counter(
                "smg_cache_tree_hits",
                "Cache-aware decisions that matched a tree prefix above the threshold",
                ("model", "role"),
                registry=r,
            )
        )
        self.cache_misses = Family(
            Counter(
                "smg_cache_tree_misses",
                "Cache-aware decisions below the match threshold",
                ("model", "role"),
                registry=r,
            )
        )
        self.decisions = Family(
            Counter(
                "smg_routing_decisions",
                "Routing decisions by branch: session (a session key pinned it, any policy), stored (the "
                "worker that stored the previous response), and cache-aware ones: hit (a holder of the deepest "
                "match), miss (placed by rendezvous hashing), namespace (a miss in a cache namespace: "
                "cache_salt, LoRA), spill (every holder over the load gate; placed by rendezvous among the "
                "others), warmup (a hit sent to a warming worker that rendezvous places it on)",
                ("model", "role", "branch"),
                registry=r,
            )
        )
        self.matched_chars = Family(
            Counter(
                "smg_routing_matched_chars",
                "Prefix chars cache-aware routing found in the tree: of=fleet the deepest match any worker holds, "
                "of=chosen the part of it the chosen worker holds (hits; placed requests only when placement chose "
                "a holder); their ratio is what load gating and warm-up cost in reuse",
                ("model", "role", "of"),
                registry=r,
            )
        )
        self.fallbacks = Family(
            Counter(
                "smg_routing_fallbacks",
                "Decisions that did not follow the policy's main rule",
                ("model", "role", "policy", "reason"),
                registry=r,
            )
        )
        self.match_ratio = Family(
            Histogram(
                "smg_prefix_match_ratio",
                "Matched characters / routing text length",
                ("model", "role"),
                buckets=_RATIO_BUCKETS,
                registry=r,
            )
        )
        self.evictions = Family(
            Counter(
                "smg_cache_tree_evictions", "Characters evicted from cache-aware trees", ("model", "role"), registry=r
            )
        )
        self.decision_seconds = Family(
            Histogram(
                "smg_routing_decision_seconds",
                "Time to choose a worker",
                ("policy",),
                buckets=_DECISION_BUCKETS,
                registry=r,
            )
        )
        self.requests = Family(
            Counter("smg_requests", "Requests answered by the router", ("endpoint", "model", "status"), registry=r)
        )
        self.request_seconds = Family(
            Histogram(
                "smg_request_duration_seconds",
                "Request duration, end to end",
                ("endpoint", "model"),
                buckets=_LATENCY_BUCKETS,
                registry=r,
            )
        )
        self.ttft_seconds = Family(
            Histogram(
                "smg_time_to_first_token_seconds",
                "Time to the first streamed byte",
                ("endpoint", "model"),
                buckets=_LATENCY_BUCKETS,
                registry=r,
            )
        )
        self.worker_inflight = Family(
            Gauge(
                "smg_worker_inflight",
                "Requests this router has in flight to the worker",
                ("worker", "role"),
                registry=r,
            )
        )
        self.worker_backend_load = Family(
            Gauge(
                "smg_worker_backend_load",
                "Running + waiting requests the worker reported at the last poll",
                ("worker", "role"),
                registry=r,
            )
        )
        self.worker_healthy = Family(
            Gauge(
                "smg_worker_healthy",
                "1 when the worker passes its health checks (status ready)",
                ("worker", "role"),
                registry=r,
            )
        )
        self.lifecycle_events = Family(
            Counter(
                "smg_worker_lifecycle_events", "Worker registrations, updates, removals", ("event", "role"), registry=r
            )
        )
        self.pd_requests = Family(Counter("smg_pd_requests", "Prefill/decode dual dispatches", ("status",), registry=r))
        self.retries = Family(Counter("smg_retries", "Attempts retried on another worker", ("endpoint",), registry=r))
        self.requests_rejected = Family(
            Counter("smg_requests_rejected", "Requests refused before routing (admission)", ("reason",), registry=r)
        )
        self.loop_lag = Histogram(
            "smg_event_loop_lag_seconds",
            "How late the event loop ran a timer: time during which no request, stream or poll made progress",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.worker_poll_errors = Family(
            Counter(
                "smg_worker_poll_errors",
                "Load polls of the worker that gave no load, by kind "
                "(timeout, connect, http_status, bad_payload, error)",
                ("worker", "kind"),
                registry=r,
            )
        )

    def add_tree_size_source(self, source: TreeSizeSource) -> None:
        self.registry.register(_TreeSizeCollector(source))

    def add_tree_bytes_source(self, source: TreeBytesSource) -> None:
        self.registry.register(_TreeBytesCollector(source))

    def forget_worker(self, worker: str, role: str) -> None:
        """Drop a removed worker's per-worker series so label values stay bounded."""
        for gauge in (self.worker_inflight, self.worker_backend_load, self.worker_healthy):
            with contextlib.suppress(KeyError):
                gauge.remove(worker, role)
        self.worker_poll_errors.remove_by_labels({"worker": worker})

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
