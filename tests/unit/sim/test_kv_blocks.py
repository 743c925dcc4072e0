"""The block tracker against the cache itself: what was announced stored and not removed is what the cache holds.

After any sequence of inserts, matches, pins, unpins, evictions and clears, replaying the events (stored adds,
removed takes away, cleared empties) gives exactly the full blocks of the cache's paths, computed from the
paths alone; and no event removes a block that was not stored.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from smg_sim.kv_blocks import BlockTracker, Cleared, KvEvent, Removed, Stored, block_hashes
from smg_sim.kvcache import Pin, PrefixCache

SETTINGS = settings(max_examples=400, deadline=None, database=None)

_tokens = st.lists(st.integers(0, 2), max_size=14)
_op = st.one_of(
    st.tuples(st.just("insert"), _tokens),
    st.tuples(st.just("match"), _tokens),
    st.tuples(st.just("pin"), _tokens),
    st.tuples(st.just("unpin"), st.integers(0, 7)),
    st.tuples(st.just("evict"), st.integers(0, 20)),
    st.tuples(st.just("clear"), st.none()),
)


def held_blocks(cache: PrefixCache, block_size: int) -> set[int]:
    """Every full block of every root-to-leaf path, by hash (a shared prefix yields the same hashes)."""
    return {h for path in cache.paths() for h in block_hashes(path, block_size)}


class Replay:
    """The announced state: events applied in order."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.events: list[KvEvent] = []

    def __call__(self, event: KvEvent) -> None:
        self.events.append(event)
        if isinstance(event, Stored):
            assert len(event.token_ids) == len(event.block_hashes) * event.block_size
            assert not self.blocks & set(event.block_hashes), "a block announced twice"
            assert event.parent_block_hash is None or event.parent_block_hash in self.blocks
            self.blocks.update(event.block_hashes)
        elif isinstance(event, Removed):
            assert set(event.block_hashes) <= self.blocks, "a block removed that was never stored"
            self.blocks.difference_update(event.block_hashes)
        else:
            assert isinstance(event, Cleared)
            self.blocks.clear()


@SETTINGS
@given(
    ops=st.lists(_op, max_size=40),
    block_size=st.integers(1, 4),
    capacity=st.integers(1, 24),
)
def test_announced_blocks_are_the_cached_full_blocks(
    ops: list[tuple[str, object]], block_size: int, capacity: int
) -> None:
    replay = Replay()
    cache = PrefixCache(capacity, observer=BlockTracker(block_size=block_size, sink=replay))
    pins: list[Pin] = []
    for name, arg in ops:
        if name == "insert":
            assert isinstance(arg, list)
            cache.insert(arg)
        elif name == "match":
            assert isinstance(arg, list)
            cache.match(arg)
        elif name == "pin":
            assert isinstance(arg, list)
            pins.append(cache.pin(arg, cache.match(arg)))
        elif name == "unpin" and pins:
            assert isinstance(arg, int)
            cache.unpin(pins.pop(arg % len(pins)))
        elif name == "evict":
            assert isinstance(arg, int)
            cache.evict(arg)
        elif name == "clear":
            cache.clear()
        assert replay.blocks == held_blocks(cache, block_size)


def test_a_prompt_is_stored_as_its_full_blocks_with_its_tokens() -> None:
    events: list[KvEvent] = []
    cache = PrefixCache(100, observer=BlockTracker(block_size=4, sink=events.append))
    cache.insert(list(range(10)))
    hashes = block_hashes(list(range(10)), 4)
    assert events == [Stored(tuple(hashes), None, tuple(range(8)), 4)]
    events.clear()
    cache.insert([*range(10), 10, 11, 12])  # fills the third block: only it is new, chained to the second
    assert events == [Stored((block_hashes(list(range(13)), 4)[2],), hashes[1], (8, 9, 10, 11), 4)]


def test_evicting_a_leaf_that_cuts_into_a_block_removes_that_block() -> None:
    events: list[KvEvent] = []
    cache = PrefixCache(100, observer=BlockTracker(block_size=4, sink=events.append))
    cache.insert([1, 2, 3, 4, 5, 6])
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8, 9])  # the leaf [7, 8, 9] completes block 2 ([5, 6, 7, 8])
    events.clear()
    cache.evict(6)
    assert events == [Removed((block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)[1],))]
    assert held_blocks(cache, 4) == set(block_hashes([1, 2, 3, 4], 4))


def test_a_cache_without_observer_does_no_tracking() -> None:
    cache = PrefixCache(10)
    assert cache.observer is None
    cache.insert(list(range(20)))
    cache.clear()
