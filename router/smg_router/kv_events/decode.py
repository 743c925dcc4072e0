"""The engines' KV event batches (msgpack) into one set of typed events, whatever engine and version sent them.

A payload is an ``EventBatch`` ``(ts, events, dp_rank)``; each event is ``BlockStored``, ``BlockRemoved`` or
``AllBlocksCleared``.  Four shapes exist on the wire and may meet in one fleet during a rollout:

- vLLM before PR #42892 and SGLang before PR #37482: the batch and every event are positional arrays
  (msgspec ``array_like``), an event's tag first.  vLLM's ``BlockStored`` is ``[tag, hashes, parent, tokens,
  block_size, lora_id, medium, lora_name, extra_keys, group_idx, ...]`` (trailing defaults omitted); SGLang's
  is ``[tag, hashes, parent, tokens, block_size, lora_id, medium]`` plus, when the request was salted, an
  eighth element ``{"cache_salt": ...}``.  Element 7 is told apart by its type: a string or nil is vLLM's
  ``lora_name``, a map is SGLang's metadata.
- vLLM from #42892 and SGLang from #37482: every event is a map with a ``"type"`` field, read by field
  name; the batch stays an array on both, and a map batch (``ts``, ``events``, ``data_parallel_rank`` or
  ``attn_dp_rank``) is read as well.

Unknown fields and trailing elements are ignored; an event of an unknown type is counted in
``EventBatch.ignored`` and skipped.  Anything else that does not fit raises ``InvalidBatch``.

Speed: the whole batch is decoded in one typed msgspec call (in C: types checked, no intermediate objects),
first as map events, then as positional ones; only a batch neither fits (unknown event types, both shapes in
one batch, garbage) takes the slow path, which decodes it untyped and converts event by event.  What remains
in Python is one small object per event and, for engines that hash blocks to bytes, their conversion to int.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import msgspec

__all__ = ["Cleared", "Event", "EventBatch", "InvalidBatch", "Removed", "Stored", "decode_batch"]


class InvalidBatch(ValueError):
    """A payload that is not a KV event batch; the message says what is wrong."""


class Stored(msgspec.Struct, frozen=True, gc=False):
    """Blocks the engine now caches: a chain, each block's parent the one before it, the first's ``parent``."""

    block_hashes: list[int]
    parent: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    medium: str | None = None
    namespace: str | None = None
    """The request's cache salt where the engine says it (SGLang's ``cache_salt``, vLLM's first ``extra_keys``
    entry): blocks of equal tokens in different namespaces are different blocks."""


class Removed(msgspec.Struct, frozen=True, gc=False):
    """Blocks the engine evicted (from ``medium`` when it says which)."""

    block_hashes: list[int]
    medium: str | None = None


class Cleared(msgspec.Struct, frozen=True, gc=False):
    """The engine dropped every cached block."""


Event = Stored | Removed | Cleared


class EventBatch(msgspec.Struct, frozen=True, gc=False):
    """One payload's events in the engine's order."""

    ts: float
    events: list[Event]
    dp_rank: int | None = None
    ignored: int = 0
    """Events of a type this router does not know, skipped."""


# --- the wire: every shape the engines publish -------------------------------------------------------------------
# Hashes are ints (SGLang; vLLM's 64-bit hash algorithms) or bytes (vLLM's sha256 family); `int | bytes` lets
# msgspec check them in C, `_ints` makes them one type.

_Hash = int | bytes


class _ArrayStored(msgspec.Struct, array_like=True, tag="BlockStored", gc=False):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name_or_metadata: str | dict[str, Any] | None = None  # vLLM: lora_name; SGLang: {"cache_salt": ...}
    extra_keys: list[Any] | None = None  # vLLM only


class _ArrayRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: list[_Hash]
    medium: str | None = None


class _ArrayCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


class _MapStored(msgspec.Struct, tag_field="type", tag="BlockStored", gc=False):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None  # vLLM
    cache_salt: str | None = None  # SGLang from #37482
    metadata: dict[str, Any] | None = None  # SGLang's map proposal before #37482 (#37271): {"cache_salt": ...}


class _MapRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved", gc=False):
    block_hashes: list[_Hash]
    medium: str | None = None


class _MapCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared", gc=False):
    pass


_ArrayEvent = _ArrayStored | _ArrayRemoved | _ArrayCleared
_MapEvent = _MapStored | _MapRemoved | _MapCleared


class _ArrayBatchOfMaps(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_MapEvent]
    dp_rank: int | None = None


class _ArrayBatchOfArrays(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrayEvent]
    dp_rank: int | None = None


class _MapBatchOfMaps(msgspec.Struct, gc=False):
    ts: float
    events: list[_MapEvent]
    data_parallel_rank: int | None = None  # vLLM
    attn_dp_rank: int | None = None  # SGLang


class _MapBatchOfArrays(msgspec.Struct, gc=False):
    ts: float
    events: list[_ArrayEvent]
    data_parallel_rank: int | None = None
    attn_dp_rank: int | None = None


class _Envelope(msgspec.Struct, array_like=True, gc=False):
    """The slow path's outer shape: events kept as raw bytes, to be read one by one."""

    ts: float
    events: list[msgspec.Raw]
    dp_rank: int | None = None


class _MapEnvelope(msgspec.Struct, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None
    attn_dp_rank: int | None = None


_ARRAY_DECODERS: Final = (
    msgspec.msgpack.Decoder(_ArrayBatchOfMaps),
    msgspec.msgpack.Decoder(_ArrayBatchOfArrays),
)
_MAP_DECODERS: Final = (
    msgspec.msgpack.Decoder(_MapBatchOfMaps),
    msgspec.msgpack.Decoder(_MapBatchOfArrays),
)
_ARRAY_ENVELOPE: Final = msgspec.msgpack.Decoder(_Envelope)
_MAP_ENVELOPE: Final = msgspec.msgpack.Decoder(_MapEnvelope)
_ARRAY_EVENT: Final = msgspec.msgpack.Decoder(_ArrayEvent)
_MAP_EVENT: Final = msgspec.msgpack.Decoder(_MapEvent)
_UNTYPED: Final = msgspec.msgpack.Decoder()
_KNOWN_TAGS: Final = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})
_CLEARED: Final = Cleared()


def decode_batch(payload: bytes) -> EventBatch:
    """One published payload as typed events; raises ``InvalidBatch`` for anything that is not one."""
    if not payload:
        raise InvalidBatch("empty payload")
    is_map = _is_map(payload[0])
    for decoder in _MAP_DECODERS if is_map else _ARRAY_DECODERS:
        try:
            wire = decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            continue
        rank = wire.dp_rank if isinstance(wire, _ArrayBatchOfMaps | _ArrayBatchOfArrays) else _rank(wire)
        return EventBatch(wire.ts, [_CONVERT[type(ev)](ev) for ev in wire.events], rank)
    return _slow(payload, is_map)


def _is_map(first: int) -> bool:
    """msgpack: fixmap 0x80-0x8f, map16 0xde, map32 0xdf."""
    return 0x80 <= first <= 0x8F or first == 0xDE or first == 0xDF


def _rank(wire: _MapBatchOfMaps | _MapBatchOfArrays | _MapEnvelope) -> int | None:
    return wire.data_parallel_rank if wire.data_parallel_rank is not None else wire.attn_dp_rank


def _slow(payload: bytes, is_map: bool) -> EventBatch:
    """Event by event: unknown types skipped and counted, the first bad event named."""
    env: _Envelope | _MapEnvelope
    try:
        if is_map:
            env = _MAP_ENVELOPE.decode(payload)
            rank = _rank(env)
        else:
            env = _ARRAY_ENVELOPE.decode(payload)
            rank = env.dp_rank
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidBatch(f"not a KV event batch: {exc}") from None
    except RecursionError:
        raise InvalidBatch("not a KV event batch: nested too deep") from None
    events: list[Event] = []
    ignored = 0
    for i, raw in enumerate(env.events):
        data = bytes(raw)
        try:
            wire = (_MAP_EVENT if _is_map(data[0]) else _ARRAY_EVENT).decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            tag = _tag_of(data)
            if tag is None:
                raise InvalidBatch(f"event {i}: neither a tagged array nor a map with a string 'type'") from None
            if tag in _KNOWN_TAGS:
                raise InvalidBatch(f"event {i} ({tag}): {exc}") from None
            ignored += 1
            continue
        events.append(_CONVERT[type(wire)](wire))
    return EventBatch(env.ts, events, rank, ignored)


def _tag_of(event: bytes) -> str | None:
    try:
        value = _UNTYPED.decode(event)
    except RecursionError:
        return None
    if isinstance(value, list) and value and isinstance(value[0], str):
        return value[0]
    if isinstance(value, dict) and isinstance(tag := value.get("type"), str):
        return tag
    return None


def _map_stored(ev: _MapStored) -> Stored:
    salt = ev.cache_salt
    if salt is None and ev.metadata is not None:
        salt = _salt_of_metadata(ev.metadata)
    if salt is None and ev.extra_keys and ev.parent_block_hash is None:
        salt = _salt_of_extra_keys(ev.extra_keys[0], ev.lora_name)
    return Stored(
        _ints(ev.block_hashes),
        _int(ev.parent_block_hash),
        ev.token_ids,
        ev.block_size,
        ev.lora_id,
        ev.lora_name,
        ev.medium,
        salt,
    )


def _array_stored(ev: _ArrayStored) -> Stored:
    slot = ev.lora_name_or_metadata
    lora_name = slot if isinstance(slot, str) else None
    salt = _salt_of_metadata(slot) if isinstance(slot, dict) else None
    if salt is None and ev.extra_keys and ev.parent_block_hash is None:
        salt = _salt_of_extra_keys(ev.extra_keys[0], lora_name)
    return Stored(
        _ints(ev.block_hashes),
        _int(ev.parent_block_hash),
        ev.token_ids,
        ev.block_size,
        ev.lora_id,
        lora_name,
        ev.medium,
        salt,
    )


def _removed(ev: _MapRemoved | _ArrayRemoved) -> Removed:
    return Removed(_ints(ev.block_hashes), ev.medium)


def _cleared(_: _MapCleared | _ArrayCleared) -> Cleared:
    return _CLEARED


_CONVERT: Final[dict[type, Callable[[Any], Event]]] = {
    _MapStored: _map_stored,
    _ArrayStored: _array_stored,
    _MapRemoved: _removed,
    _ArrayRemoved: _removed,
    _MapCleared: _cleared,
    _ArrayCleared: _cleared,
}


def _ints(hashes: list[_Hash]) -> list[int]:
    if bytes in map(type, hashes):  # a scan in C; only the bytes-hashing engines pay for the conversion
        return [h if type(h) is int else int.from_bytes(h, "big") for h in hashes]  # type: ignore[arg-type]
    return hashes  # type: ignore[return-value]  # every element is an int: checked just above


def _int(value: _Hash | None) -> int | None:
    return int.from_bytes(value, "big") if isinstance(value, bytes) else value


def _salt_of_metadata(metadata: dict[str, Any]) -> str | None:
    salt = metadata.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise InvalidBatch("BlockStored metadata: cache_salt is not a string")
    return salt


def _salt_of_extra_keys(first_block: object, lora_name: str | None) -> str | None:
    """vLLM keys a request's first block (the one without a parent) by its LoRA name, multimodal keys (pairs),
    then the salt; so a string that is not the LoRA name is the salt.  A typed key (a map with ``salt``, vLLM's
    ``CacheSaltKey``) says so itself.
    """
    if not isinstance(first_block, list | tuple):
        return None
    for key in reversed(first_block):
        if isinstance(key, str) and key != lora_name:
            return key
        if isinstance(key, dict) and isinstance(salt := key.get("salt"), str):
            return salt
    return None
