"""The KV-event publisher: the engine's cache changes, as vLLM and SGLang publish theirs over ZeroMQ.

`BlockTracker` (``kv_blocks``) turns the prefix cache's changes into `Stored`/`Removed`/`Cleared` events and
hands them to `KvEventPublisher.add`; the events of one event-loop turn (one engine step, or one flush) go out
as one batch: a PUB socket sends ``[topic, seq (8-byte big-endian), payload]`` with ``seq`` counting batches
from 0, and an optional ROUTER socket answers a request ``[start seq (8-byte big-endian)]`` with every buffered
batch from ``start`` on (the last `BUFFER_STEPS`), then an end marker whose seq is -1 and payload empty.  Both
sockets bind (vLLM binds only a wildcard address and connects otherwise; a simulated engine is the one that
stays put); a ``*`` port binds any free one, read back in `endpoint`/`replay_endpoint`.

The payload is a msgpack ``KVEventBatch``, byte for byte what the engine named by ``--kv-events-format`` sends
(plain lists and dicts encoded by msgspec give exactly the bytes of the engines' msgspec Structs: a tagged
Struct puts its tag first, then its fields in declaration order; ``omit_defaults`` fields left at their
default are absent):

* ``vllm`` (the default): vLLM after PR #42892 (events as maps tagged ``"type"``, June 2026; v0.26.0).  The
  batch stays positional ``[ts, events, data_parallel_rank]``, as released v0.26.0 sends it (a captured batch
  in volcano-sh/kthena#1535; dynamo's API guard pins ``EventBatch.array_like``).  Fields as in
  ``vllm/distributed/kv_events.py`` at 0181ea3173e53eea8cf04a86891488e3dc89bb34 (``BlockStored``:
  block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx,
  kv_cache_spec_kind; ``BlockRemoved``: block_hashes, medium, group_idx), filled as a full-attention model's
  block pool fills them (medium ``"GPU"``, ``extra_keys`` one ``None`` per block, group 0, no sliding window:
  absent from the map).  Replay frames
  carry the topic, ``[topic, seq, payload]`` (vLLM PR #45177, in v0.26.0).
* ``vllm-array``: the same fields as tagged positional arrays ``["BlockStored", ...]`` (msgspec
  ``array_like=True``, vLLM before #42892, e.g. v0.23.0), every field present (msgspec ignores
  ``omit_defaults`` on arrays: 12 elements for ``BlockStored``); replay frames ``[seq, payload]`` (before #45177).
* ``sglang``: SGLang after PR #37482 (events as maps tagged ``"type"``, ``omit_defaults``; the batch
  ``[ts, events, attn_dp_rank]`` positional): ``BlockStored`` block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium (``cache_salt``/``session_id`` absent: the sim has neither).
* ``sglang-array``: SGLang before #37482, ``python/sglang/srt/disaggregation/kv_events.py`` (array_like
  Structs without ``omit_defaults``): ``["BlockStored", hashes, parent, tokens, block_size, lora_id, medium]``,
  seven elements (the optional eighth, ``{"cache_salt": ...}`` metadata, never: no salts here);
  ``["BlockRemoved", hashes, medium]``.  SGLang's replay frames are ``[seq, payload]``
  (ZmqEventPublisher at 006d053f182f9b488d2bd841afa06d5f9120a258).

Block hashes are the tracker's unsigned 64-bit chained hashes (vLLM's default int hashes are the same width);
timestamps are wall-clock seconds.  Delivery is as the engines': PUB drops what no subscriber takes in time
(high-water mark), a subscriber sees a gap in ``seq`` and asks the replay socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from .config import KV_EVENTS_FORMATS, KvEventsFormat
from .kv_blocks import Cleared, KvEvent, Removed, Stored

__all__ = ["BUFFER_STEPS", "END_SEQ", "KV_EVENTS_FORMATS", "KvEventPublisher", "KvEventsFormat", "encode_batch"]

log = logging.getLogger(__name__)

#: Batches kept for replay (vLLM's and SGLang's ``buffer_steps`` default).
BUFFER_STEPS = 10_000
#: The seq frame of the end-of-replay marker.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: Messages the PUB socket queues per subscriber before dropping (the engines' ``hwm``).
_HWM = 100_000
_MEDIUM = "GPU"

_encoder = msgspec.msgpack.Encoder()


def _vllm_fields(event: KvEvent) -> tuple[str, list[tuple[str, Any]]]:
    if isinstance(event, Stored):
        return "BlockStored", [
            ("block_hashes", list(event.block_hashes)),
            ("parent_block_hash", event.parent_block_hash),
            ("token_ids", list(event.token_ids)),
            ("block_size", event.block_size),
            ("lora_id", None),
            ("medium", _MEDIUM),
            ("lora_name", None),
            ("extra_keys", [None] * len(event.block_hashes)),
            ("group_idx", 0),
            ("kv_cache_spec_kind", "full_attention"),
            ("kv_cache_spec_sliding_window", None),
        ]
    if isinstance(event, Removed):
        return "BlockRemoved", [("block_hashes", list(event.block_hashes)), ("medium", _MEDIUM), ("group_idx", 0)]
    return "AllBlocksCleared", []


def _sglang_fields(event: KvEvent) -> tuple[str, list[tuple[str, Any]]]:
    if isinstance(event, Stored):
        return "BlockStored", [
            ("block_hashes", list(event.block_hashes)),
            ("parent_block_hash", event.parent_block_hash),
            ("token_ids", list(event.token_ids)),
            ("block_size", event.block_size),
            ("lora_id", None),
            ("medium", _MEDIUM),
        ]
    if isinstance(event, Removed):
        return "BlockRemoved", [("block_hashes", list(event.block_hashes)), ("medium", _MEDIUM)]
    assert isinstance(event, Cleared)
    return "AllBlocksCleared", []


#: Fields the engines' Structs give a default of None: a map (``omit_defaults``) leaves them out when None, an
#: array (msgspec ignores ``omit_defaults`` with ``array_like``) always holds them.
_DEFAULT_NONE = frozenset({"extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "medium"})


def _wire_event(fmt: KvEventsFormat, event: KvEvent) -> Any:
    tag, fields = (_vllm_fields if fmt.startswith("vllm") else _sglang_fields)(event)
    if fmt.endswith("-array"):
        return [tag, *(value for _, value in fields)]
    return {"type": tag, **{name: value for name, value in fields if value is not None or name not in _DEFAULT_NONE}}


def encode_batch(fmt: KvEventsFormat, events: list[KvEvent], *, ts: float, rank: int = 0) -> bytes:
    """The msgpack ``KVEventBatch`` of `events` as the engine of `fmt` encodes it."""
    return _encoder.encode([ts, [_wire_event(fmt, e) for e in events], rank])


class KvEventPublisher:
    """PUB (and optional ROUTER replay) sockets for one engine; `add` is the `BlockTracker`'s sink."""

    def __init__(
        self,
        *,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        fmt: KvEventsFormat = "vllm",
        buffer_steps: int = BUFFER_STEPS,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.fmt = fmt
        self._topic = topic.encode()
        self._pending: list[KvEvent] = []
        self._flush_handle: asyncio.Handle | None = None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._actx: zmq.asyncio.Context | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None

    @property
    def topic(self) -> str:
        return self._topic.decode()

    @property
    def seq(self) -> int:
        """The seq the next batch will carry (batches sent so far)."""
        return self._seq

    def start(self) -> None:
        """Bind the sockets (inside the running loop: the replay socket is served by a task)."""
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(_HWM)
        self._pub.linger = 0
        try:
            self._pub.bind(self.endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if self.replay_endpoint is not None:
                self._actx = zmq.asyncio.Context()
                self._replay = self._actx.socket(zmq.ROUTER)
                self._replay.linger = 0
                self._replay.bind(self.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
                self._replay_task = asyncio.create_task(self._serve_replay(), name="smg-sim-kv-events-replay")
        except BaseException:
            self._close_sockets()
            raise
        log.info("KV events (%s) on %s, replay on %s", self.fmt, self.endpoint, self.replay_endpoint)

    async def stop(self) -> None:
        """Send what is pending, stop answering replays, close the sockets."""
        self.flush()
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        self._close_sockets()

    def add(self, event: KvEvent) -> None:
        """Queue one event; the batch goes out once the current event-loop turn (an engine step) is over."""
        self._pending.append(event)
        if self._flush_handle is None:
            try:
                self._flush_handle = asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no loop (a synchronous caller): send at once
                self.flush()

    def flush(self) -> None:
        """Send the pending events as one batch (no-op when there are none)."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if not self._pending or self._pub is None:
            return
        events, self._pending = self._pending, []
        payload = encode_batch(self.fmt, events, ts=time.time())
        seq, self._seq = self._seq, self._seq + 1
        self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):  # no subscriber keeping up: dropped, as PUB drops
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)

    def _replayed(self, start: int) -> Iterator[tuple[bytes, ...]]:
        """Frames after the client's identity and delimiter: each buffered batch from `start`, then the end."""
        with_topic = self.fmt == "vllm"  # vLLM #45177: replay frames match the PUB frames
        for seq, payload in list(self._buffer):
            if seq >= start:
                seq_bytes = seq.to_bytes(8, "big")
                yield (self._topic, seq_bytes, payload) if with_topic else (seq_bytes, payload)
        yield (self._topic, END_SEQ, b"") if with_topic else (END_SEQ, b"")

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid KV events replay request: %d frames", len(frames))
                continue
            client, _, start = frames
            for reply in self._replayed(int.from_bytes(start, "big")):
                await self._replay.send_multipart((client, b"", *reply))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        for ctx in (self._ctx, self._actx):
            if ctx is not None:
                ctx.term()
        self._pub = self._replay = None
        self._ctx = self._actx = None
