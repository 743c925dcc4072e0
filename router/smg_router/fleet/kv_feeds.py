"""The KV event feeds: one subscriber per worker whose engine publishes its KV events, applied to its model's index.

A worker registered with ``kv_events`` (``POST /workers``, ``--kv-events``, the operator's ``kvEvents``) gets a
``kv_events.Subscriber`` once its model is known; every batch it reads goes into the model's ``BlockIndex``
(``policies.index.EventIndexes``), which the cache-aware policy matches prompts on.  Every router replica (every
serving process) subscribes on its own and builds the same index from the same events: nothing passes between
replicas.

What an event says is applied as the engine said it: stored blocks join the worker's entry, removed ones leave it,
a clear empties it.  Blocks in another tier than the engine's device memory (a ``medium`` other than ``GPU``: an
offload to CPU or disk) are left out, both ways: a prompt found only there costs a reload the index does not weigh.
A stream the subscriber could not keep whole (a gap the replay could not fill, an engine that restarted) empties
the worker's entry, so it is matched on what its engine says from then on and never on blocks it may have
evicted meanwhile.  A worker that leaves, or whose ``kv_events`` changes, has its subscriber stopped and its
entry emptied.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from smg_router.kv_events import Cleared, EventBatch, Removed, Stored, Subscriber
from smg_router.metrics import Metrics
from smg_router.policies.index import EventIndexes
from smg_router.workers.worker import KvEventsSpec, Worker

log = logging.getLogger(__name__)

DEVICE_MEDIA = frozenset({None, "GPU", "gpu", "device"})
"""The ``medium`` values of blocks in the engine's own KV memory (an engine that says none means it)."""


class _Feed:
    __slots__ = ("model", "spec", "subscriber")

    def __init__(self, model: str, spec: KvEventsSpec, subscriber: Subscriber) -> None:
        self.model = model
        self.spec = spec
        self.subscriber = subscriber


class KvFeeds:
    """Starts, follows and stops the subscribers as workers come and go (``sync``, from the lifecycle path)."""

    def __init__(self, *, events: EventIndexes, metrics: Metrics) -> None:
        self.events = events
        self._metrics = metrics
        self._feeds: dict[str, _Feed] = {}
        self._stopping: set[asyncio.Task[None]] = set()

    def sync(self, workers: Iterable[Worker]) -> None:
        """A feed for every worker with ``kv_events`` and a known model; none for the others."""
        wanted: dict[str, tuple[str, KvEventsSpec]] = {}
        for w in workers:
            if w.spec.kv_events is not None and w.model_id is not None:
                wanted[w.url] = (w.model_id, w.spec.kv_events)
        for url, feed in list(self._feeds.items()):
            if wanted.get(url) != (feed.model, feed.spec):
                self._stop(url)
        for url, (model, spec) in wanted.items():
            if url not in self._feeds:
                self._start(url, model, spec)

    def _start(self, url: str, model: str, spec: KvEventsSpec) -> None:
        self.events.publishes(url, model)
        subscriber = Subscriber(
            endpoint=spec.endpoint,
            replay_endpoint=spec.replay_endpoint,
            topic=spec.topic,
            on_batch=lambda batch: self._apply(url, model, batch),
            on_unsynced=lambda: self._unsynced(url, model),
            on_count=lambda kind, n: self._metrics.kv_events.labels(url, kind).inc(n),
            name=url,
        )
        self._feeds[url] = _Feed(model, spec, subscriber)
        subscriber.start()
        log.info("worker %s: reading its KV events from %s (model %s)", url, spec.endpoint, model)

    def _stop(self, url: str) -> None:
        feed = self._feeds.pop(url)
        self.events.forget(url)
        self._metrics.kv_events.remove_by_labels({"worker": url})
        self._metrics.kv_events_unsynced.remove_by_labels({"worker": url})
        task = asyncio.get_running_loop().create_task(feed.subscriber.stop(), name=f"kv-events-stop:{url}")
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)
        log.info("worker %s: no longer reading its KV events", url)

    def _apply(self, url: str, model: str, batch: EventBatch) -> None:
        blocks = self.events.blocks(model)
        for event in batch.events:
            if isinstance(event, Stored):
                if event.medium in DEVICE_MEDIA:
                    blocks.stored(
                        url,
                        hashes=event.block_hashes,
                        parent=event.parent,
                        tokens=event.token_ids,
                        block_size=event.block_size,
                        namespace=event.namespace or "",
                    )
            elif isinstance(event, Removed):
                if event.medium in DEVICE_MEDIA:
                    blocks.removed(url, event.block_hashes)
            elif isinstance(event, Cleared):
                blocks.cleared(url)

    def _unsynced(self, url: str, model: str) -> None:
        """The stream lost batches: what the index held for the worker may be wrong, so it holds nothing."""
        self.events.blocks(model).cleared(url)
        self._metrics.kv_events_unsynced.labels(url).inc()

    async def close(self) -> None:
        for url in list(self._feeds):
            self._stop(url)
        await asyncio.gather(*self._stopping, return_exceptions=True)
