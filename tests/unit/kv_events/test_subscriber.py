"""Subscriber against real ZMQ sockets on loopback: order, gaps filled by replay, losses reported, garbage survived.

The engine is ``support.zmq_publisher.EnginePublisher``, framed as vLLM's publisher.  Every batch carries its
sequence number as its timestamp, so the test reads which batches were applied, in which order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import msgspec
import pytest
from smg_router.kv_events import EventBatch, Subscriber
from support.zmq_publisher import EnginePublisher


def batch(seq: int) -> bytes:
    return msgspec.msgpack.encode([float(seq), [["BlockStored", [seq], None, [1, 2], 2, None, "GPU", None]], 0])


class Applied:
    """What the subscriber handed on: the batches' sequence numbers in order, and how often it reported a loss."""

    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.unsynced = 0
        self.restarts: list[int] = []
        """How many batches had been applied at each restart reported."""

    def on_batch(self, b: EventBatch) -> None:
        self.seqs.append(int(b.ts))

    def on_unsynced(self) -> None:
        self.unsynced += 1

    def on_restarted(self) -> None:
        self.restarts.append(len(self.seqs))


async def until(condition: Callable[[], bool], within: float = 5.0) -> None:
    async with asyncio.timeout(within):
        while not condition():  # noqa: ASYNC110 - polls what the callbacks recorded
            await asyncio.sleep(0.005)


async def synced(engine: EnginePublisher, applied: Applied) -> None:
    """Until batch 0 went through the live stream: the subscriber's start (its replay) is over."""
    await engine.subscribed()
    await engine.publish(batch(0))
    await until(lambda: applied.seqs == [0])


@pytest.fixture
async def engine() -> AsyncIterator[EnginePublisher]:
    publisher = EnginePublisher()
    yield publisher
    await publisher.close()


@pytest.fixture
async def subscribe(engine: EnginePublisher) -> AsyncIterator[Callable[..., Subscriber]]:
    started: list[Subscriber] = []

    def start(applied: Applied, *, replay: bool = True, replay_timeout: float = 1.0) -> Subscriber:
        sub = Subscriber(
            endpoint=engine.endpoint,
            replay_endpoint=engine.replay_endpoint if replay else None,
            on_batch=applied.on_batch,
            on_unsynced=applied.on_unsynced,
            on_restarted=applied.on_restarted,
            replay_timeout=replay_timeout,
            name="worker-0",
        )
        sub.start()
        started.append(sub)
        return sub

    yield start
    for sub in started:
        await sub.stop()


async def test_in_order_batches_are_applied_in_order(engine: EnginePublisher, subscribe) -> None:
    applied = Applied()
    sub = subscribe(applied)
    await engine.subscribed()
    for seq in range(20):
        await engine.publish(batch(seq))
    await until(lambda: len(applied.seqs) == 20)
    assert applied.seqs == list(range(20))
    assert applied.unsynced == 0
    assert sub.counts.stored == 20 and sub.counts.invalid == 0


async def test_batches_published_before_the_subscriber_came_are_replayed_at_its_start(
    engine: EnginePublisher, subscribe
) -> None:
    for seq in range(5):
        await engine.publish(batch(seq), live=False)
    applied = Applied()
    subscribe(applied)
    await engine.subscribed()
    await until(lambda: len(applied.seqs) == 5)
    await engine.publish(batch(5))
    await until(lambda: len(applied.seqs) == 6)
    assert applied.seqs == list(range(6))
    assert applied.unsynced == 0
    assert engine.replay_requests[0] == 0


async def test_replay_answers_with_the_topic_before_the_sequence_number_are_read() -> None:
    """vLLM 0.32's replay socket answers ``[b"", topic, seq, payload]`` and ends with ``[b"", b"", -1, b""]``: the
    start's replay and a gap's are both filled from it."""
    engine = EnginePublisher(topic=b"kv-events", replay_topic=True)
    applied = Applied()
    sub = Subscriber(
        endpoint=engine.endpoint,
        replay_endpoint=engine.replay_endpoint,
        topic="kv-events",
        on_batch=applied.on_batch,
        on_unsynced=applied.on_unsynced,
        replay_timeout=1.0,
        name="worker-0",
    )
    try:
        for seq in range(3):
            await engine.publish(batch(seq), live=False)
        sub.start()
        await engine.subscribed()
        await until(lambda: len(applied.seqs) == 3)
        for seq in range(3, 10):
            await engine.publish(batch(seq), live=seq not in (5, 6))
        await until(lambda: len(applied.seqs) == 10)
        assert applied.seqs == list(range(10))
        assert applied.unsynced == 0
        assert sub.counts.invalid == 0
        assert engine.replay_requests == [0, 5]
    finally:
        await sub.stop()
        await engine.close()


async def test_a_gap_is_filled_by_replay_without_duplicates(engine: EnginePublisher, subscribe) -> None:
    applied = Applied()
    subscribe(applied)
    await synced(engine, applied)
    for seq in range(1, 30):
        await engine.publish(batch(seq), live=not 10 <= seq < 20)  # 10..19 lost on the way, still buffered
    await until(lambda: len(applied.seqs) == 30)
    await engine.publish(batch(30))
    await until(lambda: len(applied.seqs) == 31)
    assert applied.seqs == list(range(31))
    assert applied.unsynced == 0
    assert 10 in engine.replay_requests


async def test_a_gap_the_buffer_no_longer_holds_is_reported_and_the_stream_goes_on(
    engine: EnginePublisher, subscribe
) -> None:
    applied = Applied()
    subscribe(applied)
    await synced(engine, applied)
    for seq in range(1, 3):
        await engine.publish(batch(seq))
    await until(lambda: len(applied.seqs) == 3)
    for seq in range(3, 7):
        await engine.publish(batch(seq), live=False)
    engine.forget_before(7)
    for seq in range(7, 10):
        await engine.publish(batch(seq))
    await until(lambda: len(applied.seqs) == 6)
    assert applied.seqs == [0, 1, 2, 7, 8, 9]
    assert applied.unsynced == 1


async def test_a_gap_with_no_replay_socket_is_reported_and_the_stream_goes_on(
    engine: EnginePublisher, subscribe
) -> None:
    applied = Applied()
    subscribe(applied, replay=False)
    await engine.subscribed()
    await engine.publish(batch(0))
    await engine.publish(batch(1), live=False)
    await engine.publish(batch(2))
    await until(lambda: len(applied.seqs) == 2)
    assert applied.seqs == [0, 2]
    assert applied.unsynced == 1


async def test_a_replay_unanswered_within_the_timeout_is_reported_and_the_stream_goes_on(
    engine: EnginePublisher, subscribe
) -> None:
    applied = Applied()
    subscribe(applied, replay_timeout=0.2)
    await synced(engine, applied)
    engine.answering = False
    await engine.publish(batch(1), live=False)
    await engine.publish(batch(2))
    await engine.publish(batch(3))
    await until(lambda: len(applied.seqs) == 3)
    assert applied.seqs == [0, 2, 3]
    assert applied.unsynced == 1


async def test_an_engine_restart_is_reported_and_its_new_numbering_followed(engine: EnginePublisher, subscribe) -> None:
    applied = Applied()
    subscribe(applied)
    await synced(engine, applied)
    for seq in range(1, 5):
        await engine.publish(batch(seq))
    await until(lambda: len(applied.seqs) == 5)
    engine.restart()
    for seq in range(2):
        await engine.publish(batch(100 + seq))  # timestamps tell the new batches apart
    await until(lambda: len(applied.seqs) == 7)
    assert applied.seqs == [0, 1, 2, 3, 4, 100, 101]
    assert applied.restarts == [5]  # before the restarted engine's first batch
    assert applied.unsynced == 0  # nothing of its new run was lost


async def test_a_restarted_engines_first_batches_missed_live_are_replayed_from_0(
    engine: EnginePublisher, subscribe
) -> None:
    applied = Applied()
    subscribe(applied)
    await synced(engine, applied)
    for seq in range(1, 5):
        await engine.publish(batch(seq))
    await until(lambda: len(applied.seqs) == 5)
    engine.restart()
    for seq in range(3):
        await engine.publish(batch(100 + seq), live=seq == 2)  # its first two only in its replay buffer
    await until(lambda: len(applied.seqs) == 8)
    assert applied.seqs == [0, 1, 2, 3, 4, 100, 101, 102]
    assert applied.restarts == [5]
    assert applied.unsynced == 0


@pytest.mark.timeout(60)
async def test_ten_thousand_invalid_payloads_then_a_valid_one_the_valid_one_is_applied(
    engine: EnginePublisher, subscribe
) -> None:
    applied = Applied()
    sub = subscribe(applied)
    await synced(engine, applied)
    for i in range(10_000):
        await engine.publish(b"\xc1not msgpack" if i % 2 else msgspec.msgpack.encode([1.0, [7]]))
    await engine.publish(batch(10_001))
    await until(lambda: applied.seqs == [0, 10_001], within=50)
    assert sub.counts.invalid == 10_000
    assert sub.next_seq == 10_002


async def test_malformed_messages_are_counted_and_skipped(engine: EnginePublisher, subscribe) -> None:
    applied = Applied()
    sub = subscribe(applied)
    await synced(engine, applied)
    await engine.send_raw([b"", b"\x00" * 8])  # two frames
    await engine.send_raw([b"", b"\x00" * 4, batch(0)])  # a 4-byte sequence number
    await engine.send_raw([b"", (-5).to_bytes(8, "big", signed=True), batch(0)])  # a negative one
    await engine.publish(batch(1))
    await until(lambda: applied.seqs == [0, 1])
    assert sub.counts.invalid == 3
    assert applied.unsynced == 0


async def test_stop_with_nothing_pending_ends_promptly(engine: EnginePublisher, subscribe) -> None:
    applied = Applied()
    sub = subscribe(applied)
    await engine.subscribed()
    started = time.monotonic()
    await sub.stop()
    assert time.monotonic() - started < 0.5
    assert sub._task is None


async def test_stop_during_an_unanswered_replay_ends_promptly(engine: EnginePublisher, subscribe) -> None:
    engine.answering = False
    applied = Applied()
    sub = subscribe(applied, replay_timeout=30.0)
    await engine.subscribed()
    started = time.monotonic()
    await sub.stop()
    assert time.monotonic() - started < 0.5
