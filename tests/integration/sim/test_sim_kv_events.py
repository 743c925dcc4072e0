"""smg-sim publishes its cache as KV events over real ZeroMQ sockets on loopback.

A plain pyzmq SUB socket subscribes, requests go through HTTP, and the msgpack payloads are decoded with msgspec
(typed, with Structs shaped as a router's decoder shapes them): the prompt's full blocks arrive stored with the
prompt's token ids, filling the cache past its capacity removes blocks, a flush clears, and the replay socket
hands back the buffered batches from a given seq, then -1.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from smg_sim.kv_blocks import block_hashes
from smg_sim_procs import SimLauncher, SimProcess, free_port
from support.procs import http_json, next_host

BLOCK = 4
#: A SUB socket joins a PUB a moment after it connects: what is published before is not delivered to it.
JOIN_S = 0.5


class Event(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class BlockStored(Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None


class BlockRemoved(Event):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(Event):
    pass


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(Batch)


class Subscriber:
    """A SUB socket on the sim's events: ``batches()`` collects what arrived (seq, decoded batch)."""

    def __init__(self, ctx: Sockets, endpoint: str, topic: str = "") -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sock.connect(endpoint)
        self.topic = topic.encode()
        self.received: list[tuple[int, Batch]] = []
        self.raw: dict[int, bytes] = {}
        time.sleep(JOIN_S)

    def drain(self, *, until: Any = None, timeout: float = 5.0) -> list[Any]:
        """Receive until ``until(events so far)`` holds (or, without one, until quiet); return every event."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.sock.poll(100 if until is None else 50):
                if until is None or until(self.events()):
                    break
                continue
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == self.topic
            number = int.from_bytes(seq, "big")
            self.received.append((number, DECODER.decode(payload)))
            self.raw[number] = payload
        return self.events()

    def events(self) -> list[Any]:
        return [e for _, batch in self.received for e in batch.events]


class Sockets:
    """Makes the test's ZeroMQ sockets and holds them until teardown closes them all."""

    def __init__(self) -> None:
        self.ctx: Sockets = zmq.Context()
        self.made: list[zmq.Socket[bytes]] = []

    def socket(self, kind: int) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(kind)
        sock.linger = 0
        self.made.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.made:
            sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def ctx() -> Iterator[Sockets]:
    sockets = Sockets()
    yield sockets
    sockets.close()


def start(launch_sim: SimLauncher, *flags: str, replay: bool = False) -> tuple[SimProcess, str, str | None]:
    host = next_host()
    endpoint = f"tcp://{host}:{free_port(host)}"
    replay_endpoint = f"tcp://{host}:{free_port(host)}" if replay else None
    extra = ["--kv-events-endpoint", endpoint, "--block-size", str(BLOCK), "--time-scale", "0", *flags]
    if replay_endpoint is not None:
        extra += ["--kv-events-replay-endpoint", replay_endpoint]
    return launch_sim(host, *extra), endpoint, replay_endpoint


def generate(sim: SimProcess, text: str, max_new_tokens: int = 1) -> None:
    status, body = http_json(
        "POST", f"{sim.url}/generate", {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens}}
    )
    assert status == 200, body


def stored_blocks(events: list[Any]) -> set[int]:
    """Replay the events: stored adds, removed takes away, cleared empties."""
    held: set[int] = set()
    for e in events:
        if isinstance(e, BlockStored):
            held.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            assert set(e.block_hashes) <= held
            held.difference_update(e.block_hashes)
        else:
            held.clear()
    return held


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_a_prompts_full_blocks_arrive_stored_with_its_token_ids(
    launch_sim: SimLauncher, ctx: Sockets, fmt: str
) -> None:
    sim, endpoint, _ = start(launch_sim, "--kv-events-format", fmt, "--kv-events-topic", "kv@sim")
    sub = Subscriber(ctx, endpoint, topic="kv@sim")
    prompt = "the quick brown fox jumps over a dog"  # 36 bytes: 9 full blocks of 4
    tokens = list(prompt.encode())
    generate(sim, prompt)
    events = sub.drain(until=lambda evs: any(isinstance(e, BlockStored) for e in evs))
    first = next(e for e in events if isinstance(e, BlockStored))
    assert first.parent_block_hash is None and first.block_size == BLOCK and first.medium == "GPU"
    assert first.token_ids == tokens[: len(tokens) // BLOCK * BLOCK]
    assert first.block_hashes == block_hashes(tokens, BLOCK)
    assert [seq for seq, _ in sub.received] == list(range(sub.received[0][0], sub.received[0][0] + len(sub.received)))


@pytest.mark.parametrize("fmt", ["vllm-array", "sglang-array"])
def test_positional_formats_carry_the_same_blocks(launch_sim: SimLauncher, ctx: Sockets, fmt: str) -> None:
    sim, endpoint, _ = start(launch_sim, "--kv-events-format", fmt)
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    time.sleep(JOIN_S)
    generate(sim, "abcdefghij")
    assert sock.poll(5000)
    _, _, payload = sock.recv_multipart()
    ts, events, rank = msgspec.msgpack.decode(payload)
    assert isinstance(ts, float) and rank == 0
    tag, hashes, parent, token_ids, block_size, lora_id, medium, *rest = events[0]
    assert (tag, parent, token_ids, block_size, lora_id, medium) == (
        "BlockStored",
        None,
        list(b"abcdefgh"),
        4,
        None,
        "GPU",
    )
    assert hashes == block_hashes(list(b"abcdefgh"), BLOCK)
    assert len(rest) == (5 if fmt == "vllm-array" else 0)  # lora_name, extra_keys, group, kind, window


def test_filling_the_cache_past_capacity_removes_blocks(launch_sim: SimLauncher, ctx: Sockets) -> None:
    sim, endpoint, _ = start(launch_sim, "--kv-capacity", "64")
    sub = Subscriber(ctx, endpoint)
    for i in range(6):
        generate(sim, f"prompt number {i} with some filler text")  # 36 bytes each, never shared past "prompt number "
    events = sub.drain(until=lambda evs: any(isinstance(e, BlockRemoved) for e in evs))
    assert any(isinstance(e, BlockRemoved) for e in events)
    held = stored_blocks(sub.drain())  # also checks nothing removed was never stored
    assert held and len(held) * BLOCK <= 64


@pytest.mark.parametrize("path", ["/flush_cache", "/reset_prefix_cache"])
def test_a_flush_clears_every_block(launch_sim: SimLauncher, ctx: Sockets, path: str) -> None:
    sim, endpoint, _ = start(launch_sim)
    sub = Subscriber(ctx, endpoint)
    generate(sim, "some prompt to cache first")
    sub.drain(until=lambda evs: any(isinstance(e, BlockStored) for e in evs))
    status, _ = http_json("POST", f"{sim.url}{path}")
    assert status == 200
    events = sub.drain(until=lambda evs: isinstance(evs[-1], AllBlocksCleared))
    assert isinstance(events[-1], AllBlocksCleared)
    assert stored_blocks(events) == set()


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_replay_returns_the_buffered_batches_from_a_seq_then_minus_one(
    launch_sim: SimLauncher, ctx: Sockets, fmt: str
) -> None:
    sim, endpoint, replay_endpoint = start(launch_sim, "--kv-events-format", fmt, "--kv-events-topic", "t", replay=True)
    assert replay_endpoint is not None
    sub = Subscriber(ctx, endpoint, topic="t")
    for i in range(4):
        generate(sim, f"replayed prompt {i} long enough")
    sub.drain(until=lambda evs: sum(isinstance(e, BlockStored) for e in evs) >= 8)
    sub.drain()
    live = dict(sub.raw)
    assert len(live) >= 2
    start_seq = sorted(live)[1]
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay_endpoint)
    dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
    replayed: dict[int, bytes] = {}
    while True:
        assert dealer.poll(5000), "no end of replay"
        empty, *frames = dealer.recv_multipart()
        assert empty == b""
        if fmt == "vllm":  # vLLM's replay frames carry the topic, as the PUB frames do
            topic, *frames = frames
            assert topic == b"t"
        seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if seq == -1:
            assert payload == b""
            break
        replayed[seq] = payload
    assert sorted(replayed) == list(range(start_seq, max(live) + 1))
    assert all(replayed[seq] == live[seq] for seq in replayed if seq in live)
    assert all(isinstance(DECODER.decode(p), Batch) for p in replayed.values())
