"""Shared helpers for the radix tree tests: an independent structural checker (reads private state)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from smg_router.tree import RadixTree


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
    """Every non-empty prefix the tree says ``tenant`` holds (one string per char of its nodes)."""
    out: set[str] = set()
    for path, node in iter_nodes(tree):
        if tenant in node.tenants:
            for i in range(1, len(node.edge) + 1):
                out.add(path + node.edge[:i])
    return out


def check_invariants(tree: RadixTree) -> None:
    """Recompute everything from the structure and compare with the incrementally maintained state."""
    root = tree._root
    assert root.edge == ""
    assert root.parent is None
    assert root.tenants == {}
    sizes: dict[str, int] = {}
    held: dict[str, set[int]] = {}
    total = 0
    count = 0
    seqs: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        for key, child in node.children.items():
            # children keyed by the first char of their (non-empty) edge, parent links consistent
            assert child.edge, "non-root node with an empty edge"
            assert key == child.edge[0], (key, child.edge)
            assert child.parent is node
            # no node without tenants
            assert child.tenants, f"node {child.edge!r} has no tenant"
            for t, tick in child.tenants.items():
                if node is not root:
                    # prefix closure, and ticks never increase downwards
                    assert t in node.tenants, f"{t} holds {child.edge!r} but not its parent {node.edge!r}"
                    assert tick <= node.tenants[t]
                assert 0 < tick <= tree._tick
                sizes[t] = sizes.get(t, 0) + len(child.edge)
                held.setdefault(t, set()).add(id(child))
            assert child.seq not in seqs
            seqs.add(child.seq)
            total += len(child.edge)
            count += 1
            stack.append(child)
    assert sizes == tree.tenant_sizes()
    for t, size in sizes.items():
        assert tree.tenant_size(t) == size
    assert tree.tenants() == frozenset(sizes)
    assert tree.total_chars() == total
    assert len(tree) == count
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
