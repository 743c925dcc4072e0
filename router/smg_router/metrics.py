"""Every metric the router exports (docs/metrics.md); nothing else imports prometheus_client.

The series the request path touches are our own: plain float fields behind ``__slots__``, no lock (the router
is single-threaded asyncio) and a histogram that finds its bucket with one ``bisect`` and accumulates the
cumulative counts only at scrape time.  prometheus_client's children took a ``threading.Lock`` per value and
looped over every bucket in Python: ~6% of the router's busy CPU under load (`bench/profile_proxy.py`).
Each family is a collector that yields prometheus_client's ``*MetricFamily`` objects at scrape time, so
``generate_latest`` still formats the exposition: the same names, help texts, types, label order and text (``_total``,
``_bucket{le=...}``, ``_count``, ``_sum``; no ``*_created``).  tests/unit/router/test_metrics_layer.py compares
it, byte for byte, with plain prometheus_client metrics fed the same operations.

Each router app owns its own ``CollectorRegistry`` (several routers can live in one test process).
Tree sizes are read at scrape time from a callback, so the request path never touches that gauge and a
removed worker's series disappears with its tenant.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import INF, floatToGoString

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TreeSizeSource = Callable[[], Iterable[tuple[str, str, str, int]]]
"""Yields (model, role, worker, chars) for every tenant of every tree."""
TreeBytesSource = Callable[[], Iterable[tuple[str, str, int]]]
"""Yields (model, role, estimated bytes) for every (model, policy slot) holding trees."""
DemandSource = Callable[[], Iterable[tuple[str, str, "Demand"]]]
"""Yields (model, role, its demand) for every (model, role) with a registered worker."""

# Our families never yield *_created; this keeps prometheus_client's own metrics in the process (the test's
# reference) the same.  Untyped in prometheus_client.
disable_created_metrics()  # type: ignore[no-untyped-call]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_DECISION_BUCKETS = (1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 0.01)
_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class CounterSeries:
    """One counter series: prometheus_client's ``Counter`` child without its lock and observability check."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount


class GaugeSeries:
    """One gauge series."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value += -amount  # as prometheus_client (inc of -amount)

    def set(self, value: float) -> None:
        self.value = float(value)


class HistogramSeries:
    """One histogram series: a count per bucket (not cumulative) and the sum.

    ``le`` is inclusive, as prometheus_client's loop (``amount <= bound``): ``bisect_left`` gives the first
    bound >= the value; the last bound is +Inf.  NaN falls in no bucket but joins the sum, as there."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.sum += value
        if value == value:  # not NaN
            self.counts[bisect_left(self._bounds, value)] += 1


S = TypeVar("S", CounterSeries, GaugeSeries, HistogramSeries)


class Family(Generic[S]):
    """A metric's series by label values, and the collector that exposes them at scrape time.

    ``labels`` is one dict lookup on the request path; label values are converted with ``str`` and counted
    only when a series is created, as prometheus_client does on every call.  Series keep their creation order
    (a removed one that comes back goes last), as prometheus_client's do.  No lock: the router updates and
    scrapes its metrics on the event loop's thread only."""

    __slots__ = ("_series", "documentation", "labelnames", "name")

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], *, registry: CollectorRegistry
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], S] = {}
        registry.register(self)

    def labels(self, *values: str) -> S:
        series = self._series.get(values)
        if series is None:
            series = self._create(values)
        return series

    def _create(self, values: tuple[str, ...]) -> S:
        if len(values) != len(self.labelnames):
            raise ValueError(f"Incorrect label count (expected {len(self.labelnames)}, got {values})")
        key = tuple(str(v) for v in values)
        series = self._series.get(key)  # values given as non-str (200) land on the series of their str()
        if series is None:
            series = self._series[key] = self._new()
        return series

    def remove(self, *values: str) -> None:
        """Drop one series; none to drop is no error (as prometheus_client 0.26's ``remove``)."""
        if len(values) != len(self.labelnames):
            raise ValueError(f"Incorrect label count (expected {len(self.labelnames)}, got {values})")
        self._series.pop(tuple(str(v) for v in values), None)

    def remove_by_labels(self, labels: dict[str, str]) -> None:
        """Drop every series whose label values include ``labels`` (as prometheus_client's)."""
        if not labels:
            return
        invalid = [k for k in labels if k not in self.labelnames]
        if invalid:
            raise ValueError(f"Unknown label names: {invalid}; expected {self.labelnames}")
        wanted = [(self.labelnames.index(k), str(v)) for k, v in labels.items()]
        for key in [key for key in self._series if all(key[i] == want for i, want in wanted)]:
            del self._series[key]

    def describe(self) -> Iterable[Metric]:
        """The family without samples: the registry reads its names from it (duplicate check)."""
        return [self._family()]

    def collect(self) -> Iterable[Metric]:
        raise NotImplementedError

    def _new(self) -> S:
        raise NotImplementedError

    def _family(self) -> Metric:
        raise NotImplementedError


class CounterFamily(Family[CounterSeries]):
    __slots__ = ()

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        for key, series in self._series.items():
            family.add_metric(key, series.value)
        return [family]

    def _new(self) -> CounterSeries:
        return CounterSeries()

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)


class GaugeFamily(Family[GaugeSeries]):
    __slots__ = ()

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        for key, series in self._series.items():
            family.add_metric(key, series.value)
        return [family]

    def _new(self) -> GaugeSeries:
        return GaugeSeries()

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)


class HistogramFamily(Family[HistogramSeries]):
    """Buckets as prometheus_client's ``Histogram`` takes them (sorted; +Inf added when missing)."""

    __slots__ = ("_bounds", "_les")

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds):
            raise ValueError("Buckets not in sorted order")
        if bounds and bounds[-1] != INF:
            bounds.append(INF)
        if len(bounds) < 2:
            raise ValueError("Must have at least two buckets")
        if bounds[0] < 0:  # HistogramMetricFamily would drop _count and _sum, prometheus_client's Histogram only _sum
            raise ValueError("Negative buckets are not supported")
        self._bounds = tuple(bounds)
        self._les = tuple(floatToGoString(b) for b in bounds)  # type: ignore[no-untyped-call]
        super().__init__(name, documentation, labelnames, registry=registry)

    def collect(self) -> Iterable[Metric]:
        """Cumulative counts, as prometheus_client sums them (a float accumulator, +Inf last = the count)."""
        family = self._family()
        for key, series in self._series.items():
            acc = 0.0
            buckets: list[tuple[str, float]] = []
            for le, n in zip(self._les, series.counts, strict=True):
                acc += n
                buckets.append((le, acc))
            family.add_metric(key, buckets, series.sum)
        return [family]

    def _new(self) -> HistogramSeries:
        return HistogramSeries(self._bounds)

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)


class _TreeSizeCollector:
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


class _LabelledGauge:
    """A gauge read at scrape time from ``source``: (label values, value) pairs."""

    def __init__(
        self, name: str, documentation: str, labels: tuple[str, ...], source: Callable[[], Iterable[tuple[Any, ...]]]
    ) -> None:
        self._args = (name, documentation)
        self._labels = labels
        self._source = source

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(*self._args, labels=self._labels)
        for *values, n in self._source():
            family.add_metric(tuple(values), n)
        yield family


class _TreeBytesCollector:
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


class Demand(Protocol):
    """What the demand gauges read of one (model, role) (``workers.demand.ModelDemand``)."""

    @property
    def inflight(self) -> int: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def saturation(self) -> float | None: ...
    @property
    def routable(self) -> int: ...
    @property
    def unroutable(self) -> int: ...


class _DemandCollector:
    """The autoscaling signals per model and role (docs/autoscaling.md), read at scrape time from ``source``."""

    def __init__(self, source: DemandSource) -> None:
        self._source = source

    def collect(self) -> Iterable[GaugeMetricFamily]:
        labels = ("model", "role")
        inflight = GaugeMetricFamily(
            "smg_model_requests_inflight",
            "Requests this router has in flight to the workers of the model and role (those held behind a first "
            "prefill included; not those waiting for a worker, smg_model_requests_waiting)",
            labels=labels,
        )
        tokens = GaugeMetricFamily(
            "smg_model_prompt_tokens_inflight",
            "Prompt tokens of those requests: counted where the router knows them (--tokenizer, token prompts), "
            "else the prompt's chars over --tree-chars-per-token, rounded up",
            labels=labels,
        )
        saturation = GaugeMetricFamily(
            "smg_model_saturation",
            "Backlog over capacity, 0..1+: the routable workers' running + waiting requests (their engines' polled "
            "figures, else this router's in-flight) over their engines' running slots; 1 with a backlog and no "
            "routable worker; no sample while no routable worker's slots are known",
            labels=labels,
        )
        workers = GaugeMetricFamily(
            "smg_model_workers",
            "Registered workers of the model and role, by state: routable (ready, breaker closed) or unroutable",
            labels=(*labels, "state"),
        )
        for model, role, d in self._source():
            inflight.add_metric((model, role), d.inflight)
            tokens.add_metric((model, role), d.prompt_tokens)
            value = d.saturation
            if value is not None:
                saturation.add_metric((model, role), value)
            workers.add_metric((model, role, "routable"), d.routable)
            workers.add_metric((model, role, "unroutable"), d.unroutable)
        yield from (inflight, tokens, saturation, workers)


class _ScrapeGauge:
    """One unlabelled gauge read at scrape time; no sample while its source has no value."""

    def __init__(self, name: str, documentation: str, source: Callable[[], float | None]) -> None:
        self._name, self._doc, self._source = name, documentation, source

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(self._name, self._doc)
        value = self._source()
        if value is not None:
            family.add_metric((), value)
        yield family


class Metrics:
    """The router's metrics.  Label values are server-controlled and bounded (workers leave with their series)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.cache_hits = CounterFamily(
            "smg_cache_tree_hits",
            "Cache-aware decisions that matched a tree prefix above the threshold",
            ("model", "role"),
            registry=r,
        )
        self.cache_misses = CounterFamily(
            "smg_cache_tree_misses",
            "Cache-aware decisions below the match threshold",
            ("model", "role"),
            registry=r,
        )
        self.decisions = CounterFamily(
            "smg_routing_decisions",
            "Routing decisions by branch: session (a session key pinned it, any policy), stored (the "
            "worker that stored the previous response), and cache-aware ones: hit (a holder of the deepest "
            "match), miss (placed by rendezvous hashing), namespace (a miss in a cache namespace: "
            "cache_salt, LoRA), spill (every holder over the load gate; placed by rendezvous among the "
            "others)",
            ("model", "role", "branch"),
            registry=r,
        )
        self.matched_chars = CounterFamily(
            "smg_routing_matched_chars",
            "Prefix chars cache-aware routing found in the tree: of=fleet the deepest match any worker holds, "
            "of=chosen the part of it the chosen worker holds (hits; placed requests only when placement chose "
            "a holder); their ratio is what load gating and warm-up cost in reuse",
            ("model", "role", "of"),
            registry=r,
        )
        self.fallbacks = CounterFamily(
            "smg_routing_fallbacks",
            "Decisions that did not follow the policy's main rule",
            ("model", "role", "policy", "reason"),
            registry=r,
        )
        self.match_ratio = HistogramFamily(
            "smg_prefix_match_ratio",
            "Matched characters / routing text length",
            ("model", "role"),
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.prefill_holds = CounterFamily(
            "smg_prefill_holds",
            "Requests held back until the first request of a burst on the same new prefix, sent to the same worker, "
            "had its prefill done, or on a slot engine until the request on the same prompt before it ended "
            "(--prefill-hold-seconds), by outcome: released (it started its answer or ended), timed_out (sent "
            "after the hold's bound)",
            ("model", "role", "outcome"),
            registry=r,
        )
        self.prefill_claims = CounterFamily(
            "smg_prefill_claims",
            "Claims of a replica in sync with its peers (the lead of a first prefill; on a slot engine, the first "
            "turn on a prompt), by outcome: led (every peer answered, none leads the same prefix on the same "
            "worker), yielded (one does: the claim waited for that prefill or turn), unanswered (sent after "
            "--prefill-claim-seconds without every answer), timed_out (a yielded claim sent after "
            "--prefill-hold-seconds: the peer's end never came)",
            ("outcome",),
            registry=r,
        )
        self.evictions = CounterFamily(
            "smg_cache_tree_evictions", "Characters evicted from cache-aware trees", ("model", "role"), registry=r
        )
        self.decision_seconds = HistogramFamily(
            "smg_routing_decision_seconds",
            "Time to choose a worker",
            ("policy",),
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.requests = CounterFamily(
            "smg_requests", "Requests answered by the router", ("endpoint", "model", "status"), registry=r
        )
        self.request_seconds = HistogramFamily(
            "smg_request_duration_seconds",
            "Request duration, end to end",
            ("endpoint", "model"),
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft_seconds = HistogramFamily(
            "smg_time_to_first_token_seconds",
            "Time to the first streamed byte",
            ("endpoint", "model"),
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.worker_inflight = GaugeFamily(
            "smg_worker_inflight",
            "Requests this router has in flight to the worker",
            ("worker", "role"),
            registry=r,
        )
        self.worker_backend_load = GaugeFamily(
            "smg_worker_backend_load",
            "Running + waiting requests the worker reported at the last poll",
            ("worker", "role"),
            registry=r,
        )
        self.worker_kv_capacity = GaugeFamily(
            "smg_worker_kv_capacity_tokens",
            "KV cache capacity in tokens the worker's engine reported (SGLang, vLLM: /metrics or /v1/loads; "
            "llama.cpp: /props, context size times slots); a worker's kv_capacity_tokens setting overrides it",
            ("worker", "role"),
            registry=r,
        )
        self.worker_healthy = GaugeFamily(
            "smg_worker_healthy",
            "1 when the worker passes its health checks (status ready)",
            ("worker", "role"),
            registry=r,
        )
        self.lifecycle_events = CounterFamily(
            "smg_worker_lifecycle_events", "Worker registrations, updates, removals", ("event", "role"), registry=r
        )
        self.pd_requests = CounterFamily("smg_pd_requests", "Prefill/decode dual dispatches", ("status",), registry=r)
        self.retries = CounterFamily(
            "smg_retries",
            "Requests sent again, by outcome: retried (on another worker), budget_exhausted (a retry the retry budget "
            "refused: the failure was the answer), resent (on a fresh connection, the pooled one found closed)",
            ("endpoint", "outcome"),
            registry=r,
        )
        self.breaker_panics = CounterFamily(
            "smg_breaker_panics",
            "Attempts routed among every ready worker of the model, open breakers included, because open breakers "
            "would have taken out more than --max-ejection-share of them (panic routing)",
            ("model", "role"),
            registry=r,
        )
        self.requests_waiting = GaugeFamily(
            "smg_model_requests_waiting",
            "Requests held in this router waiting for a routable worker of the model (--hold-when-empty), by the role "
            "of the workers awaited: regular, or prefill and decode in PD mode (a request awaiting both counts in "
            "each); the demand of a model scaled to zero",
            ("model", "role"),
            registry=r,
        )
        self.holds = CounterFamily(
            "smg_model_holds",
            "Requests that waited for a routable worker of the model, by outcome: sent (one became routable), expired "
            "(none within --hold-when-empty: a 503), full (the model's --hold-queue-size was reached: a 503 at once), "
            "cancelled (the client went away while it waited)",
            ("model", "outcome"),
            registry=r,
        )
        self.upstream_refused = CounterFamily(
            "smg_upstream_responses_refused",
            "Worker answers the router refused: a head or a body read whole past its limit",
            ("reason",),
            registry=r,
        )
        self.requests_rejected = CounterFamily(
            "smg_requests_rejected", "Requests refused before routing (admission)", ("reason",), registry=r
        )
        self.loop_lag_family = HistogramFamily(
            "smg_event_loop_lag_seconds",
            "How late the event loop ran a timer: time during which no request, stream or poll made progress",
            (),
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.loop_lag = self.loop_lag_family.labels()  # unlabelled: its one series, at zero from the start as before
        self.worker_poll_errors = CounterFamily(
            "smg_worker_poll_errors",
            "Load polls of the worker that gave no load, by kind (timeout, connect, http_status, bad_payload, error)",
            ("worker", "kind"),
            registry=r,
        )
        self.kv_events = CounterFamily(
            "smg_kv_events",
            "KV events read from the worker's engine, by kind: stored, removed, cleared (blocks' events applied), "
            "ignored (an event type the router does not know), invalid (a message or payload that could not be read)",
            ("worker", "kind"),
            registry=r,
        )
        self.kv_events_unsynced = CounterFamily(
            "smg_kv_events_unsynced",
            "Times the worker's KV event stream lost batches the replay could not give back (or its engine "
            "restarted): what the index held for it was dropped, to be learned again from its events",
            ("worker",),
            registry=r,
        )
        self.kv_events_synced = GaugeFamily(
            "smg_kv_events_synced",
            "1 while the worker is routed on its KV events (its index follows every event since it was last empty), "
            "0 while it is routed on the approximate tree after its stream lost batches",
            ("worker",),
            registry=r,
        )
        self.kv_events_lag_family = HistogramFamily(
            "smg_kv_events_lag_seconds",
            "From the time an engine stamped a KV event batch to the time the router applied it (engines' clocks "
            "more than an hour off are left out)",
            (),
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.kv_events_lag = self.kv_events_lag_family.labels()
        self.peer_records_sent = CounterFamily(
            "smg_peer_records_sent",
            "Routes told to a peer router (--peer, --peers-dns), by outcome: sent (acknowledged), failed (the batch "
            "did not reach it, or its answer was not signed with --peer-secret: dropped, not retried), dropped (its "
            "queue held --peer-queue-bytes), expired (queued longer than --peer-queue-seconds); a peer's series go "
            "with it",
            ("peer", "outcome"),
            registry=r,
        )
        self.peer_batches_rejected = CounterFamily(
            "smg_peer_batches_rejected",
            "POST /peers/routes refused, by reason: peers_disabled (404: no --peer, --peers-dns), not_a_peer (403: "
            "from an address no peer has), unsigned, bad_signature, stale_batch, replayed_batch (401: --peer-secret), "
            "too_large (413: over --peer-batch-bytes)",
            ("reason",),
            registry=r,
        )
        self.peer_records_rejected = CounterFamily(
            "smg_peer_records_rejected",
            "Routes and prefills of a peer's batch dropped before they touched anything, by reason: unknown_worker "
            "(no worker of this router has that url), unknown_model (the worker serves another model or role)",
            ("reason",),
            registry=r,
        )
        self.peer_records_received = CounterFamily(
            "smg_peer_records_received",
            "Routes peer routers told this one, by outcome: applied (inserted in the tree), ignored (a policy "
            "without a tree, or a worker this router does not serve)",
            ("outcome",),
            registry=r,
        )
        self.epp_streams = CounterFamily(
            "smg_epp_streams",
            "Envoy ext_proc streams of the Endpoint Picker (--epp-port), one per HTTP request, by outcome when it "
            "ended: routed (endpoints picked), rejected (an immediate response: 400, 404, 413, 429, 501, 503), "
            "abandoned (the stream ended before a pick), error (a message the picker could not follow)",
            ("outcome",),
            registry=r,
        )
        self.epp_served = CounterFamily(
            "smg_epp_served",
            "Picked requests of the Endpoint Picker by the endpoint the gateway reports served them "
            "(x-gateway-destination-endpoint-served): primary (the chosen one), fallback (one named after it), "
            "elsewhere (another worker of the router), unreported (no report, or an endpoint the router does not know)",
            ("kind",),
            registry=r,
        )
        self.families: tuple[Family[Any], ...] = tuple(v for v in vars(self).values() if isinstance(v, Family))
        """Every family in registration (= exposition) order, for tests and tools."""

    def add_tree_size_source(self, source: TreeSizeSource) -> None:
        self.registry.register(_TreeSizeCollector(source))

    def add_tree_bytes_source(self, source: TreeBytesSource) -> None:
        self.registry.register(_TreeBytesCollector(source))

    def add_kv_index_sources(
        self,
        index_bytes: Callable[[], Iterable[tuple[str, int]]],
        worker_blocks: Callable[[], Iterable[tuple[str, str, int]]],
    ) -> None:
        """The index of the engines' KV events: its estimated memory per model, and the blocks each worker's engine
        says it holds."""
        self.registry.register(
            _LabelledGauge(
                "smg_kv_index_bytes",
                "Estimated memory of the index of the engines' KV events, per model (bounded by --tree-memory-budget)",
                ("model",),
                index_bytes,
            )
        )
        self.registry.register(
            _LabelledGauge(
                "smg_kv_index_blocks",
                "KV cache blocks the worker's engine says it holds (its KV events), as the index knows them",
                ("model", "worker"),
                worker_blocks,
            )
        )

    def add_demand_source(self, source: DemandSource) -> None:
        """The autoscaling signals: ``smg_model_requests_inflight``, ``smg_model_prompt_tokens_inflight``,
        ``smg_model_saturation``, ``smg_model_workers`` (docs/autoscaling.md)."""
        self.registry.register(_DemandCollector(source))

    def add_peers_in_sync_source(self, source: Callable[[], float | None]) -> None:
        self.registry.register(
            _ScrapeGauge(
                "smg_peers_in_sync",
                "1 while every peer router acknowledged the routes it was told within the last few seconds (then "
                "cache-aware placement judges KV room from this router's tree, which holds every replica's routes)",
                source,
            )
        )

    def forget_worker(self, worker: str, role: str) -> None:
        """Drop a removed worker's per-worker series so label values stay bounded."""
        for gauge in (self.worker_inflight, self.worker_backend_load, self.worker_kv_capacity, self.worker_healthy):
            gauge.remove(worker, role)
        self.worker_poll_errors.remove_by_labels({"worker": worker})
        self.forget_kv_events(worker)

    def forget_kv_events(self, worker: str) -> None:
        """Drop the series of a worker's KV event stream (it stopped, or the worker left)."""
        for family in (self.kv_events, self.kv_events_unsynced, self.kv_events_synced):
            family.remove_by_labels({"worker": worker})

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


GAUGE_MERGE: dict[str, Callable[[float, float], float]] = {
    "smg_worker_inflight": lambda a, b: a + b,  # the pod's requests in flight to the worker
    "smg_worker_backend_load": max,  # every process polls the same engine: its last figure
    "smg_worker_kv_capacity_tokens": max,  # likewise
    "smg_worker_healthy": min,  # healthy in every process
    "smg_cache_tree_size_chars": max,  # each process's tree holds its own requests' prompts: the fullest
    "smg_cache_tree_bytes": lambda a, b: a + b,  # the pod's memory
    "smg_kv_index_bytes": lambda a, b: a + b,  # each process keeps its own index: the pod's memory
    "smg_kv_index_blocks": max,  # every process reads the same events
    "smg_kv_events_synced": min,  # routed on its events in every process
    "smg_peers_in_sync": min,  # in sync in every process
    "smg_model_requests_waiting": lambda a, b: a + b,  # each process holds its own clients' requests: the pod's
    "smg_model_requests_inflight": lambda a, b: a + b,  # each process's own requests: the pod's
    "smg_model_prompt_tokens_inflight": lambda a, b: a + b,  # likewise
    # Every process polls the same engines: where they report their backlog (SGLang, vLLM, smg-sim), each process
    # computes the same ratio and the largest is it (a sum would count that backlog once per process).  Where a
    # process falls back on its own in-flight, the largest is the busiest process's share: a lower bound.
    "smg_model_saturation": max,
    "smg_model_workers": max,  # every process holds the one fleet (a breaker open in any counts it unroutable there)
}
"""How the pod's ``/metrics`` (``--processes``) combines a gauge's series of its processes; counters and histograms
(their buckets, counts and sums) are added, but for ``COUNTER_MERGE``'s."""
COUNTER_MERGE: dict[str, Callable[[float, float], float]] = {
    "smg_worker_lifecycle_events_total": max,  # the parent applies each change to every process: one event
    "smg_peer_records_received_total": max,  # every process applies each batch a peer sent the pod
    "smg_peer_records_rejected_total": max,  # ... and drops the same records of it
    "smg_peer_batches_rejected_total": max,  # ... and refuses it alike
}
"""The counters whose every increment happens in every process at once (the pod's figure is one process's)."""


def merge_expositions(texts: Sequence[bytes]) -> bytes:
    """One exposition for the pod: every process's (``Metrics.exposition``, the same families in the same order) with
    the series of the same name and labels combined (``GAUGE_MERGE``).  A series is named by its line's text before
    the value, which every process writes alike (labels in the family's order), so nothing is parsed but the value;
    the families and series keep their order (a series only a later process has goes after the others of its
    family).  One exposition comes out byte for byte as it went in."""
    families: dict[str, tuple[list[str], dict[str, float], Callable[[float, float], float] | None]] = {}
    for text in texts:
        family: dict[str, float] | None = None
        merge: Callable[[float, float], float] | None = None
        for line in text.decode().splitlines():
            if line.startswith("# HELP "):
                name = line.split(" ", 3)[2]
                entry = families.get(name)
                if entry is None:
                    entry = families[name] = ([line], {}, None)
                family = entry[1]
            elif line.startswith("# TYPE "):
                name, kind = line.split(" ")[2:4]
                head, family, _ = families.get(name) or ([], {}, None)
                if len(head) < 2:
                    head.append(line)
                merge = GAUGE_MERGE.get(name, max) if kind == "gauge" else COUNTER_MERGE.get(name)
                families[name] = (head, family, merge)
            elif line and not line.startswith("#") and family is not None:
                key, _, raw = line.rpartition(" ")
                value = float(raw)
                old = family.get(key)
                family[key] = value if old is None else merge(old, value) if merge is not None else old + value
    out: list[str] = []
    for head, series, _ in families.values():
        out += head
        out += [f"{key} {floatToGoString(value)}" for key, value in series.items()]  # type: ignore[no-untyped-call]
    return ("\n".join(out) + "\n").encode() if out else b""
