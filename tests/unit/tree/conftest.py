"""Shared helpers for the radix tree tests: an independent structural checker (reads private state)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from smg_router.tree import RadixTree
from smg_router.tree._node import wide_bytes


def iter_nodes(tree: RadixTree) -> Iterator[tuple[str, Any]]:
    """Yield ``(path_before_node, node)`` for every non-root node, depth first (deterministic order)."""
    stack: list[tuple[str, Any]] = [("", tree._root)]
    while stack:
        path, node = stack.pop()
        if node is not tree._root:
            yield path, node
        below = path + node.edge
        for key in sorted(node.children, reverse=True):
            stack.append((below, node.children[key]))


def held_prefixes(tree: RadixTree, tenant: str) -> set[str]:
    """Every non-empty prefix the tree says ``tenant`` holds (one string per char of its live nodes)."""
    dead = {id(n) for t, grave in tree._graves if t == tenant for n in grave}
    out: set[str] = set()
    for path, node in iter_nodes(tree):
        if tenant in node.tenants and id(node) not in dead:
            for i in range(1, len(node.edge) + 1):
                out.add(path + node.edge[:i])
    return out


def check_invariants(tree: RadixTree) -> None:
    """Recompute everything from the structure and compare with the incrementally maintained state.

    With detached tenants not reclaimed yet, their (dead) entries are told apart through the graves: every
    dead entry is in exactly one grave of its tenant, never in a live index; live entries obey every rule
    of a tree without dead ones; nodes no longer reachable (orphans) hold dead entries only and still count
    in the chars and the node count until reclaimed.
    """
    root = tree._root
    assert root.edge == ""
    assert root.parent is None
    assert root.tenants == {}
    dead: dict[int, set[str]] = {}
    grave_nodes: dict[int, Any] = {}
    for t, grave in tree._graves:
        assert any(g is grave for g in tree._dead[t])
        for node in grave:
            assert t in node.tenants, f"grave of {t} lists {node.edge!r}, which {t} does not hold"
            assert node not in tree._index.get(t, {}), f"{t}'s entry on {node.edge!r} both live and dead"
            assert t not in dead.get(id(node), set()), f"{t}'s entry on {node.edge!r} in two graves"
            dead.setdefault(id(node), set()).add(t)
            grave_nodes[id(node)] = node
    assert sum(len(gs) for gs in tree._dead.values()) == len(tree._graves)
    sizes: dict[str, int] = {}
    held: dict[str, set[int]] = {}
    total = 0
    count = 0
    wide = 0
    seqs: set[int] = set()
    reachable: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        node_live = {t: k for t, k in node.tenants.items() if t not in dead.get(id(node), set())}
        for key, child in node.children.items():
            # children keyed by the first char of their (non-empty) edge, parent links consistent
            assert child.edge, "non-root node with an empty edge"
            assert key == child.edge[0], (key, child.edge)
            assert child.parent is node
            # no node without tenants
            assert child.tenants, f"node {child.edge!r} has no tenant"
            for t, tick in child.tenants.items():
                assert 0 < tick <= tree._tick
                if t in dead.get(id(child), set()):
                    continue
                if node is not root:
                    # prefix closure, and ticks never increase downwards (live entries)
                    assert t in node_live, f"{t} holds {child.edge!r} but not its parent {node.edge!r}"
                    assert tick <= node_live[t]
                sizes[t] = sizes.get(t, 0) + len(child.edge)
                held.setdefault(t, set()).add(id(child))
            assert child.seq not in seqs
            seqs.add(child.seq)
            reachable.add(id(child))
            total += len(child.edge)
            wide += wide_bytes(child.edge)
            count += 1
            stack.append(child)
    for key, node in grave_nodes.items():
        if key in reachable:
            continue
        # an orphan: off the tree, dead entries only, waiting for reclaim
        assert set(node.tenants) == dead[key], f"orphan {node.edge!r} holds live entries"
        assert node.parent is None or id(node.parent) in grave_nodes
        assert node.seq not in seqs
        seqs.add(node.seq)
        total += len(node.edge)
        wide += wide_bytes(node.edge)
        count += 1
    assert sizes == tree.tenant_sizes()
    for t, size in sizes.items():
        assert tree.tenant_size(t) == size
    assert tree.tenants() == frozenset(sizes)
    assert tree.total_chars() == total
    assert tree._wide == wide
    assert len(tree) == count
    if dead:
        assert tree.reclaim_pending()
    # reverse index: exactly the nodes each tenant holds, and no stale tenant entries
    assert set(tree._index) == set(sizes)
    for t, nodes in tree._index.items():
        assert {id(n) for n in nodes} == held[t]
        assert len(nodes) == len(held[t])


@pytest.fixture(scope="session")
def check() -> Callable[[RadixTree], None]:
    return check_invariants


@pytest.fixture(scope="session")
def held() -> Callable[[RadixTree, str], set[str]]:
    return held_prefixes


@pytest.fixture(scope="session")
def nodes() -> Callable[[RadixTree], list[tuple[str, Any]]]:
    return lambda tree: list(iter_nodes(tree))
