"""Approximate, multi-tenant, character-level radix tree for cache-aware routing.

One tree is kept per (policy instance, model). Keys are the characters of a request's routing text
(no tokenizer); tenants are worker ids. The tree approximates which worker holds which prompt prefix
in its KV cache. Everything here is pure and synchronous: the router's event loop is the lock.

Layout
    * A node stores its edge label as a ``str`` slice, its children in a dict keyed by the first
      character of each child's edge, and ``tenants``: ``{tenant: tick}`` where the tick is the value of
      a tree-owned counter (incremented once per insert) at the tenant's last insert through the node.
      Ticks are not wall time, so everything (including eviction order) is deterministic.
    * Invariants: a tenant holding a node holds all its ancestors (prefix-closed); no non-root node has an
      empty edge or an empty tenant map; along any path a tenant's ticks never increase downwards.
    * ``_index[tenant]`` is a reverse index (insertion-ordered dict used as a set) of the nodes the tenant
      holds, so ``remove_tenant`` / ``evict_tenant`` never scan the whole tree.
    * ``_sizes[tenant]`` (sum of the edge lengths of the tenant's nodes), the total number of chars and the
      node count are maintained incrementally, so the corresponding getters are O(1).

Matching compares whole edges with ``str.startswith(edge, pos)``; on a mismatch inside an edge the
common prefix length is found by galloping (``text.startswith(edge[lo:lo + step], pos + lo)`` with steps
8, 64, 512, ...) to the window holding the mismatch, then a binary search in it: O(len) chars compared in
C, O(log len) Python steps, few steps for the common early mismatch, never a Python per-char loop.

Eviction (``evict_tenant``) is LRU over the tenant's *leaves* (nodes of the tenant with no child held by
the same tenant): a heap of ``(tick, seq, node)`` is built for the call (``seq`` is the node's creation
number, so ties are broken by creation order, oldest first); after the tenant leaves a node, its parent is
pushed if it became a leaf of the tenant. Whole nodes are evicted, so a call can go below ``max_chars``.
Building the heap costs O(nodes of the tenant); callers should evict to a low watermark rather than by a
few chars on every request.

Node merge: after ``remove_tenant`` / ``evict_tenant`` a non-root node whose only child has an *identical*
``{tenant: tick}`` map is merged with that child (the parent object absorbs the child's edge and
children). Requiring identical ticks (not merely the same tenant set) makes the merge lossless: match
results and the tick of every char are unchanged, so a hot shared prefix is never glued to a cold tail.
Only the pairs whose tenant maps or child count changed in the call are examined. Inserts never merge;
an insert ending inside an edge splits it (the upper part gets a copy of the tenant map, then is
refreshed), so chains of same-tenant nodes with different ticks are expected.

Measured (CPython 3.11.7 on a shared, noisy 2-core sandbox where a trivial method call costs ~0.3 us, so
expect 2-4x less on a server; ranges over runs). 10k prompts of 2000 chars (a 1200-char shared prefix from
4 or 50 "system prompts" + 800 unique chars), 8 tenants, ~18k nodes, 11.2M chars: insert while building
11-17 us; match of a stored prompt (~5 nodes deep) 4.5-7 us, of which the walk is ~2.8 us and building
the Match + frozenset ~0.6 us; match of a new prompt 4-7 us; match_and_insert of a new prompt 9-16 us.
A 4000-char text walking 40 nodes of 100 chars: 11-20 us (0.3-0.5 us per node). Common prefix inside
one 4000-char edge: 1.5 us (mismatch at char 2), 3.4 us (at 50), 9 us (at 3990). Multi-turn chat (500
conversations x 20 turns of +200 chars, ~20 nodes per path): match_and_insert 18-25 us. evict_tenant
halving a 1.1M-char tenant (~2.3k nodes): 9-14 ms; remove_tenant of such a tenant: 5-9 ms.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["Match", "RadixTree"]


@dataclass(slots=True, frozen=True)
class Match:
    """Result of a longest-prefix match."""

    matched_chars: int
    """Length of the longest prefix of the text present in the tree (for any tenant)."""
    tenants: frozenset[str]
    """Tenants holding the node where matching stopped (partially matched edge included); empty if
    ``matched_chars == 0``."""


_EMPTY: frozenset[str] = frozenset()
_NO_MATCH = Match(0, _EMPTY)


class _Node:
    __slots__ = ("children", "edge", "parent", "seq", "tenants")

    def __init__(self, edge: str, parent: _Node | None, seq: int, tenants: dict[str, int]) -> None:
        self.edge = edge
        self.parent = parent  # None for the root and for detached (dead) nodes
        self.seq = seq
        self.tenants = tenants
        self.children: dict[str, _Node] = {}

    def __repr__(self) -> str:  # debugging aid only
        return f"_Node({self.edge!r}, tenants={self.tenants!r}, children={len(self.children)})"


def _common_prefix_len(edge: str, text: str, pos: int) -> int:
    """Length of the common prefix of ``edge`` and ``text[pos:]``.

    Precondition: ``edge[0] == text[pos]`` (children are keyed by first char) and ``edge`` is not a
    full prefix of ``text[pos:]``. Gallops (chunks of 8, 64, 512, ... chars compared by ``startswith``)
    to the window holding the first mismatch, then binary-searches it: about 4 C-level comparisons for
    a mismatch in the first 8 chars, about 16 for one 4000 chars in; never a Python per-char loop.
    """
    lo = 1  # edge[:lo] is known to match
    hi = len(text) - pos
    elen = len(edge)
    if hi >= elen:
        hi = elen - 1  # the full edge is known not to match
    elif text.startswith(edge[:hi], pos):
        return hi  # text exhausted inside the edge: one comparison
    step = 8
    while True:
        probe = lo + step
        if probe >= hi:
            break
        if text.startswith(edge[lo:probe], pos + lo):
            lo = probe
            step <<= 3
        else:
            hi = probe - 1
            break
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if text.startswith(edge[lo:mid], pos + lo):
            lo = mid
        else:
            hi = mid - 1
    return lo


class RadixTree:
    """Approximate radix tree mapping prompt prefixes to the tenants (workers) that hold them."""

    __slots__ = ("_count", "_index", "_mutations", "_root", "_seq", "_sizes", "_tick", "_total")

    def __init__(self) -> None:
        self._root = _Node("", None, 0, {})
        self._tick = 0  # bumped once per (non-empty) insert
        self._seq = 0  # node creation counter, eviction tie-break
        self._sizes: dict[str, int] = {}
        self._index: dict[str, dict[_Node, None]] = {}
        self._total = 0  # chars over all edges
        self._count = 0  # nodes excluding the root
        self._mutations = 0  # guards match_and_insert against a mutating `choose`

    # ------------------------------------------------------------------ lookup

    def _walk(self, text: str) -> tuple[_Node, _Node | None, int, int]:
        """Descend along ``text``.

        Returns ``(node, child, pos, k)``: ``node`` is the deepest node whose whole path matched
        (``pos`` chars), ``child`` is the child of ``node`` whose edge matched partially (``k`` chars,
        ``k >= 1``) or None (``k == 0``).
        """
        node = self._root
        pos = 0
        n = len(text)
        startswith = text.startswith
        while pos < n:
            child = node.children.get(text[pos])
            if child is None:
                break
            edge = child.edge
            if startswith(edge, pos):
                node = child
                pos += len(edge)
            else:
                return node, child, pos, _common_prefix_len(edge, text, pos)
        return node, None, pos, 0

    @staticmethod
    def _match_of(node: _Node, child: _Node | None, pos: int, k: int) -> Match:
        if child is not None:
            return Match(pos + k, frozenset(child.tenants))
        if pos == 0:
            return _NO_MATCH
        return Match(pos, frozenset(node.tenants))

    def match(self, text: str) -> Match:
        """Longest-prefix match of ``text``. Does not modify LRU state."""
        node, child, pos, k = self._walk(text)
        return self._match_of(node, child, pos, k)

    # ------------------------------------------------------------------ insert

    def insert(self, text: str, tenant: str) -> None:
        """Record that ``tenant`` holds every prefix of ``text`` and refresh its ticks on the path.

        Inserting ``""`` is a no-op (the tenant holds nothing new and is not registered).
        """
        if not text:
            return
        node, child, pos, k = self._walk(text)
        self._insert_from(text, tenant, node, child, pos, k)

    def match_and_insert(self, text: str, choose: Callable[[Match], str]) -> str:
        """Match ``text``, let ``choose(match)`` pick a tenant, insert ``text`` for it; one descent.

        ``choose`` must not mutate this tree (RuntimeError otherwise: the walked path would be stale).
        Returns the chosen tenant. With ``text == ""`` nothing is inserted.
        """
        node, child, pos, k = self._walk(text)
        mutations = self._mutations
        tenant = choose(self._match_of(node, child, pos, k))
        if self._mutations != mutations:
            raise RuntimeError("choose() mutated the RadixTree during match_and_insert")
        if text:
            self._insert_from(text, tenant, node, child, pos, k)
        return tenant

    def _insert_from(self, text: str, tenant: str, node: _Node, cut: _Node | None, pos: int, k: int) -> None:
        """Insert from a ``_walk`` result: split ``cut`` after ``k`` chars, add a leaf, refresh the path."""
        self._mutations += 1
        self._tick += 1
        tick = self._tick
        if cut is not None:
            node = self._split(cut, k)
            pos += k
        if pos < len(text):
            self._seq += 1
            leaf = _Node(text[pos:], node, self._seq, {})
            node.children[text[pos]] = leaf
            self._count += 1
            self._total += len(text) - pos
            node = leaf
        index = self._index.get(tenant)
        if index is None:
            index = self._index[tenant] = {}
        added = 0
        root = self._root
        while node is not root:
            tenants = node.tenants
            if tenant not in tenants:
                index[node] = None
                added += len(node.edge)
            tenants[tenant] = tick
            node = node.parent  # type: ignore[assignment]
        if added:
            self._sizes[tenant] = self._sizes.get(tenant, 0) + added

    def _split(self, child: _Node, k: int) -> _Node:
        """Split ``child``'s edge after ``k`` chars; return the new upper node (same tenants and ticks)."""
        parent = child.parent
        assert parent is not None
        edge = child.edge
        self._seq += 1
        mid = _Node(edge[:k], parent, self._seq, dict(child.tenants))
        lower = edge[k:]
        child.edge = lower
        child.parent = mid
        mid.children[lower[0]] = child
        parent.children[edge[0]] = mid
        index = self._index
        for t in child.tenants:
            index[t][mid] = None
        self._count += 1
        return mid

    # ------------------------------------------------------------------ removal

    def remove_tenant(self, tenant: str) -> int:
        """Delete ``tenant`` from every node it holds; prune emptied nodes, merge where lossless.

        Uses the tenant's reverse index (no full-tree scan). Returns the chars removed from the tenant's
        size (its whole size; 0 for an unknown tenant).
        """
        index = self._index.pop(tenant, None)
        if index is None:
            return 0
        self._mutations += 1
        removed = self._sizes.pop(tenant)
        emptied: list[_Node] = []
        candidates: list[_Node] = []
        for node in index:
            tenants = node.tenants
            del tenants[tenant]
            if tenants:
                candidates.append(node)
            else:
                emptied.append(node)
        # Emptied nodes form whole subtrees (prefix closure): detach only their tops.
        root = self._root
        for node in emptied:
            parent = node.parent
            assert parent is not None
            if parent is root or parent.tenants:
                del parent.children[node.edge[0]]
                candidates.append(parent)
        for node in emptied:
            node.parent = None
            node.children.clear()
            self._total -= len(node.edge)
        self._count -= len(emptied)
        self._merge(candidates)
        return removed

    def evict_tenant(self, tenant: str, max_chars: int) -> int:
        """LRU-evict ``tenant`` leaf by leaf until ``tenant_size(tenant) <= max_chars``.

        A leaf of the tenant is a node it holds with no child it holds; the least recently accessed one
        (smallest tick, then oldest node) goes first. Emptied nodes are pruned. Returns chars evicted.
        """
        if max_chars < 0:
            raise ValueError(f"max_chars must be >= 0, got {max_chars}")
        size = self._sizes.get(tenant, 0)
        if size <= max_chars:
            return 0
        self._mutations += 1
        index = self._index[tenant]
        heap: list[tuple[int, int, _Node]] = []
        for node in index:
            for c in node.children.values():
                if tenant in c.tenants:
                    break
            else:
                heap.append((node.tenants[tenant], node.seq, node))
        heapq.heapify(heap)
        root = self._root
        candidates: list[_Node] = []
        start = size
        while size > max_chars and heap:
            node = heapq.heappop(heap)[2]
            tenants = node.tenants
            del tenants[tenant]
            del index[node]
            elen = len(node.edge)
            size -= elen
            parent = node.parent
            assert parent is not None
            if tenants:
                candidates.append(node)
            else:
                # A tenant leaf has no child of this tenant, so an emptied one has no children at all.
                del parent.children[node.edge[0]]
                node.parent = None
                self._count -= 1
                self._total -= elen
                candidates.append(parent)
            if parent is not root:
                for c in parent.children.values():
                    if tenant in c.tenants:
                        break
                else:
                    heapq.heappush(heap, (parent.tenants[tenant], parent.seq, parent))
        if size:
            self._sizes[tenant] = size
        else:
            del self._sizes[tenant]
            del self._index[tenant]
        self._merge(candidates)
        return start - size

    def evict(self, max_chars: int) -> dict[str, int]:
        """``evict_tenant(t, max_chars)`` for each tenant over budget; ``{tenant: chars}`` of the evicted."""
        if max_chars < 0:
            raise ValueError(f"max_chars must be >= 0, got {max_chars}")
        out: dict[str, int] = {}
        for tenant, size in list(self._sizes.items()):
            if size > max_chars:
                n = self.evict_tenant(tenant, max_chars)
                if n:
                    out[tenant] = n
        return out

    # ------------------------------------------------------------------ merge

    def _merge(self, candidates: Iterable[_Node]) -> None:
        """Merge each live candidate with its only child / its parent when the tenant maps are identical."""
        root = self._root
        for node in candidates:
            if node.parent is None:  # root, or detached/absorbed meanwhile
                continue
            while len(node.children) == 1:
                child = next(iter(node.children.values()))
                if child.tenants != node.tenants:
                    break
                self._absorb(node, child)
            parent = node.parent
            if parent is not root and len(parent.children) == 1 and parent.tenants == node.tenants:
                self._absorb(parent, node)

    def _absorb(self, node: _Node, child: _Node) -> None:
        """``node`` takes over its only child ``child`` (identical tenant maps): edges concatenate."""
        node.edge += child.edge
        node.children = child.children
        for gc in node.children.values():
            gc.parent = node
        index = self._index
        for t in child.tenants:
            del index[t][child]
        child.parent = None
        child.children = {}
        self._count -= 1

    # ------------------------------------------------------------------ accounting

    def tenant_size(self, tenant: str) -> int:
        """Chars held by ``tenant`` (sum of the edge lengths of its nodes). O(1)."""
        return self._sizes.get(tenant, 0)

    def tenant_sizes(self) -> dict[str, int]:
        """``{tenant: chars held}`` for every tenant holding something (a copy)."""
        return dict(self._sizes)

    def tenants(self) -> frozenset[str]:
        """Tenants holding at least one node."""
        return frozenset(self._sizes)

    def total_chars(self) -> int:
        """Chars stored in the tree (sum over all edges). O(1)."""
        return self._total

    def __len__(self) -> int:
        """Number of nodes, root excluded."""
        return self._count

    def __repr__(self) -> str:
        return f"RadixTree(nodes={self._count}, chars={self._total}, tenants={len(self._sizes)})"
