"""A resumable LRU eviction of one tenant of a ``RadixTree``: bounded steps, the tree usable in between.

``RadixTree.eviction(tenant, max_chars)`` makes one; ``step(budget)`` does about ``budget`` units of work
and says whether more remain; ``run()`` does it all at once (``RadixTree.evict_tenant``). Phases:

1. collect: a depth-first walk of the nodes the tenant holds (they form a subtree under the root: prefix
   closure), a unit per node, queueing the tenant's leaves on a heap keyed by (tick, creation seq) --
   least recently used first, ties oldest first;
2. evict: a unit per heap entry, evict leaves until the tenant is within ``max_chars``; when a node goes,
   its parent is queued if it became a leaf of the tenant; emptied nodes are pruned;
3. merge: a unit per candidate, lossless merges around what changed; a reverse index that shrank to a
   quarter or less (and is small) is then rebuilt, since a dict never gives its table back by itself;
4. release: what the job still references (queued nodes, candidates, heap keys) is let go a chunk at a
   time: a node pruned meanwhile is freed when its last reference goes, and freeing a million of them at
   once is itself a stall.

Between two steps anything may happen to the tree: so every entry is checked when it is popped (still
the tenant's, same tick -- else queued again with its new tick --, still a leaf), and the job ends early if
the tenant was removed; when its heap runs dry before the budget is met (a merge by other work absorbed
queued nodes, or the tenant grew new leaves), it walks the tenant's nodes again, up to ``_PASSES`` walks.
Without anything in between, the result is exactly the all-at-once LRU. Nothing is copied up front (no
snapshot of the index: a C-level copy of a 650k-node index alone takes ~16 ms here). Heap keys are plain
ints, not tuples: a job allocates no object the cycle collector tracks, so even a big eviction does not
bring on a full garbage collection; and its big lists are recycled from job to job (see ``_take``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from heapq import heappop, heappush
from typing import Any, Protocol

from ._node import Node

__all__ = ["Eviction"]


class _Tree(Protocol):
    """What a job uses of its ``RadixTree`` (its own module: radix_tree imports this one, not the reverse)."""

    _index: dict[str, dict[Node, None]]
    _sizes: dict[str, int]
    _root: Node
    _tick: int

    def tenant_size(self, tenant: str) -> int: ...
    def _prune(self, node: Node, candidates: list[Node]) -> int: ...
    def _merge(self, candidates: Iterable[Node]) -> None: ...


_POS_BITS = 32
_SEQ_BITS = 64
_POS_MASK = (1 << _POS_BITS) - 1
_TICK_SHIFT = _POS_BITS + _SEQ_BITS
_COLLECT, _EVICT, _MERGE, _RELEASE, _DONE = range(5)
_REBUILD_MAX = 1 << 15
"""Largest reverse index rebuilt after an eviction (a copy of ~1-5 ms: it walks the old, sparse table whole)."""
_RELEASE_PER_UNIT = 4
"""References let go per unit of work in the release phase (a decref, or the free of a pruned node)."""
_PASSES = 3
"""Walks of the tenant's nodes one job may make: another one when its heap ran dry before the budget was
met (a merge by other work absorbed queued nodes, or the tenant grew new leaves meanwhile)."""
_SPARE: list[list[Any]] = [[] for _ in range(8)]
"""Lists for jobs (made at import, so they are old by the first job) and the emptied lists of finished jobs:
see ``_take``."""


def _take() -> list[Any]:
    """A list for a job's queue, heap or candidates: an old one if there is one.

    A job's lists grow to hundreds of thousands of entries. A young list is traversed by every young-
    generation collection until the collector promotes it (a 12 ms pause for a 300k-entry queue,
    measured here, in whatever request happens to allocate then); a list that grew old while small costs
    nothing there, however big it grows later.
    """
    return _SPARE.pop() if _SPARE else []


def _give(refs: list[Any]) -> None:
    refs.clear()
    if len(_SPARE) < 16:
        _SPARE.append(refs)


class Eviction:
    """LRU eviction of ``tenant`` down to ``max_chars`` chars, in resumable steps of bounded work."""

    __slots__ = (
        "_candidates",
        "_heap",
        "_index",
        "_passes",
        "_phase",
        "_queued",
        "_stack",
        "_start_len",
        "_tree",
        "evicted",
        "max_chars",
        "tenant",
    )

    def __init__(self, tree: _Tree, tenant: str, max_chars: int) -> None:
        if max_chars < 0:
            raise ValueError(f"max_chars must be >= 0, got {max_chars}")
        self._tree = tree
        self.tenant = tenant
        self.max_chars = max_chars
        self.evicted = 0
        """Chars evicted so far."""
        index = self._index = tree._index.get(tenant)
        self._start_len = len(index) if index is not None else 0
        self._passes = 0
        if index is not None and tree.tenant_size(tenant) > max_chars:
            self._queued: list[Node | None] = _take()  # heap key -> node (by position); None once dealt with
            self._heap: list[int] = _take()
            self._candidates: list[Node] = _take()
            self._stack: list[Node] = _take()
            self._walk(index)
        else:
            self._queued, self._heap, self._candidates, self._stack = [], [], [], []
            self._phase = _DONE

    @property
    def done(self) -> bool:
        return self._phase == _DONE

    def run(self) -> int:
        """Finish the job at once; returns the chars evicted."""
        while self.step(1 << 62):
            pass
        return self.evicted

    def step(self, budget: int) -> bool:
        """Do about ``budget`` units of work; returns whether work remains."""
        if self._phase == _DONE:
            return False
        tree = self._tree
        index = self._index
        assert index is not None
        tree._tick += 1  # a mutation (match_and_insert checks no `choose` ran one)
        if self._phase < _MERGE and tree._index.get(self.tenant) is not index:
            self._phase = _MERGE  # removed, or emptied and back: nothing of this job applies any more
        while budget > 0:
            phase = self._phase
            if phase == _COLLECT:
                budget = self._collect(index, budget)
            elif phase == _EVICT:
                budget = self._evict(index, budget)
            elif phase == _MERGE:
                budget = self._merge(index, budget)
            elif phase == _RELEASE:
                budget = self._release(budget)
            else:
                return False
        return self._phase != _DONE

    def _walk(self, index: dict[Node, None]) -> None:
        """Start a (new) walk of the tenant's nodes."""
        self._passes += 1
        self._stack.extend(c for c in self._tree._root.children.values() if c in index)
        self._phase = _COLLECT

    def _queue(self, node: Node) -> None:
        queued = self._queued
        queued.append(node)
        heappush(self._heap, (node.tenants[self.tenant] << _TICK_SHIFT) | (node.seq << _POS_BITS) | (len(queued) - 1))

    def _collect(self, index: dict[Node, None], budget: int) -> int:
        stack, queued, heap, tenant = self._stack, self._queued, self._heap, self.tenant
        while budget > 0 and stack:
            node = stack.pop()
            budget -= 1
            if node not in index:
                continue  # evicted, absorbed or removed since it was stacked
            leaf = True
            for c in node.children.values():
                if c in index:
                    stack.append(c)
                    leaf = False
            if leaf:  # self._queue(node), inlined: this loop visits every node of the tenant
                queued.append(node)
                heappush(heap, (node.tenants[tenant] << _TICK_SHIFT) | (node.seq << _POS_BITS) | (len(queued) - 1))
        if not stack:
            self._phase = _EVICT
        return budget

    def _evict(self, index: dict[Node, None], budget: int) -> int:
        tree, tenant, queued, heap, cands = self._tree, self.tenant, self._queued, self._heap, self._candidates
        size = tree._sizes.get(tenant, 0)
        max_chars = self.max_chars
        root = tree._root
        evicted = 0
        while budget > 0 and size > max_chars and heap:
            key = heappop(heap)
            budget -= 1
            pos = key & _POS_MASK
            node = queued[pos]
            if node is None:
                continue
            if node not in index:
                queued[pos] = None  # evicted, absorbed or its entry taken meanwhile
                continue
            tenants = node.tenants
            tick = tenants[tenant]
            if tick != key >> _TICK_SHIFT:  # refreshed since it was queued: queue it again, as recent
                heappush(heap, (tick << _TICK_SHIFT) | (key & ((1 << _TICK_SHIFT) - 1)))
                continue
            queued[pos] = None
            for c in node.children.values():
                if c in index:
                    break  # grew a child of the tenant since: not a leaf (queued again if that child goes)
            else:
                del tenants[tenant]
                del index[node]
                elen = len(node.edge)
                size -= elen
                evicted += elen
                parent = node.parent
                if tenants:
                    cands.append(node)
                else:
                    budget -= tree._prune(node, cands)
                if parent is not None and parent is not root and parent in index:
                    for c in parent.children.values():
                        if c in index:
                            break
                    else:
                        self._queue(parent)
        self.evicted += evicted
        if size:
            tree._sizes[tenant] = size
        else:
            del tree._sizes[tenant]
            del tree._index[tenant]
        if size <= max_chars:
            self._phase = _MERGE
        elif not heap:
            if self._passes < _PASSES:
                self._walk(index)
            else:
                self._phase = _MERGE
        return budget

    def _merge(self, index: dict[Node, None], budget: int) -> int:
        tree, cands = self._tree, self._candidates
        n = min(len(cands), budget)
        if n:
            chunk = cands[-n:]
            del cands[-n:]
            tree._merge(chunk)
            return 0  # the last merges and the rebuild below (~1-5 ms on a sparse index) get a step each
        if (
            tree._index.get(self.tenant) is index
            and len(index) <= _REBUILD_MAX
            and 4 * len(index) <= self._start_len
            and sys.getsizeof(index) > 4 * sys.getsizeof({})
        ):
            tree._index[self.tenant] = dict(index)
            budget -= len(index) // 16
        self._phase = _RELEASE
        return budget

    def _release(self, budget: int) -> int:
        n = budget * _RELEASE_PER_UNIT
        for refs in (self._queued, self._heap, self._stack):
            if refs:
                k = min(n, len(refs))
                del refs[-k:]
                n -= k
                if n <= 0:
                    return 0
        for refs in (self._queued, self._heap, self._candidates, self._stack):
            _give(refs)
        self._queued, self._heap, self._candidates, self._stack = [], [], [], []
        self._phase = _DONE
        return n // _RELEASE_PER_UNIT
