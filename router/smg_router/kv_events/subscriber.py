"""One worker's KV event stream: a ZMQ SUB socket on the engine's publisher, gaps filled from its replay socket.

The engine (vLLM's and SGLang's ``ZmqEventPublisher``) sends ``[topic, seq, payload]``: ``seq`` 8 bytes big-endian,
counting from 0 per publisher; ``payload`` one msgpack batch (``decode``).  Its optional ROUTER socket answers
``[b"", start]`` (8 bytes) with ``[b"", seq, payload]`` for every batch it still buffers from ``start`` on, then
``[b"", -1, b""]``; vLLM 0.32 puts the topic before the sequence number, ``[b"", topic, seq, payload]``, and ends
with ``[b"", b"", -1, b""]``.  Both are read.

What this module promises: the batches handed to ``on_batch`` are in sequence order, each at most once.  Where a
batch is lost to the router (the buffer no longer holds it, no replay socket, no answer within
``replay_timeout``, a payload that does not decode) ``on_unsynced`` is called and the stream goes on from the next
batch it has: what the index built for this worker may then be wrong, and the index decides what to do.  A
sequence that goes back is an engine that restarted, with an empty cache, counting from 0 again:
``on_restarted`` is called, and its new batches are read from 0 (replayed, if the first live one is later).
What it does not promise: that a batch ever arrives (ZMQ drops at its high-water mark; a gap shows only when a
later batch comes), or anything across two workers.

Nothing a worker sends stops the subscriber: malformed messages and undecodable payloads are counted (``Counts``)
and skipped.  Reconnection is ZMQ's.  Started and stopped by its owner (the fleet), one named task per worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import zmq
import zmq.asyncio

from .decode import Cleared, EventBatch, InvalidBatch, Removed, Stored, decode_batch

__all__ = ["KINDS", "Counts", "Subscriber"]

log = logging.getLogger(__name__)

KINDS: Final = ("stored", "removed", "cleared", "ignored", "invalid")
"""The ``kind`` label of ``smg_kv_events_total``: events by type, unknown event types, and messages or payloads
that could not be read."""

_END: Final = -1


@dataclass(slots=True)
class Counts:
    """What one subscriber has read so far; ``invalid`` counts messages and payloads, the rest events."""

    stored: int = 0
    removed: int = 0
    cleared: int = 0
    ignored: int = 0
    invalid: int = 0
    replays: int = 0
    unsynced: int = 0
    restarts: int = 0


class Subscriber:
    """Reads one worker's events in order and hands each batch to ``on_batch``."""

    def __init__(
        self,
        *,
        endpoint: str,
        on_batch: Callable[[EventBatch], None],
        on_unsynced: Callable[[], None],
        on_restarted: Callable[[], None] = lambda: None,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout: float = 2.0,
        hwm: int = 100_000,
        on_count: Callable[[str, int], None] | None = None,
        name: str = "",
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.replay_timeout = replay_timeout
        self.hwm = hwm
        """Receive high-water mark; vLLM's publisher sends with 100,000."""
        self.name = name or endpoint
        self.counts = Counts()
        self._on_batch = on_batch
        self._on_unsynced = on_unsynced
        self._on_restarted = on_restarted
        self._on_count = on_count
        self._context = context or zmq.asyncio.Context.instance()
        self._next = 0  # the sequence number the next batch should carry
        self._live_last: int | None = None  # the last sequence number read on the live stream
        self._task: asyncio.Task[None] | None = None

    @property
    def next_seq(self) -> int:
        """The sequence number of the next batch to apply."""
        return self._next

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"kv-events:{self.name}")

    async def stop(self) -> None:
        """Ends the task; its sockets close with it (linger 0: nothing is sent on the way out)."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.hwm)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        try:
            sub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                await self._replay()  # what the engine's buffer holds from 0: the worker's history, if still there
            while True:
                frames = await sub.recv_multipart()
                try:
                    await self._live(frames)
                except Exception:  # a bug here must not end one worker's stream for good
                    log.exception("kv events from %s: message dropped", self.name)
        finally:
            sub.close(linger=0)

    async def _live(self, frames: list[bytes]) -> None:
        seq = _seq(frames[1]) if len(frames) == 3 else None
        if seq is None or seq < 0:
            self._count("invalid", 1)
            return
        if self._live_last is not None and seq <= self._live_last:
            # The live stream never goes back: the publisher restarted and counts from 0 with an empty cache.
            log.info(
                "kv events from %s: sequence went back from %d to %d (engine restarted)",
                self.name,
                self._live_last,
                seq,
            )
            self._next = 0
            self.counts.restarts += 1
            try:
                self._on_restarted()
            except Exception:
                log.exception("kv events from %s: on_restarted failed", self.name)
        self._live_last = seq
        if seq > self._next and self.replay_endpoint is not None:
            await self._replay()
        self._accept(seq, frames[2])

    async def _replay(self) -> None:
        """Asks the replay socket for every batch from the next expected one and applies what comes, in order.

        A fresh DEALER per request, closed after it: a late answer to a request given up on cannot be mistaken
        for the next one's.
        """
        assert self.replay_endpoint is not None
        self.counts.replays += 1
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.replay_endpoint)
            async with asyncio.timeout(self.replay_timeout):
                await dealer.send_multipart([b"", self._next.to_bytes(8, "big", signed=True)])
            while True:
                async with asyncio.timeout(self.replay_timeout):  # between two answers, not for the whole replay
                    frames = await dealer.recv_multipart()
                answer = _replay_answer(frames)
                if answer is None:
                    self._count("invalid", 1)
                    log.warning("kv events from %s: malformed replay answer, replay abandoned", self.name)
                    return
                seq, payload = answer
                if seq == _END:
                    return
                self._accept(seq, payload)
        except TimeoutError:
            log.warning("kv events from %s: no replay answer within %.1f s", self.name, self.replay_timeout)
        finally:
            dealer.close(linger=0)

    def _accept(self, seq: int, payload: bytes) -> None:
        """Applies batch ``seq`` if it is the next one; an older one is a duplicate, a later one means a loss."""
        if seq < self._next:
            return
        if seq > self._next:
            log.info("kv events from %s: batches %d to %d lost", self.name, self._next, seq - 1)
            self._unsynced()
        self._next = seq + 1
        try:
            batch = decode_batch(payload)
        except InvalidBatch as exc:
            self._count("invalid", 1)
            log.debug("kv events from %s: batch %d not decoded: %s", self.name, seq, exc)
            self._unsynced()  # its events are lost to the index
            return
        self._count_events(batch)
        try:
            self._on_batch(batch)
        except Exception:
            log.exception("kv events from %s: batch %d not applied", self.name, seq)
            self._unsynced()

    def _count_events(self, batch: EventBatch) -> None:
        stored = removed = cleared = 0
        for event in batch.events:
            if type(event) is Stored:
                stored += 1
            elif type(event) is Removed:
                removed += 1
            elif type(event) is Cleared:
                cleared += 1
        for kind, n in (("stored", stored), ("removed", removed), ("cleared", cleared), ("ignored", batch.ignored)):
            if n:
                self._count(kind, n)

    def _count(self, kind: str, n: int) -> None:
        setattr(self.counts, kind, getattr(self.counts, kind) + n)
        if self._on_count is not None:
            self._on_count(kind, n)

    def _unsynced(self) -> None:
        self.counts.unsynced += 1
        try:
            self._on_unsynced()
        except Exception:
            log.exception("kv events from %s: on_unsynced failed", self.name)


def _replay_answer(frames: list[bytes]) -> tuple[int, bytes] | None:
    """``(seq, payload)`` of ``[b"", seq, payload]`` or ``[b"", topic, seq, payload]``; None for anything else."""
    if len(frames) not in (3, 4) or frames[0]:
        return None
    seq = _seq(frames[-2])
    return None if seq is None else (seq, frames[-1])


def _seq(frame: bytes) -> int | None:
    return int.from_bytes(frame, "big", signed=True) if len(frame) == 8 else None
