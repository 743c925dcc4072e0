"""decode_batch reads every shape vLLM and SGLang publish, and turns anything else into InvalidBatch.

The golden payloads are bytes as the engines put them on the wire, written out here so the test does not depend
on an encoder of ours.  Each was made once with msgspec from structs that copy the engine's own, named above it
(repository, file, and the commit or pull request the schema comes from).
"""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from smg_router.kv_events import Cleared, EventBatch, InvalidBatch, Removed, Stored, decode_batch

H1 = int.from_bytes(b"\x11" * 32, "big")
H2 = int.from_bytes(b"\x22" * 32, "big")

# vllm-project/vllm, vllm/distributed/kv_events.py at b4e69e0af33f4698e157a262cc787fe61983cd3d: the first
# release of KV events; batch [ts, events], BlockStored [tag, hashes, parent, tokens, block_size, lora_id].
VLLM_FIRST = bytes.fromhex(
    "92cb40280000000000009296ab426c6f636b53746f72656492f90903920a0b010292ac426c6f636b52656d6f7665649109"
)

# vllm-project/vllm, vllm/distributed/kv_events.py before PR #42892 (v0.22/v0.23, as its type stub has it): all
# array_like with omit_defaults; BlockStored adds medium, lora_name, extra_keys; batch adds data_parallel_rank.
# Hashes are bytes (sha256); the first block's extra_keys carry the cache salt.
VLLM_POSITIONAL = bytes.fromhex(
    "93cb41d954fc402000009499ab426c6f636b53746f72656492c42011111111111111111111111111111111111111111111111111"
    "11111111111111c4202222222222222222222222222222222222222222222222222222222222222222c098010203040506070804"
    "c0a3475055c09291a874656e616e742d61c099ab426c6f636b53746f72656491c420222222222222222222222222222222222222"
    "2222222222222222222222222222c420111111111111111111111111111111111111111111111111111111111111111194050607"
    "0804c0a3475055c0c093ac426c6f636b52656d6f76656491c4201111111111111111111111111111111111111111111111111111"
    "111111111111a347505591b0416c6c426c6f636b73436c656172656400"
)

# vllm-project/vllm, vllm/distributed/kv_events.py at 0181ea3173e53eea8cf04a86891488e3dc89bb34: after PR #42892
# events are maps tagged by "type", and at this commit the batch is a map as well; group_idx, kv_cache_spec_kind.
VLLM_MAP = bytes.fromhex(
    "83a27473cb41d954fc40500000a66576656e7473938ba474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573"
    "92cfdab89baa7b5857c02ab1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647394ce0002505ccd0368ccc6cd"
    "2368aa626c6f636b5f73697a6502a76c6f72615f696401a66d656469756da3475055a96c6f72615f6e616d65a761646170746572"
    "aa65787472615f6b6579739293a76164617074657292a46d6d2d3100a874656e616e742d6291a761646170746572a967726f7570"
    "5f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e84a474797065ac426c6f636b52"
    "656d6f766564ac626c6f636b5f686173686573912aa66d656469756da3475055a967726f75705f6964780081a474797065b0416c"
    "6c426c6f636b73436c6561726564b2646174615f706172616c6c656c5f72616e6b01"
)

# The same events under the positional batch PR #42892 kept: what vLLM v0.26 publishes (the batch
# [ts, [{"type": "BlockStored", ...}], rank] as reported in volcano-sh/kthena#1535).
VLLM_MAP_EVENTS = bytes.fromhex(
    "93cb41d954fc40500000938ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cfdab89baa7b5857c0"
    "2ab1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647394ce0002505ccd0368ccc6cd2368aa626c6f636b5f73"
    "697a6502a76c6f72615f696401a66d656469756da3475055a96c6f72615f6e616d65a761646170746572aa65787472615f6b6579"
    "739293a76164617074657292a46d6d2d3100a874656e616e742d6291a761646170746572a967726f75705f69647800b26b765f63"
    "616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e84a474797065ac426c6f636b52656d6f766564ac626c6f"
    "636b5f686173686573912aa66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c65"
    "6172656401"
)

# sgl-project/sglang, python/sglang/srt/disaggregation/kv_events.py at 006d053f182f9b488d2bd841afa06d5f9120a258:
# vLLM's first schema, batch [ts, events].
SGLANG_FIRST = bytes.fromhex(
    "92cb40080000000000009291b0416c6c426c6f636b73436c656172656496ab426c6f636b53746f726564910504910901c0"
)

# sgl-project/sglang, python/sglang/srt/disaggregation/kv_events.py with BlockStoredWithMetadata (PR #30827, before
# PR #37482): array_like without omit_defaults, so BlockStored is 7 elements, and a salted one an eighth,
# {"cache_salt": ...}; batch [ts, events, attn_dp_rank].
SGLANG_POSITIONAL = bytes.fromhex(
    "93cb41d954fc408000009497ab426c6f636b53746f726564926566c0940102030402c0a347505598ab426c6f636b53746f726564"
    "91ccc9c092010202c0a347505581aa63616368655f73616c74a874656e616e742d6393ac426c6f636b52656d6f7665649165aa43"
    "50555f50494e4e454491b0416c6c426c6f636b73436c656172656400"
)

# SGLang from PR #37482 (sgl-project/sglang#37482, and #38561 where it closed the salt bug): events are maps tagged
# by "type", cache_salt and session_id optional fields of BlockStored; the batch stays [ts, events, attn_dp_rank].
SGLANG_MAP = bytes.fromhex(
    "93cb41d954fc40e000009489a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cd012db1706172656e"
    "745f626c6f636b5f68617368c0a9746f6b656e5f696473920708aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469"
    "756da3475055aa63616368655f73616c74a874656e616e742d64aa73657373696f6e5f6964a3732d3189a474797065ab426c6f63"
    "6b53746f726564ac626c6f636b5f68617368657391cd012eb1706172656e745f626c6f636b5f68617368cd012da9746f6b656e5f"
    "69647392090aaa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055aa63616368655f73616c74c0aa73"
    "657373696f6e5f6964c083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657392cd012dcd012ea66d65"
    "6469756da347505581a474797065b0416c6c426c6f636b73436c656172656403"
)


def test_vllm_first_positional_schema_decodes() -> None:
    assert decode_batch(VLLM_FIRST) == EventBatch(
        ts=12.0,
        events=[
            Stored(block_hashes=[-7, 9], parent=3, token_ids=[10, 11], block_size=1, lora_id=2),
            Removed(block_hashes=[9]),
        ],
    )


def test_vllm_positional_batch_decodes_with_bytes_hashes_as_ints_and_the_salt_as_namespace() -> None:
    assert decode_batch(VLLM_POSITIONAL) == EventBatch(
        ts=1700000000.5,
        events=[
            Stored(
                block_hashes=[H1, H2],
                parent=None,
                token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                block_size=4,
                medium="GPU",
                namespace="tenant-a",
            ),
            Stored(block_hashes=[H2], parent=H1, token_ids=[5, 6, 7, 8], block_size=4, medium="GPU"),
            Removed(block_hashes=[H1], medium="GPU"),
            Cleared(),
        ],
        dp_rank=0,
    )


VLLM_MAP_EVENTS_DECODED = [
    Stored(
        block_hashes=[15760518052499183552, 42],
        parent=None,
        token_ids=[151644, 872, 198, 9064],
        block_size=2,
        lora_id=1,
        lora_name="adapter",
        medium="GPU",
        namespace="tenant-b",
    ),
    Removed(block_hashes=[42], medium="GPU"),
    Cleared(),
]


def test_vllm_map_batch_of_map_events_decodes_by_field_name() -> None:
    assert decode_batch(VLLM_MAP) == EventBatch(ts=1700000001.25, events=VLLM_MAP_EVENTS_DECODED, dp_rank=1)


def test_vllm_positional_batch_of_map_events_decodes_by_field_name() -> None:
    assert decode_batch(VLLM_MAP_EVENTS) == EventBatch(ts=1700000001.25, events=VLLM_MAP_EVENTS_DECODED, dp_rank=1)


def test_sglang_first_positional_schema_decodes() -> None:
    assert decode_batch(SGLANG_FIRST) == EventBatch(
        ts=3.0, events=[Cleared(), Stored(block_hashes=[5], parent=4, token_ids=[9], block_size=1)]
    )


def test_sglang_positional_batch_decodes_and_the_metadata_element_gives_the_namespace() -> None:
    assert decode_batch(SGLANG_POSITIONAL) == EventBatch(
        ts=1700000002.0,
        events=[
            Stored(block_hashes=[101, 102], parent=None, token_ids=[1, 2, 3, 4], block_size=2, medium="GPU"),
            Stored(block_hashes=[201], parent=None, token_ids=[1, 2], block_size=2, medium="GPU", namespace="tenant-c"),
            Removed(block_hashes=[101], medium="CPU_PINNED"),
            Cleared(),
        ],
        dp_rank=0,
    )


def test_sglang_map_events_decode_and_cache_salt_gives_the_namespace() -> None:
    assert decode_batch(SGLANG_MAP) == EventBatch(
        ts=1700000003.5,
        events=[
            Stored(block_hashes=[301], parent=None, token_ids=[7, 8], block_size=2, medium="GPU", namespace="tenant-d"),
            Stored(block_hashes=[302], parent=301, token_ids=[9, 10], block_size=2, medium="GPU"),
            Removed(block_hashes=[301, 302], medium="GPU"),
            Cleared(),
        ],
        dp_rank=3,
    )


def test_unknown_event_types_are_skipped_and_counted_not_invalid() -> None:
    payload = msgspec.msgpack.encode(
        [
            1.0,
            [
                ["BlockInactive", [1]],
                {"type": "TierBlocksCleared", "medium": "CPU"},
                {"type": "BlockRemoved", "block_hashes": [7], "locality": "LOCAL"},
            ],
        ]
    )
    assert decode_batch(payload) == EventBatch(ts=1.0, events=[Removed(block_hashes=[7])], ignored=2)


def test_a_batch_mixing_positional_and_map_events_decodes_each_by_its_shape() -> None:
    payload = msgspec.msgpack.encode(
        [2.0, [["BlockRemoved", [1], "GPU"], {"type": "BlockRemoved", "block_hashes": [b"\x01\x00"]}], 5]
    )
    assert decode_batch(payload) == EventBatch(
        ts=2.0, events=[Removed(block_hashes=[1], medium="GPU"), Removed(block_hashes=[256])], dp_rank=5
    )


def test_unknown_fields_and_trailing_elements_are_ignored() -> None:
    payload = msgspec.msgpack.encode(
        {
            "type": "KVEventBatch",
            "ts": 1.0,
            "events": [["BlockStored", [1], None, [1], 1, None, "GPU", None, None, 0, "full", None, "extra"]],
            "future": {"x": 1},
        }
    )
    assert decode_batch(payload) == EventBatch(
        ts=1.0, events=[Stored(block_hashes=[1], parent=None, token_ids=[1], block_size=1, medium="GPU")]
    )


def _nested(depth: int) -> bytes:
    return b"\x93\xcb" + b"\x00" * 8 + b"\x91" * depth + b"\x90" + b"\xc0"


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        pytest.param(b"", "empty", id="empty"),
        pytest.param(b"\xc1\x00", "malformed", id="not-msgpack"),
        pytest.param(b"GET / HTTP/1.1\r\n\r\n", "batch", id="text"),
        pytest.param(msgspec.msgpack.encode("events"), "batch", id="a-string"),
        pytest.param(msgspec.msgpack.encode(["now", []]), "batch", id="ts-not-a-number"),
        pytest.param(msgspec.msgpack.encode([1.0, {"a": 1}]), "batch", id="events-not-a-list"),
        pytest.param(msgspec.msgpack.encode([1.0, [7]]), "event 0", id="event-not-a-record"),
        pytest.param(msgspec.msgpack.encode([1.0, [{"block_hashes": [1]}]]), "event 0", id="map-event-without-type"),
        pytest.param(msgspec.msgpack.encode([1.0, [["BlockStored", [1]]]]), "BlockStored", id="stored-too-short"),
        pytest.param(
            msgspec.msgpack.encode([1.0, [["BlockRemoved", ["x"]]]]), "BlockRemoved", id="hash-not-int-or-bytes"
        ),
        pytest.param(
            msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [True], 1, None]]]), "BlockStored", id="bool-token"
        ),
        pytest.param(
            msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1], "block_size": 1}]]),
            "BlockStored",
            id="map-stored-missing-fields",
        ),
        pytest.param(
            msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1], 1, None, "GPU", {"cache_salt": 5}]]]),
            "cache_salt",
            id="salt-not-a-string",
        ),
        pytest.param(SGLANG_POSITIONAL[:-9], "batch", id="truncated"),
        pytest.param(_nested(100_000), "batch", id="nested-100k-deep"),
    ],
)
def test_what_is_not_a_batch_raises_invalid_batch_naming_the_fault(payload: bytes, says: str) -> None:
    with pytest.raises(InvalidBatch, match=says):
        decode_batch(payload)


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=256))
def test_arbitrary_bytes_decode_or_raise_invalid_batch_only(payload: bytes) -> None:
    with contextlib.suppress(InvalidBatch):
        decode_batch(payload)


_leaf = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
_msgpack_values = st.recursive(
    _leaf | st.binary(max_size=8) | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]),
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8) | st.just("type"), inner, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=1000, deadline=None)
@given(_msgpack_values)
def test_arbitrary_msgpack_values_decode_or_raise_invalid_batch_only(value: object) -> None:
    with contextlib.suppress(InvalidBatch):
        decode_batch(msgspec.msgpack.encode(value))


def test_the_package_exports_exactly_its_public_names() -> None:
    import smg_router.kv_events as package

    expected = {"KINDS", "Cleared", "Counts", "Event", "EventBatch", "InvalidBatch", "Removed", "Stored", "Subscriber"}
    assert set(package.__all__) == expected | {"decode_batch"}
    assert len(package.__all__) == len(set(package.__all__))
    assert all(hasattr(package, name) for name in package.__all__)
