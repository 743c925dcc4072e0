"""RadixTree.estimated_bytes against what tracemalloc sees the tree allocate, for trees of several shapes.

The estimate (tree/memory.py) is what --tree-memory-budget is compared with, so it must not be far off in
either direction whatever the traffic looks like: many short unique prompts (node overhead dominates,
~40 bytes a char), long shared prefixes (~2 bytes a char), many workers sharing every node, multi-turn
chats, CJK text (2 bytes a char in CPython), and trees after an eviction or a removal (dicts keep their
tables). Tolerance: within 30% of the traced size (measured on CPython 3.11: 0.88-1.06).
"""

from __future__ import annotations

import gc
import random
import tracemalloc
from collections.abc import Callable

import pytest
from smg_router.tree import RadixTree

TOLERANCE = 0.30
LATIN = "abcdefghijklmnopqrstuvwxyz "
CJK = "".join(chr(0x4E00 + i) for i in range(200))


def _text(rng: random.Random, alphabet: str, n: int) -> str:
    return "".join(rng.choices(alphabet, k=n))


def short_unique(tree: RadixTree, *, n: int = 8000, length: int = 20, tenants: int = 1, alphabet: str = LATIN) -> None:
    rng = random.Random(1)
    for i in range(n):
        tree.insert(_text(rng, alphabet, length), f"w{i % tenants}")


def shared_prefixes(
    tree: RadixTree,
    *,
    systems: int = 4,
    system_len: int = 2000,
    tail: int = 500,
    n: int = 200,
    tenants: int = 1,
    alphabet: str = LATIN,
) -> None:
    rng = random.Random(2)
    prefixes = [_text(rng, alphabet, system_len) for _ in range(systems)]
    for i in range(n):
        tree.insert(prefixes[i % systems] + _text(rng, alphabet, tail), f"w{i % tenants}")


def many_tenants(tree: RadixTree, *, tenants: int = 16, n: int = 1500) -> None:
    rng = random.Random(3)
    texts = [_text(rng, LATIN, 20) for _ in range(n)]
    for w in range(tenants):
        for text in texts:
            tree.insert(text, f"w{w}")


def chats(tree: RadixTree, *, conversations: int = 100, turns: int = 10) -> None:
    rng = random.Random(4)
    for c in range(conversations):
        text = _text(rng, LATIN, 100)
        for _ in range(turns):
            text += _text(rng, LATIN, 80)
            tree.insert(text, f"w{c % 4}")


def evicted(tree: RadixTree) -> None:
    short_unique(tree, n=12000)
    tree.evict_tenant("w0", 40000)


def many_tenants_evicted(tree: RadixTree) -> None:
    many_tenants(tree)
    tree.evict(8000)


def removed_half_reclaimed(tree: RadixTree) -> None:
    short_unique(tree, tenants=4)
    tree.detach_tenant("w1")
    tree.remove_tenant("w2")
    tree.reclaim(3000)  # w1's nodes: some reclaimed, some still waiting (orphans included)


SHAPES: dict[str, Callable[[RadixTree], None]] = {
    "short unique prompts": short_unique,
    "short unique prompts, 4 workers": lambda t: short_unique(t, tenants=4),
    "long shared prefixes": shared_prefixes,
    "long shared prefixes, 8 workers": lambda t: shared_prefixes(t, tenants=8),
    "50 system prompts, short tails": lambda t: shared_prefixes(t, systems=50, system_len=300, tail=30, n=2500),
    "16 workers holding the same prompts": many_tenants,
    "multi-turn chats": chats,
    "CJK short prompts": lambda t: short_unique(t, n=5000, alphabet=CJK),
    "CJK shared prefixes": lambda t: shared_prefixes(t, n=100, alphabet=CJK),
    "after an eviction to a third": evicted,
    "16 workers after an eviction": many_tenants_evicted,
    "after removals, half reclaimed": removed_half_reclaimed,
}


def traced_bytes(build: Callable[[RadixTree], None]) -> tuple[RadixTree, int]:
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tree = RadixTree()
        build(tree)
        gc.collect()
        return tree, tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_estimate_is_within_tolerance_of_traced_allocations(shape: str) -> None:
    tree, traced = traced_bytes(SHAPES[shape])
    estimate = tree.estimated_bytes()
    ratio = estimate / traced
    print(
        f"{shape}: {tree!r} traced {traced} B ({traced / max(tree.total_chars(), 1):.1f} B/char), "
        f"estimated {estimate} B, ratio {ratio:.2f}"
    )
    assert 1 - TOLERANCE <= ratio <= 1 + TOLERANCE, (shape, traced, estimate)


def test_an_empty_tree_and_a_fully_reclaimed_one_cost_about_nothing() -> None:
    tree, traced = traced_bytes(lambda t: None)
    assert tree.estimated_bytes() < 2048 and traced < 2048
    short_unique(tree, n=2000)
    assert tree.estimated_bytes() > 100_000
    tree.detach_tenant("w0")
    assert tree.estimated_bytes() > 100_000  # detached, not reclaimed: still in memory, still counted
    while tree.reclaim(500):
        pass
    assert tree.estimated_bytes() < 2048
