"""Unit tests of the prefix KV cache: matching, insertion, capacity and LRU eviction."""

from __future__ import annotations

import random

import pytest
from smg_sim.kvcache import PrefixCache
from smg_sim.tokens import encode


def t(text: str) -> list[int]:
    return encode(text)


def test_empty_cache_matches_nothing() -> None:
    cache = PrefixCache(100)
    assert cache.match(t("hello")) == 0
    assert cache.size == 0


def test_insert_then_match_prefixes() -> None:
    cache = PrefixCache(100)
    assert cache.insert(t("hello world")) == 11
    assert cache.match(t("hello world")) == 11
    assert cache.match(t("hello world, again")) == 11
    assert cache.match(t("hello")) == 5
    assert cache.match(t("help")) == 3
    assert cache.match(t("xyz")) == 0


def test_insert_splits_edges_and_counts_only_new_tokens() -> None:
    cache = PrefixCache(100)
    cache.insert(t("abcdef"))
    assert cache.insert(t("abcxyz")) == 3
    assert cache.size == 9
    assert cache.match(t("abcdef")) == 6
    assert cache.match(t("abcxyz")) == 6
    assert cache.match(t("abq")) == 2
    assert cache.insert(t("abc")) == 0
    assert cache.insert(t("abcdefgh")) == 2
    assert cache.size == 11


def test_lru_leaf_is_evicted_first() -> None:
    cache = PrefixCache(10)
    cache.insert(t("aaaaa"))
    cache.insert(t("bbbbb"))
    assert cache.size == 10
    cache.match(t("aaaaa"))  # touch: now "bbbbb" is least recently used
    cache.insert(t("ccccc"))
    assert cache.size == 10
    assert cache.match(t("bbbbb")) == 0
    assert cache.match(t("aaaaa")) == 5
    assert cache.match(t("ccccc")) == 5


def test_shared_prefix_survives_eviction_of_leaves() -> None:
    cache = PrefixCache(12)
    cache.insert(t("sysAAAA"))
    cache.insert(t("sysBBBB"))
    assert cache.size == 11
    cache.insert(t("sysCCCC"))
    assert cache.size <= 12
    assert cache.match(t("sysAAAA")) == 3  # its leaf went, the shared "sys" stayed
    assert cache.match(t("sysBBBB")) == 7
    assert cache.match(t("sysCCCC")) == 7


def test_insert_longer_than_capacity_is_truncated() -> None:
    cache = PrefixCache(5)
    cache.insert(t("0123456789"))
    assert cache.size == 5
    assert cache.match(t("0123456789")) == 5


def test_explicit_evict_and_clear() -> None:
    cache = PrefixCache(100)
    for word in ("alpha", "beta", "gamma", "delta"):
        cache.insert(t(word))
    assert cache.size == 19
    evicted = cache.evict(10)
    assert evicted >= 9
    assert cache.size <= 10
    assert cache.match(t("delta")) == 5  # most recently inserted survives
    cache.clear()
    assert cache.size == 0
    assert cache.match(t("delta")) == 0


def test_negative_capacity_rejected() -> None:
    with pytest.raises(ValueError):
        PrefixCache(-1)


def test_matches_naive_model_without_capacity_pressure() -> None:
    rng = random.Random(7)
    cache = PrefixCache(1_000_000)
    inserted: list[list[int]] = []

    def naive(query: list[int]) -> int:
        best = 0
        for seq in inserted:
            n = 0
            while n < min(len(seq), len(query)) and seq[n] == query[n]:
                n += 1
            best = max(best, n)
        return best

    for _ in range(300):
        seq = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        if rng.random() < 0.5:
            inserted.append(seq)
            cache.insert(seq)
        else:
            assert cache.match(seq) == naive(seq)
    distinct_tokens = len({tuple(s[:i]) for s in inserted for i in range(1, len(s) + 1)})
    assert cache.size == distinct_tokens


def test_size_never_exceeds_capacity_under_random_inserts() -> None:
    rng = random.Random(11)
    cache = PrefixCache(50)
    for _ in range(500):
        cache.insert([rng.randrange(4) for _ in range(rng.randrange(1, 30))])
        assert cache.size <= 50


def test_pinned_tokens_are_never_evicted_and_count_once() -> None:
    cache = PrefixCache(capacity=1000)
    shared = encode("s" * 300)
    cache.insert(shared + encode("a" * 100))
    cache.insert(shared + encode("b" * 100))
    a = cache.pin(shared + encode("a" * 100), 400)
    b = cache.pin(shared + encode("b" * 100), 350)  # the edge of b's tail is split where the pin ends
    assert cache.locked == 300 + 100 + 50  # the shared 300 once
    assert cache.unpinned(shared + encode("b" * 100), 400) == 50
    cache.evict(0)
    assert cache.match(shared + encode("a" * 100)) == 400  # pinned: kept
    assert cache.match(shared + encode("b" * 100)) == 350  # its unpinned last 50 went
    cache.insert(shared + encode("c" * 100))  # splits nothing pinned wrongly: a later split keeps the counts
    cache.unpin(a)
    assert cache.locked == 350
    cache.unpin(b)
    assert cache.locked == 0
    cache.evict(0)
    assert cache.size == 0


def test_a_pin_of_a_cleared_cache_is_forgotten() -> None:
    cache = PrefixCache(capacity=100)
    cache.insert(encode("x" * 50))
    pin = cache.pin(encode("x" * 50), 50)
    cache.clear()
    cache.insert(encode("x" * 50))
    cache.unpin(pin)  # no effect on the new cache's counts
    assert cache.locked == 0 and cache.size == 50


@pytest.mark.parametrize("seed", range(20))
def test_pins_and_unpins_in_any_order_leave_the_counts_exact(seed: int) -> None:
    rng = random.Random(seed)
    cache = PrefixCache(capacity=5000)
    prompts = [encode("".join(rng.choice("ab") for _ in range(rng.randint(5, 60)))) for _ in range(30)]
    pins = []
    for p in prompts:
        cache.insert(p)
        if rng.random() < 0.6:
            pins.append(cache.pin(p, rng.randint(0, len(p))))
        if pins and rng.random() < 0.3:
            cache.unpin(pins.pop(rng.randrange(len(pins))))
        cache.evict(rng.randint(0, 400))
        for pin in pins:  # what is pinned is still there
            assert cache.match(list(pin.tokens)) >= pin.length
    for pin in pins:
        cache.unpin(pin)
    assert cache.locked == 0


class WalkingCache(PrefixCache):
    """The eviction rule stated plainly, as the cache did it before its heap lived across calls: gather every
    unpinned leaf, evict the least recently used (ties by id) until under the target, a parent left bare
    becoming a candidate in turn."""

    def evict(self, target_size: int) -> int:
        import heapq

        if self.size <= target_size:
            return 0
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock == 0]
        heapq.heapify(heap)
        evicted = 0
        while self._size > target_size and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self._size -= len(leaf.key)
            evicted += len(leaf.key)
            if parent is not self._root and not parent.children and parent.lock == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return evicted


def cached_paths(cache: PrefixCache) -> set[tuple[int, ...]]:
    """Every root-to-leaf token run the cache holds (its content, whatever its node layout)."""
    out: set[tuple[int, ...]] = set()
    stack = [(cache._root, ())]
    while stack:
        node, path = stack.pop()
        path = path + node.key
        if not node.children and path:
            out.add(path)
        stack.extend((child, path) for child in node.children.values())
    return out


@pytest.mark.parametrize("seed", range(40))
def test_eviction_evicts_exactly_what_the_plain_rule_evicts(seed: int) -> None:
    """The heap kept across calls (stale entries skipped, rebuilt when they pile up) against the plain rule, on
    random inserts, matches, pins, unpins, explicit evictions and clears: the same tokens evicted by every call,
    the same content after every step.  Small rebuild thresholds make the rebuild happen too."""
    rng = random.Random(seed)
    capacity = rng.choice([40, 200, 1000])
    fast, plain = PrefixCache(capacity), WalkingCache(capacity)
    fast._rebuild_at = rng.choice([8, 64, 4096])
    groups = [encode("".join(rng.choice("abc") for _ in range(rng.randint(1, 30)))) for _ in range(6)]
    pins: list[tuple[object, object]] = []
    for _ in range(400):
        op = rng.random()
        prompt = rng.choice(groups) + encode("".join(rng.choice("abcd") for _ in range(rng.randint(0, 40))))
        if op < 0.4:
            assert fast.insert(prompt) == plain.insert(prompt)
        elif op < 0.6:
            assert fast.match(prompt) == plain.match(prompt)
        elif op < 0.75:
            length = rng.randint(0, len(prompt))
            pins.append((fast.pin(prompt, length), plain.pin(prompt, length)))
        elif op < 0.9 and pins:
            a, b = pins.pop(rng.randrange(len(pins)))
            fast.unpin(a)  # type: ignore[arg-type]
            plain.unpin(b)  # type: ignore[arg-type]
        elif op < 0.99:
            target = rng.randint(0, capacity)
            assert fast.evict(target) == plain.evict(target)
        else:
            fast.clear()
            plain.clear()
            pins.clear()
        assert (fast.size, fast.locked) == (plain.size, plain.locked)
        assert cached_paths(fast) == cached_paths(plain)
