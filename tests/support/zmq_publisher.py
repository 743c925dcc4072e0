"""An engine's KV event publisher on loopback, framed as vLLM's ``ZmqEventPublisher`` frames it.

``[topic, seq (8 bytes big-endian), payload]`` on the publishing socket; a ROUTER that answers ``[id, b"", start]``
with ``[id, b"", seq, payload]`` for every buffered batch from ``start`` on, then ``[id, b"", -1, b""]`` (or, as
vLLM 0.32 does, ``[id, b"", topic, seq, payload]`` and ``[id, b"", b"", -1, b""]``: ``replay_topic``).  It
publishes on XPUB rather than PUB (the same on the wire) so a test can wait for the subscription instead of
sleeping past ZMQ's slow-joiner window.  A test can drop batches from the live stream, forget them from the buffer,
or stop answering replays.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

import zmq
import zmq.asyncio

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EnginePublisher:
    def __init__(self, *, buffer_steps: int = 20_000, topic: bytes = b"", replay_topic: bool = False) -> None:
        ctx = zmq.asyncio.Context.instance()
        self.topic = topic
        self.replay_topic = replay_topic
        """Replay answers as vLLM 0.32 frames them: the topic before the sequence number (the end marker's empty)."""
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.replay_endpoint = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.answering = True
        self.replay_requests: list[int] = []
        self._server = asyncio.create_task(self._serve_replays(), name="engine-publisher-replay")

    async def subscribed(self) -> None:
        """Until a subscriber's subscription reached the publishing socket."""
        async with asyncio.timeout(5.0):
            while True:
                message = await self.pub.recv()
                if message[:1] == b"\x01":
                    return

    async def publish(self, payload: bytes, *, live: bool = True) -> int:
        """Buffers the batch under the next sequence number and, when ``live``, sends it."""
        seq, self.seq = self.seq, self.seq + 1
        self.buffer.append((seq, payload))
        if live:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    def forget_before(self, seq: int) -> None:
        while self.buffer and self.buffer[0][0] < seq:
            self.buffer.popleft()

    def restart(self) -> None:
        """As a restarted engine: numbering from 0, nothing buffered."""
        self.seq = 0
        self.buffer.clear()

    async def _serve_replays(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3 or not self.answering:
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            self.replay_requests.append(start)
            topic = [self.topic] if self.replay_topic else []
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await self.router.send_multipart([client, b"", *topic, seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([client, b"", *([b""] if self.replay_topic else []), END_SEQ, b""])

    async def close(self) -> None:
        self._server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._server
        self.pub.close(linger=0)
        self.router.close(linger=0)
