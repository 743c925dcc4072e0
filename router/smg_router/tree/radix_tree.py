"""Approximate, multi-tenant, character-level radix tree for cache-aware routing.

One tree is kept per (policy instance, model). Keys are the characters of a request's routing text
(no tokenizer); tenants are worker ids. The tree approximates which worker holds which prompt prefix
in its KV cache. Everything here is pure and synchronous: the router's event loop is the lock. Work that
grows with the tree (eviction, reclaiming a removed tenant's nodes) comes in resumable steps of bounded
work (``Eviction.step``, ``reclaim``), so a caller can give the event loop back between them.

Layout
    * A node stores its edge label as a ``str`` slice, its children in a dict keyed by the first
      character of each child's edge, and ``tenants``: ``{tenant: tick}`` where the tick is the value of
      a tree-owned counter (incremented once per insert) at the tenant's last insert through the node.
      Ticks are not wall time, so everything (including eviction order) is deterministic.
    * Invariants: a tenant holding a node holds all its ancestors (prefix-closed); no non-root node has an
      empty edge or an empty tenant map; along any path a tenant's ticks never increase downwards.
    * ``_index[tenant]`` is a reverse index (insertion-ordered dict used as a set) of the nodes the tenant
      holds, so removal and eviction never scan the whole tree.
    * ``_sizes[tenant]`` (sum of the edge lengths of the tenant's nodes), the total number of chars, the
      node count and the extra bytes of non-ASCII edges are maintained incrementally: the getters and
      ``estimated_bytes`` are O(1) or O(tenants).

Removal in two halves. ``detach_tenant`` is O(1): the tenant's reverse index moves to ``_graves`` (and
``_dead[tenant]``), and from then on the tenant is gone for every reader (``tenants``, sizes, ``match``)
although its entries still sit in the nodes. ``reclaim(budget)`` then deletes those entries a bounded number
at a time, pruning nodes left without tenants. While some are pending: a match ignores dead entries and
ends at the deepest node a live tenant holds (live holders are prefix-closed); an insert of a tenant of the
same name takes over the dead entries on its path (moves them to its live index with a fresh tick);
a split copies a dead entry into the same grave; a pruned node's children, which then can only hold dead
entries, are detached (orphans stay in their graves until reclaimed); no node holding a dead entry is
merged (the pair is looked at again when its last dead entry goes). ``remove_tenant`` is the two halves at
once.

Matching compares whole edges with ``str.startswith(edge, pos)``; on a mismatch inside an edge the
common prefix length is found by galloping (``text.startswith(edge[lo:lo + step], pos + lo)`` with steps
8, 64, 512, ...) to the window holding the mismatch, then a binary search in it: O(len) chars compared in
C, O(log len) Python steps, few steps for the common early mismatch, never a Python per-char loop.

Eviction (``Eviction``, ``evict_tenant``) is LRU over the tenant's *leaves* (nodes of the tenant with no
child held by the same tenant), least recent tick first, ties by creation order; after the tenant leaves a
node, its parent is queued if it became a leaf of the tenant. Whole nodes are evicted, so a job can go
below ``max_chars``. A job snapshots the tenant's nodes, finds their leaves (O(nodes of the tenant), in
steps), then evicts; so evict to a low watermark rather than by a few chars on every request.

Node merge: after removal / eviction a non-root node whose only child has an *identical* ``{tenant: tick}``
map is merged with that child (the parent object absorbs the child's edge and children). Requiring
identical ticks (not merely the same tenant set) makes the merge lossless: match results and the tick of
every char are unchanged, so a hot shared prefix is never glued to a cold tail. Only the pairs whose
tenant maps or child count changed are examined. Inserts never merge; an insert ending inside an edge
splits it (the upper part gets a copy of the tenant map, then is refreshed), so chains of same-tenant nodes
with different ticks are expected.

Measured (CPython 3.11.7 on a shared, noisy 2-core sandbox where a trivial method call costs ~0.3 us, so
expect 2-4x less on a server; ranges over runs). 10k prompts of 2000 chars (a 1200-char shared prefix from
4 or 50 "system prompts" + 800 unique chars), 8 tenants, ~18k nodes, 11.2M chars: insert while building
11-17 us; match of a stored prompt (~5 nodes deep) 4.5-7 us, of which the walk is ~2.8 us and building
the Match + frozenset ~0.6 us; match of a new prompt 4-7 us; match_and_insert of a new prompt 9-16 us.
A 4000-char text walking 40 nodes of 100 chars: 11-20 us (0.3-0.5 us per node). Common prefix inside
one 4000-char edge: 1.5 us (mismatch at char 2), 3.4 us (at 50), 9 us (at 3990). Multi-turn chat (500
conversations x 20 turns of +200 chars, ~20 nodes per path): match_and_insert 18-25 us. A 4 KB
match_and_insert (3 KB shared prefix + 1 KB new tail, ~1M chars, 8 tenants): 5-7 us. On a 654k-node
tenant (8.7M chars of unique 20-char prompts), a step of 128 units: reclaim 0.45 ms, eviction 0.44 ms (p99; a
few ms at worst); all at once, evict_tenant takes 4.1 s and remove_tenant 1.25 s (before the steps: 3.8 s, 0.86 s).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from ._node import Node as _Node
from ._node import common_prefix_len as _common_prefix_len
from ._node import wide_bytes as _wide_bytes
from .eviction import Eviction
from .memory import estimate_bytes

__all__ = ["Match", "RadixTree"]


class Match(NamedTuple):
    """Result of a longest-prefix match (a tuple: one is built per request, and a frozen dataclass's
    ``__init__`` costs several times a tuple's)."""

    matched_chars: int
    """Length of the longest prefix of the text present in the tree (for any tenant)."""
    tenants: frozenset[str]
    """Tenants holding the node where matching stopped (partially matched edge included); empty if
    ``matched_chars == 0``."""


_EMPTY: frozenset[str] = frozenset()
_NO_MATCH = Match(0, _EMPTY)
_Grave = dict[_Node, None]
"""A removed tenant's reverse index: the nodes still holding one of its (dead) entries."""


def _grave_of(node: _Node, graves: list[_Grave]) -> _Grave | None:
    for grave in graves:
        if node in grave:
            return grave
    return None


class RadixTree:
    """Approximate radix tree mapping prompt prefixes to the tenants (workers) that hold them."""

    __slots__ = ("_count", "_dead", "_graves", "_index", "_root", "_seq", "_sizes", "_tick", "_total", "_wide")

    def __init__(self) -> None:
        self._root = _Node("", None, 0, {})
        self._tick = 0  # bumped once per (non-empty) insert, and by every removal and eviction step
        self._seq = 0  # node creation counter, eviction tie-break
        self._sizes: dict[str, int] = {}
        self._index: dict[str, dict[_Node, None]] = {}
        self._total = 0  # chars over all nodes not freed yet (orphans waiting in a grave included)
        self._wide = 0  # bytes of non-ASCII edges beyond one per char
        self._count = 0  # nodes not freed yet, excluding the root
        self._dead: dict[str, list[_Grave]] = {}  # removed tenant -> its graves (one per removal)
        self._graves: list[tuple[str, _Grave]] = []  # every grave, oldest removal first

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

    def _match_of(self, node: _Node, child: _Node | None, pos: int, k: int) -> Match:
        if self._dead:
            return self._live_match_of(node, child, pos, k)
        if child is not None:
            return Match(pos + k, frozenset(child.tenants))
        if pos == 0:
            return _NO_MATCH
        return Match(pos, frozenset(node.tenants))

    def _live_match_of(self, node: _Node, child: _Node | None, pos: int, k: int) -> Match:
        """``_match_of`` while dead entries remain: they do not count, and the match ends at the deepest
        node of the walked path some live tenant holds (the nodes live tenants hold are prefix-closed)."""
        if child is not None:
            live = self._live(child)
            if live:
                return Match(pos + k, live)
        root = self._root
        while node is not root:
            live = self._live(node)
            if live:
                return Match(pos, live)
            pos -= len(node.edge)
            node = node.parent  # type: ignore[assignment]  # reachable nodes have a parent up to the root
        return _NO_MATCH

    def _live(self, node: _Node) -> frozenset[str]:
        dead = self._dead
        return frozenset(t for t in node.tenants if t not in dead or _grave_of(node, dead[t]) is None)

    def _has_dead(self, node: _Node) -> bool:
        dead = self._dead
        return any(t in dead and _grave_of(node, dead[t]) is not None for t in node.tenants)

    def match(self, text: str, tokens: Sequence[int] | None = None, namespace: str = "") -> Match:
        """Longest-prefix match of ``text``. Does not modify LRU state.  (``tokens`` and ``namespace`` are for the
        indexes of token ids that share the cache index seam with the tree; the tree keys text, which begins with
        its cache namespace's marker.)"""
        node, child, pos, k = self._walk(text)
        return self._match_of(node, child, pos, k)

    # ------------------------------------------------------------------ insert

    def insert(self, text: str, tenant: str, tokens: Sequence[int] | None = None, namespace: str = "") -> None:
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
        tick = self._tick  # every mutation bumps it
        tenant = choose(self._match_of(node, child, pos, k))
        if self._tick != tick:
            raise RuntimeError("choose() mutated the RadixTree during match_and_insert")
        if text:
            self._insert_from(text, tenant, node, child, pos, k)
        return tenant

    def _insert_from(self, text: str, tenant: str, node: _Node, cut: _Node | None, pos: int, k: int) -> None:
        """Insert from a ``_walk`` result: split ``cut`` after ``k`` chars, add a leaf, refresh the path."""
        self._tick += 1
        tick = self._tick
        if cut is not None:
            node = self._split(cut, k)
            pos += k
        if pos < len(text):
            self._seq += 1
            edge = text[pos:]
            leaf = _Node(edge, node, self._seq, {})
            node.children[text[pos]] = leaf
            self._count += 1
            self._total += len(edge)
            if not edge.isascii():
                self._wide += _wide_bytes(edge)
            node = leaf
        index = self._index.get(tenant)
        if index is None:
            index = self._index[tenant] = {}
        if self._dead and tenant in self._dead:
            added = self._refresh_claiming(node, tenant, tick, index)
        else:
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

    def _refresh_claiming(self, node: _Node, tenant: str, tick: int, index: dict[_Node, None]) -> int:
        """The path refresh of an insert for a tenant whose removed namesake still has dead entries: an
        entry of it on the path becomes the new tenant's (out of its grave, fresh tick)."""
        graves = self._dead[tenant]
        added = 0
        root = self._root
        while node is not root:
            tenants = node.tenants
            if tenant not in tenants or node not in index:
                if tenant in tenants:
                    grave = _grave_of(node, graves)
                    assert grave is not None
                    del grave[node]
                index[node] = None
                added += len(node.edge)
            tenants[tenant] = tick
            node = node.parent  # type: ignore[assignment]
        return added

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
        if not edge.isascii():
            self._wide += _wide_bytes(mid.edge) + _wide_bytes(lower) - _wide_bytes(edge)
        index = self._index
        if self._dead:
            for t in child.tenants:
                live = index.get(t)
                if live is not None and child in live:
                    live[mid] = None
                else:  # a dead entry: the upper part goes to the same grave
                    grave = _grave_of(child, self._dead[t])
                    assert grave is not None
                    grave[mid] = None
        else:
            for t in child.tenants:
                index[t][mid] = None
        self._count += 1
        return mid

    # ------------------------------------------------------------------ removal

    def detach_tenant(self, tenant: str) -> int:
        """Forget ``tenant`` at once, O(1): gone from ``tenants()``, the sizes and every match.

        Its entries are deleted later by ``reclaim``. Returns the chars the tenant held (0 if unknown).
        """
        index = self._index.pop(tenant, None)
        if index is None:
            return 0
        self._tick += 1
        self._dead.setdefault(tenant, []).append(index)
        self._graves.append((tenant, index))
        return self._sizes.pop(tenant)

    def reclaim_pending(self) -> bool:
        """Whether detached tenants still have entries to reclaim."""
        return bool(self._graves)

    def reclaim(self, budget: int) -> bool:
        """Delete about ``budget`` dead entries (oldest removal first), pruning emptied nodes.

        A unit of work is one entry deleted or one child detached from a pruned node, plus one per merge
        candidate. Returns whether dead entries remain.
        """
        graves = self._graves
        if not graves:
            return False
        self._tick += 1
        candidates: list[_Node] = []
        freed = chars = wide = 0
        while budget > 0 and graves:
            tenant, grave = graves[0]
            if not grave:
                self._bury(0)
                continue
            node = grave.popitem()[0]
            tenants = node.tenants
            del tenants[tenant]
            budget -= 1
            if tenants:
                candidates.append(node)
                continue
            # self._prune(node, candidates), inlined: this loop frees every node of a removed worker
            parent = node.parent
            edge = node.edge
            if parent is not None:
                del parent.children[edge[0]]
                node.parent = None
                candidates.append(parent)
            freed += 1
            chars += len(edge)
            if not edge.isascii():
                wide += _wide_bytes(edge)
            children = node.children
            if children:
                for c in children.values():
                    c.parent = None
                budget -= len(children)
                children.clear()
        self._count -= freed
        self._total -= chars
        self._wide -= wide
        while graves and not graves[0][1]:
            self._bury(0)
        self._merge(candidates)
        return bool(graves)

    def _bury(self, i: int) -> None:
        """Forget the exhausted grave ``self._graves[i]``."""
        tenant, grave = self._graves.pop(i)
        graves = self._dead[tenant]
        for j, g in enumerate(graves):
            if g is grave:
                del graves[j]
                break
        if not graves:
            del self._dead[tenant]

    def remove_tenant(self, tenant: str) -> int:
        """Delete ``tenant`` from every node it holds; prune emptied nodes, merge where lossless.

        ``detach_tenant`` then ``reclaim`` until nothing is pending (other detached tenants included), all
        at once: use the two halves to keep each step short. Uses the tenant's reverse index (no full-tree
        scan). Returns the chars the tenant held (0 for an unknown tenant).
        """
        removed = self.detach_tenant(tenant)
        while self.reclaim(1 << 62):
            pass
        return removed

    def _prune(self, node: _Node, candidates: list[_Node]) -> int:
        """Free ``node``, which has no tenant left: off its parent (a merge candidate), its children (which
        can only hold dead entries) detached. Returns the work done (1 + children)."""
        parent = node.parent
        edge = node.edge
        if parent is not None:
            del parent.children[edge[0]]
            node.parent = None
            candidates.append(parent)
        self._count -= 1
        self._total -= len(edge)
        if not edge.isascii():
            self._wide -= _wide_bytes(edge)
        children = node.children
        if not children:
            return 1
        for c in children.values():
            c.parent = None
        n = len(children)
        children.clear()
        return 1 + n

    # ------------------------------------------------------------------ eviction

    def eviction(self, tenant: str, max_chars: int) -> Eviction:
        """A resumable LRU eviction of ``tenant`` down to ``max_chars`` (see ``Eviction``)."""
        return Eviction(self, tenant, max_chars)

    def evict_tenant(self, tenant: str, max_chars: int) -> int:
        """LRU-evict ``tenant`` leaf by leaf until ``tenant_size(tenant) <= max_chars``, all at once.

        A leaf of the tenant is a node it holds with no child it holds; the least recently accessed one
        (smallest tick, then oldest node) goes first. Emptied nodes are pruned. Returns chars evicted.
        """
        return Eviction(self, tenant, max_chars).run()

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
            dead = bool(self._dead)
            if dead and self._has_dead(node):
                continue
            while len(node.children) == 1:
                child = next(iter(node.children.values()))
                if child.tenants != node.tenants or (dead and self._has_dead(child)):
                    break
                self._absorb(node, child)
            parent = node.parent
            if (
                parent is not root
                and len(parent.children) == 1
                and parent.tenants == node.tenants
                and not (dead and self._has_dead(parent))
            ):
                self._absorb(parent, node)

    def _absorb(self, node: _Node, child: _Node) -> None:
        """``node`` takes over its only child ``child`` (identical live tenant maps): edges concatenate."""
        upper, lower = node.edge, child.edge
        node.edge = upper + lower
        if not (upper.isascii() and lower.isascii()):
            self._wide += _wide_bytes(node.edge) - _wide_bytes(upper) - _wide_bytes(lower)
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

    def tenant_size(self, tenant: str, *, shared: bool = False) -> int:
        """Chars held by ``tenant`` (sum of the edge lengths of its nodes). O(1).  (``shared`` is for the indexes
        that share the cache index seam with the tree and keep guesses of their own apart.)"""
        return self._sizes.get(tenant, 0)

    def tenant_sizes(self) -> dict[str, int]:
        """``{tenant: chars held}`` for every tenant holding something (a copy)."""
        return dict(self._sizes)

    def tenants(self) -> frozenset[str]:
        """Tenants holding at least one node."""
        return frozenset(self._sizes)

    def total_chars(self) -> int:
        """Chars stored in the tree (sum over the edges of every node not freed yet). O(1)."""
        return self._total

    def estimated_bytes(self) -> int:
        """Memory the tree holds, estimated (``memory.estimate_bytes``; dead entries included). O(tenants)."""
        entries = 0
        index_bytes = 0
        for index in self._index.values():
            entries += len(index)
            index_bytes += sys.getsizeof(index)
        for _, grave in self._graves:
            entries += len(grave)
            index_bytes += sys.getsizeof(grave)
        return estimate_bytes(
            nodes=self._count, chars=self._total, wide=self._wide, entries=entries, index_bytes=index_bytes
        )

    def __len__(self) -> int:
        """Number of nodes not freed yet, root excluded."""
        return self._count

    def __repr__(self) -> str:
        return f"RadixTree(nodes={self._count}, chars={self._total}, tenants={len(self._sizes)})"
