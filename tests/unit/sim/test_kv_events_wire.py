"""Each ``--kv-events-format`` is byte for byte what its engine's msgspec Structs encode.

The Structs below are the engines' own definitions (vLLM's ``vllm/distributed/kv_events.py`` before and after
its switch to maps, SGLang's ``python/sglang/srt/disaggregation/kv_events.py`` before and after), filled as the
engines fill them for a plain full-attention model on the GPU.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from smg_sim.kv_blocks import Cleared, KvEvent, Removed, Stored
from smg_sim.kv_events import encode_batch


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def _vllm_classes(*, array_like: bool) -> tuple[type, type, type]:
    class Event(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(Event):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(Event):
        block_hashes: list[int]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(Event):
        pass

    return BlockStored, BlockRemoved, AllBlocksCleared


class SglangEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


def _sglang_classes(*, array_like: bool) -> tuple[type, type, type]:
    # the array Structs have no omit_defaults; the map ones (after the switch) have
    class Event(msgspec.Struct, array_like=array_like, omit_defaults=not array_like, gc=False, tag=True):
        pass

    class BlockStored(Event):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None = None

    class BlockStoredMap(BlockStored, tag="BlockStored"):
        cache_salt: str | None = None
        session_id: str | None = None

    class BlockRemoved(Event):
        block_hashes: list[int]
        medium: str | None = None

    class AllBlocksCleared(Event):
        pass

    return (BlockStored if array_like else BlockStoredMap), BlockRemoved, AllBlocksCleared


EVENTS: list[KvEvent] = [
    Stored((2**64 - 1, 7), None, tuple(range(8)), 4),
    Stored((12345678901234567890,), 7, (200, 201, 202, 203), 4),
    Removed((7, 2**64 - 1)),
    Cleared(),
]


def _stored_fields(e: Stored) -> dict[str, Any]:
    return {
        "block_hashes": list(e.block_hashes),
        "parent_block_hash": e.parent_block_hash,
        "token_ids": list(e.token_ids),
        "block_size": e.block_size,
        "lora_id": None,
        "medium": "GPU",
    }


def _engine_batch(fmt: str, ts: float) -> bytes:
    if fmt.startswith("vllm"):
        stored, removed, cleared = _vllm_classes(array_like=fmt.endswith("-array"))
        events: list[Any] = []
        for e in EVENTS:
            if isinstance(e, Stored):
                fields = _stored_fields(e)
                events.append(
                    stored(
                        **fields,
                        lora_name=None,
                        extra_keys=[None] * len(e.block_hashes),
                        group_idx=0,
                        kv_cache_spec_kind="full_attention",
                    )
                )
            elif isinstance(e, Removed):
                events.append(removed(list(e.block_hashes), "GPU", 0))
            else:
                events.append(cleared())
        return msgspec.msgpack.encode(VllmEventBatch(ts, events, 0))
    stored, removed, cleared = _sglang_classes(array_like=fmt.endswith("-array"))
    events = []
    for e in EVENTS:
        if isinstance(e, Stored):
            events.append(stored(**_stored_fields(e)))
        elif isinstance(e, Removed):
            events.append(removed(list(e.block_hashes), "GPU"))
        else:
            events.append(cleared())
    return msgspec.msgpack.encode(SglangEventBatch(ts, events, 0))


@pytest.mark.parametrize("fmt", ["vllm", "vllm-array", "sglang", "sglang-array"])
def test_batches_are_byte_exact_to_the_engines_structs(fmt: Any) -> None:
    ts = 1789095808.8378847
    assert encode_batch(fmt, EVENTS, ts=ts) == _engine_batch(fmt, ts)


def test_tagged_formats_are_maps_in_a_positional_batch_and_array_formats_arrays() -> None:
    ts = 1.5
    vllm = msgspec.msgpack.decode(encode_batch("vllm", EVENTS, ts=ts))
    assert vllm[0] == ts and vllm[2] == 0
    assert vllm[1][0] == {
        "type": "BlockStored",
        "block_hashes": [2**64 - 1, 7],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None, None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    assert vllm[1][3] == {"type": "AllBlocksCleared"}
    sglang_array = msgspec.msgpack.decode(encode_batch("sglang-array", EVENTS, ts=ts))
    assert sglang_array[1][0] == ["BlockStored", [2**64 - 1, 7], None, list(range(8)), 4, None, "GPU"]
    assert sglang_array[1][2] == ["BlockRemoved", [7, 2**64 - 1], "GPU"]
    assert sglang_array[1][3] == ["AllBlocksCleared"]
