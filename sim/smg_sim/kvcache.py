"""Prefix (radix) KV cache of the simulated engine.

Plays the role of SGLang's RadixCache: the engine asks how many leading prompt tokens are already
cached (those skip prefill) and inserts prompts and outputs once computed. Capacity is in tokens; when
full, least recently used leaves are evicted first, so shared prefixes (system prompts) survive longest.
Pure data structure: no asyncio, no clocks (recency is a logical counter, which keeps eviction order
deterministic in tests).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence


class _Node:
    """One edge of the radix tree: `key` is the token run leading from `parent` to this node."""

    __slots__ = ("children", "key", "last_access", "parent")

    def __init__(self, key: tuple[int, ...], parent: _Node | None, last_access: int) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.last_access = last_access


def _common_len(a: Sequence[int], a_start: int, b: tuple[int, ...]) -> int:
    """Length of the common prefix of a[a_start:] and b."""
    n = min(len(a) - a_start, len(b))
    i = 0
    while i < n and a[a_start + i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Token radix tree with a capacity in tokens and LRU-leaf eviction."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._tick = itertools.count(1)
        self._root = _Node((), None, 0)
        self._size = 0

    @property
    def size(self) -> int:
        """Number of tokens currently cached."""
        return self._size

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
                break
            common = _common_len(tokens, pos, child.key)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = now
            node = child
            pos += common
        self.evict(self.capacity)
        return added

    def evict(self, target_size: int) -> int:
        """Evict LRU leaves until at most `target_size` tokens remain; return tokens evicted."""
        if self._size <= target_size:
            return 0
        heap = [(n.last_access, id(n), n) for n in self._leaves()]
        heapq.heapify(heap)
        evicted = 0
        while self._size > target_size and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self._size -= len(leaf.key)
            evicted += len(leaf.key)
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return evicted

    def clear(self) -> None:
        """Drop everything (like SGLang's /flush_cache)."""
        self._root = _Node((), None, 0)
        self._size = 0

    def _split(self, child: _Node, at: int) -> _Node:
        """Split `child`'s edge after `at` tokens; return the new intermediate node."""
        parent = child.parent
        assert parent is not None
        middle = _Node(child.key[:at], parent, child.last_access)
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
