"""Prefix (radix) KV cache of the simulated engine.

Plays the role of SGLang's RadixCache: the engine asks how many leading prompt tokens are already
cached (those skip prefill) and inserts prompts and outputs once computed. Capacity is in tokens; when
full, least recently used leaves are evicted first, so shared prefixes (system prompts) survive longest.
Running requests pin what they use (``pin``/``unpin``, SGLang's ``lock_ref``): pinned tokens are never
evicted and count once however many requests share them.
Pure data structure: no asyncio, no clocks (recency is a logical counter, which keeps eviction order
deterministic in tests).

Cost: an engine's cache is on the request path of every simulated request, so a benchmark of a router in
front of the sim measures it too.  Eviction keeps its candidates (unpinned leaves, by last use) in a heap that
lives across calls, each change of a node pushing a fresh entry and stale ones skipped when popped, instead of
walking every node on every eviction (which made a full cache of a few thousand prompts cost milliseconds a
request); prefixes are compared a slice at a time, not token by token.

What it holds can be watched (``observer``, a `CacheObserver`: the KV-event block tracker): told of every run of
tokens added to a path, every leaf evicted (with its whole path) and every clear.  Without one the cache does no
extra work.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol


class CacheObserver(Protocol):
    """Told what enters and leaves a `PrefixCache` (called synchronously, inside the cache's own call)."""

    def added(self, path: Sequence[int], start: int) -> None:
        """``path`` is now cached, of which ``path[start:]`` was not before."""

    def evicted(self, path: Sequence[int], start: int) -> None:
        """``path[start:]`` left the cache (``path[:start]`` stays)."""

    def cleared(self) -> None:
        """Everything left the cache."""


class _Node:
    """One edge of the radix tree: `key` is the token run leading from `parent` to this node."""

    __slots__ = ("children", "key", "last_access", "lock", "parent")

    def __init__(self, key: tuple[int, ...], parent: _Node | None, last_access: int) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.last_access = last_access
        self.lock = 0
        """Running requests whose prompt passes through this node (SGLang's lock_ref): never evicted while > 0."""


@dataclass(frozen=True, slots=True)
class Pin:
    """What `PrefixCache.pin` locked: the first `length` tokens of `tokens`, in the cache of `generation`."""

    tokens: tuple[int, ...]
    length: int
    generation: int


def _common_len(a: Sequence[int], a_start: int, b: tuple[int, ...]) -> int:
    """Length of the common prefix of a[a_start:] and b: a binary search over slices (compared in C), each
    step comparing only the part not yet known to be equal."""
    lo, hi = 0, min(len(a) - a_start, len(b))
    if tuple(a[a_start : a_start + hi]) == b[:hi]:
        return hi  # the usual case: the whole edge (or the whole rest of `a`) matches
    hi -= 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tuple(a[a_start + lo : a_start + mid]) == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


_Entry = tuple[int, int, int, "_Node"]
"""(last_access, id, push number, node): an eviction candidate as it was when pushed (least recently used
first, ties by id; the push number keeps two entries of one node from comparing nodes)."""


class PrefixCache:
    """Token radix tree with a capacity in tokens and LRU-leaf eviction."""

    def __init__(self, capacity: int, *, observer: CacheObserver | None = None) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self.observer = observer
        self._tick = itertools.count(1)
        self._root = _Node((), None, 0)
        self._size = 0
        self._locked = 0
        self._generation = 0
        self._heap: list[_Entry] = []
        """Eviction candidates: every unpinned leaf has an entry with its current last_access (plus stale
        entries of nodes that changed since, skipped when popped; rebuilt when they pile up)."""
        self._rebuild_at = 4096
        self._pushes = itertools.count()

    @property
    def size(self) -> int:
        """Number of tokens currently cached."""
        return self._size

    @property
    def locked(self) -> int:
        """Tokens of the cache that running requests hold (pinned): shared between them, never evicted."""
        return self._locked

    def unpinned(self, tokens: Sequence[int], length: int) -> int:
        """How many of the first `length` tokens of `tokens` are cached but not pinned: what pinning them adds."""
        return sum(n for node, n in self._path(tokens, length, split=False) if node.lock == 0)

    def pin(self, tokens: Sequence[int], length: int) -> Pin:
        """Pin the cached part of the first `length` tokens of `tokens` (splitting the edge where it ends, so
        exactly those tokens are pinned) until `unpin`."""
        pinned = 0
        for node, n in self._path(tokens, length, split=True):
            if node.lock == 0:
                self._locked += len(node.key)
            node.lock += 1
            pinned += n
        return Pin(tuple(tokens[:pinned]), pinned, self._generation)

    def unpin(self, pin: Pin) -> None:
        if pin.generation != self._generation:
            return  # the cache was cleared since: nothing of it is left to unpin
        for node, _ in self._path(pin.tokens, pin.length, split=False):
            node.lock -= 1
            if node.lock == 0:
                self._locked -= len(node.key)
                self._candidate(node)

    def _path(self, tokens: Sequence[int], length: int, *, split: bool) -> Iterator[tuple[_Node, int]]:
        """(node, tokens of it on the path) along the cached part of the first `length` tokens.  With `split`,
        the edge where the part ends is split there first (a pin then covers whole nodes; a later split of
        a pinned node gives both halves its lock count, so an unpin walks exactly what the pin counted)."""
        node, pos = self._root, 0
        while pos < length:
            child = node.children.get(tokens[pos])
            if child is None:
                return
            common = min(_common_len(tokens, pos, child.key), length - pos)
            if common == 0:
                return
            if common < len(child.key):
                if not split:
                    yield child, common
                    return
                child = self._split(child, common)
            yield child, common
            pos += common
            node = child

    def match(self, tokens: Sequence[int]) -> int:
        """Length of the longest cached prefix of `tokens`; marks the matched path as recently used."""
        now = next(self._tick)
        node, pos = self._root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            common = _common_len(tokens, pos, child.key)
            child.last_access = now
            self._candidate(child)
            pos += common
            if common < len(child.key):
                break
            node = child
        return pos

    def insert(self, tokens: Sequence[int]) -> int:
        """Cache `tokens` (at most `capacity` of them); return how many tokens were newly added.

        Evicts least recently used leaves afterwards so the cache stays within capacity; the path just
        inserted is the most recently used, so it is evicted last.
        """
        tokens = tokens[: self.capacity]
        now = next(self._tick)
        node, pos, added = self._root, 0, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                leaf = _Node(tuple(tokens[pos:]), node, now)
                node.children[tokens[pos]] = leaf
                added = len(tokens) - pos
                self._size += added
                self._candidate(leaf)
                if self.observer is not None:
                    self.observer.added(tokens, pos)
                break
            common = _common_len(tokens, pos, child.key)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = now
            self._candidate(child)
            node = child
            pos += common
        self.evict(self.capacity)
        return added

    def evict(self, target_size: int) -> int:
        """Evict LRU leaves until at most `target_size` tokens remain; return tokens evicted."""
        if self._size <= target_size:
            return 0
        evicted = 0
        while self._size > target_size and self._heap:
            last_access, _, _, leaf = heapq.heappop(self._heap)
            if leaf.last_access != last_access or leaf.children or leaf.lock or not self._attached(leaf):
                continue  # stale: used, grown, pinned or evicted since it was pushed
            parent = leaf.parent
            assert parent is not None
            if self.observer is not None:
                path = self._tokens_to(leaf)
                self.observer.evicted(path, len(path) - len(leaf.key))
            del parent.children[leaf.key[0]]
            self._size -= len(leaf.key)
            evicted += len(leaf.key)
            if parent is not self._root:
                self._candidate(parent)
        return evicted

    def _candidate(self, node: _Node) -> None:
        """`node` may have become an eviction candidate, or changed its last use: push its entry as it is now."""
        if node.children or node.lock:
            return
        heapq.heappush(self._heap, (node.last_access, id(node), next(self._pushes), node))
        if len(self._heap) > self._rebuild_at:
            self._heap = [(n.last_access, id(n), next(self._pushes), n) for n in self._leaves() if n.lock == 0]
            heapq.heapify(self._heap)
            self._rebuild_at = max(4096, 4 * len(self._heap))

    def _attached(self, node: _Node) -> bool:
        parent = node.parent
        return parent is not None and parent.children.get(node.key[0]) is node

    def clear(self) -> None:
        """Drop everything (like SGLang's /flush_cache)."""
        self._root = _Node((), None, 0)
        self._size = 0
        self._locked = 0
        self._generation += 1
        self._heap = []
        if self.observer is not None:
            self.observer.cleared()

    def paths(self) -> list[tuple[int, ...]]:
        """The token path from the root to every leaf: what the cache holds is exactly their prefixes."""
        return [self._tokens_to(leaf) for leaf in self._leaves()]

    def _tokens_to(self, node: _Node) -> tuple[int, ...]:
        keys = []
        walk: _Node | None = node
        while walk is not None and walk is not self._root:
            keys.append(walk.key)
            walk = walk.parent
        return tuple(t for key in reversed(keys) for t in key)

    def _split(self, child: _Node, at: int) -> _Node:
        """Split `child`'s edge after `at` tokens; return the new intermediate node."""
        parent = child.parent
        assert parent is not None
        middle = _Node(child.key[:at], parent, child.last_access)
        middle.lock = child.lock  # the same requests pass through both halves
        parent.children[middle.key[0]] = middle
        child.key = child.key[at:]
        child.parent = middle
        middle.children[child.key[0]] = child
        return middle

    def _leaves(self) -> list[_Node]:
        leaves, stack = [], [self._root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self._root:
                leaves.append(node)
        return leaves
