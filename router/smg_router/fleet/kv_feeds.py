"""The KV event feeds: one subscriber per worker whose engine publishes its KV events, applied to its model's index.

A worker registered with ``kv_events`` (``POST /workers``, ``--kv-events``, the operator's ``kvEvents``) gets a
``kv_events.Subscriber`` once its model is known; every batch it reads goes into the model's ``BlockIndex``
(``policies.index.EventIndexes``), which the cache-aware policy matches prompts on.  Every router replica (every
serving process) subscribes on its own and builds the same index from the same events: nothing passes between
replicas.

What an event says is applied as the engine said it: stored blocks join the worker's entry, removed ones leave it,
a clear empties it.  Blocks in another tier than the engine's device memory (a ``medium`` other than ``GPU``: an
offload to CPU or disk) are left out, both ways: a prompt found only there costs a reload the index does not weigh.

A stream the subscriber could not keep whole (a gap the replay could not fill; a router that joined after the
engine's first batches left its replay buffer) empties the worker's entry, and the worker is routed on the
approximate tree until its entry equals its engine's cache again (``EventIndexes``: a clear, a restart, or its KV
capacity stored anew): logged, counted (``smg_kv_events_unsynced_total``) and shown (``smg_kv_events_synced``).
An engine that restarted starts with an empty cache: its entry is emptied and follows it from its first batch.
A worker that leaves, or whose ``kv_events`` changes, has its subscriber stopped and its entry emptied.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from smg_router.kv_events import Cleared, EventBatch, Removed, Stored, Subscriber
from smg_router.metrics import Metrics
from smg_router.policies.index import EventIndexes
from smg_router.tree.blocks import namespace_of
from smg_router.workers.load import LoadView
from smg_router.workers.worker import KvEventsSpec, Worker, worker_id_for

log = logging.getLogger(__name__)

DEVICE_MEDIA = frozenset({None, "GPU", "gpu", "device"})
"""The ``medium`` values of blocks in the engine's own KV memory (an engine that says none means it)."""


LAG_HORIZON = 3600.0
"""A batch stamped further from now than this (seconds) has a clock that is not the router's: its lag is not
observed."""


class _Feed:
    __slots__ = ("capacity", "model", "spec", "subscriber")

    def __init__(self, model: str, spec: KvEventsSpec, subscriber: Subscriber, capacity: int | None) -> None:
        self.model = model
        self.spec = spec
        self.subscriber = subscriber
        self.capacity = capacity
        """The worker's ``kv_capacity_tokens`` setting, which wins over what its engine reports."""


class KvFeeds:
    """Starts, follows and stops the subscribers as workers come and go (``sync``, from the lifecycle path).

    ``on_index_change`` is called when a worker stops or starts being known whole by its events: the policies then
    match it in the tree, or in its events again."""

    def __init__(
        self,
        *,
        events: EventIndexes,
        metrics: Metrics,
        loads: LoadView,
        on_index_change: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.events = events
        self._metrics = metrics
        self._loads = loads
        self._on_index_change = on_index_change
        self._clock = clock
        self._feeds: dict[str, _Feed] = {}
        self._stopping: set[asyncio.Task[None]] = set()

    def sync(self, workers: Iterable[Worker]) -> None:
        """A feed for every worker with ``kv_events`` and a known model; none for the others."""
        wanted: dict[str, tuple[str, KvEventsSpec]] = {}
        capacity: dict[str, int | None] = {}
        for w in workers:
            if w.spec.kv_events is not None and w.model_id is not None:
                wanted[w.url] = (w.model_id, w.spec.kv_events)
                capacity[w.url] = w.spec.kv_capacity_tokens
        for url, feed in list(self._feeds.items()):
            if wanted.get(url) != (feed.model, feed.spec):
                self._stop(url)
        for url, (model, spec) in wanted.items():
            if url not in self._feeds:
                self._start(url, model, spec)
            self._feeds[url].capacity = capacity[url]

    def _start(self, url: str, model: str, spec: KvEventsSpec) -> None:
        self.events.publishes(url, model)
        subscriber = Subscriber(
            endpoint=spec.endpoint,
            replay_endpoint=spec.replay_endpoint,
            topic=spec.topic,
            on_batch=lambda batch: self._apply(url, model, batch),
            on_unsynced=lambda: self._unsynced(url),
            on_restarted=lambda: self._emptied(url, "its engine restarted"),
            on_count=lambda kind, n: self._metrics.kv_events.labels(url, kind).inc(n),
            name=url,
        )
        self._feeds[url] = _Feed(model, spec, subscriber, None)
        self._metrics.kv_events_synced.labels(url).set(1)
        subscriber.start()
        log.info("worker %s: reading its KV events from %s (model %s)", url, spec.endpoint, model)

    def _stop(self, url: str) -> None:
        feed = self._feeds.pop(url)
        self.events.forget(url)
        self._metrics.forget_kv_events(url)
        task = asyncio.get_running_loop().create_task(feed.subscriber.stop(), name=f"kv-events-stop:{url}")
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)
        log.info("worker %s: no longer reading its KV events", url)

    def _apply(self, url: str, model: str, batch: EventBatch) -> None:
        lag = self._clock() - batch.ts
        if abs(lag) < LAG_HORIZON:
            self._metrics.kv_events_lag.observe(max(0.0, lag))
        blocks = self.events.blocks(model)
        stored = 0
        for event in batch.events:
            if isinstance(event, Stored):
                if event.medium in DEVICE_MEDIA:
                    blocks.stored(
                        url,
                        hashes=event.block_hashes,
                        parent=event.parent,
                        tokens=event.token_ids,
                        block_size=event.block_size,
                        namespace=event_namespace(event),
                    )
                    stored += len(event.token_ids)
            elif isinstance(event, Removed):
                if event.medium in DEVICE_MEDIA:
                    blocks.removed(url, event.block_hashes)
            elif isinstance(event, Cleared):
                self._emptied(url, "its engine cleared its cache")
        if stored and self.events.learned(url, stored, self._capacity(url)):
            self._synced(url, "its engine stored its KV capacity anew")

    def _capacity(self, url: str) -> int | None:
        feed = self._feeds.get(url)
        if feed is not None and feed.capacity is not None:
            return feed.capacity
        return self._loads.kv_tokens(worker_id_for(url))

    def _unsynced(self, url: str) -> None:
        """The stream lost batches: what the index held for the worker may be wrong, so it holds nothing, and the
        worker is routed on the tree until its entry is whole again."""
        was_whole = self.events.known_whole(url)
        self.events.lost(url)
        self._metrics.kv_events_unsynced.labels(url).inc()
        self._metrics.kv_events_synced.labels(url).set(0)
        if was_whole:
            log.warning(
                "worker %s: its KV events lost batches; routed on the approximate index until its engine has cleared "
                "its cache or stored its KV capacity (%s tokens) anew",
                url,
                self._capacity(url) or "unknown",
            )
            self._on_index_change()

    def _emptied(self, url: str, why: str) -> None:
        """The worker's engine holds nothing now: so does its entry, which is whole again."""
        if self.events.emptied(url):
            self._synced(url, why)

    def _synced(self, url: str, why: str) -> None:
        self._metrics.kv_events_synced.labels(url).set(1)
        log.info("worker %s: routed on its KV events again (%s)", url, why)
        self._on_index_change()

    async def close(self) -> None:
        for url in list(self._feeds):
            self._stop(url)
        await asyncio.gather(*self._stopping, return_exceptions=True)


def event_namespace(event: Stored) -> str:
    """The namespace of the event's blocks as a request names it: its LoRA adapter by name (one known by its id only
    is one no request names; id 0 is none, as some publishers say it) and its cache salt."""
    lora = event.lora_name or (f"#{event.lora_id}" if event.lora_id else None)
    return namespace_of(lora, event.namespace)
