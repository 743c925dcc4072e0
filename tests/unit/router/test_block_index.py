"""The index of what engines say they cache (``tree.blocks``): blocks keyed by chained token ids, removals through
each engine's own hashes, a budget, and a match equal to what the engines hold."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from smg_router.tree.blocks import BlockIndex

B = 4


def engine_hash(prefix: tuple[int, ...]) -> bytes:
    """An engine's block hash: a seeded digest the router cannot recompute (bytes, as vLLM's sha256 ones)."""
    return b"seed" + repr(prefix).encode()


def store(index: BlockIndex, worker: str, tokens: list[int], first: int, last: int, namespace: str = "") -> int:
    """The event an engine sends when it caches blocks ``first`` .. ``last - 1`` of ``tokens``."""
    hashes = [engine_hash(tuple(tokens[: (i + 1) * B])) for i in range(first, last)]
    parent = engine_hash(tuple(tokens[: first * B])) if first else None
    return index.stored(
        worker,
        hashes=hashes,
        parent=parent,
        tokens=tokens[first * B : last * B],
        block_size=B,
        namespace=namespace,
    )


def test_a_prompt_matches_the_consecutive_blocks_a_worker_stored_from_its_first() -> None:
    index = BlockIndex(budget_bytes=10**6)
    doc = list(range(100, 124))  # 6 blocks
    assert store(index, "a", doc, 0, 3) == 3
    assert index.match([*doc, 1, 2]) == {"a": 12}
    assert store(index, "a", doc, 3, 5) == 2  # its parent is the third block: the chain goes on
    assert store(index, "b", doc, 0, 1) == 1
    assert index.match(doc) == {"a": 20, "b": 4}
    assert index.match(doc[:7]) == {"a": 4, "b": 4}  # only full blocks count
    assert index.match([9, *doc]) == {}  # a different first token: a different chain
    index.removed("a", [engine_hash(tuple(doc[:8]))])  # the engine evicted its second block
    assert index.match(doc) == {"a": 4, "b": 4}
    index.cleared("b")
    assert index.match(doc) == {"a": 4}
    assert index.blocks_of("a") == 4 and index.blocks_of("b") == 0


def test_a_block_whose_parent_the_index_never_heard_of_is_not_applied() -> None:
    """A missed event leaves a hole: the child cannot be chained, so it is counted and dropped, never guessed."""
    index = BlockIndex(budget_bytes=10**6)
    doc = list(range(16))
    assert store(index, "a", doc, 2, 4) == 0
    assert index.orphans == 2 and index.match(doc) == {}
    assert index.stored("a", hashes=[b"x", b"y"], parent=None, tokens=[1, 2, 3], block_size=B) == 0  # short tokens


def test_namespaces_and_block_sizes_never_match_each_other() -> None:
    index = BlockIndex(budget_bytes=10**6)
    doc = list(range(32))
    store(index, "a", doc, 0, 4, namespace="lora:sql")
    store(index, "b", doc, 0, 4)
    assert index.match(doc) == {"b": 16}
    assert index.match(doc, "lora:sql") == {"a": 16}
    index.stored("c", hashes=[b"c1", b"c2"], parent=None, tokens=doc[:16], block_size=8)
    assert index.match(doc) == {"b": 16, "c": 16}  # each engine's blocks cut its own way


def test_the_index_stays_under_its_budget_and_forgets_the_oldest_blocks() -> None:
    index = BlockIndex(budget_bytes=200_000)
    docs = [[d] * 4 * B for d in range(2000)]
    for doc in docs:
        store(index, "a", doc, 0, 4)
    assert index.estimated_bytes() <= 200_000
    assert index.forgotten > 0
    assert index.match(docs[-1]) == {"a": 16}  # the newest are kept
    assert index.match(docs[0]) == {}


@st.composite
def histories(draw: st.DrawFn) -> list[tuple[str, ...]]:
    """Engines' events, as engines send them: a stored run continues a block the engine holds."""
    steps = []
    for _ in range(draw(st.integers(1, 40))):
        worker = draw(st.sampled_from(["a", "b", "c"]))
        kind = draw(st.sampled_from(["store", "store", "store", "remove", "clear"]))
        steps.append((kind, worker, draw(st.integers(0, 5)), draw(st.integers(1, 6)), draw(st.integers(0, 50))))
    return steps


PROMPTS = [[p % 3] * B + [p] * B + [p % 2] * B + list(range(p, p + 3 * B)) for p in range(6)]
"""Prompts of 6 blocks sharing first blocks in pairs and threes."""


@settings(max_examples=300, deadline=None)
@given(history=histories(), probe=st.integers(0, 5))
def test_the_match_is_what_the_engines_hold(history: list[tuple], probe: int) -> None:
    """After any run of events, each worker matches exactly the consecutive blocks from the first its engine holds."""
    index = BlockIndex(budget_bytes=10**8)
    held: dict[str, set[tuple[int, ...]]] = {"a": set(), "b": set(), "c": set()}  # the engines: prefixes they hold
    for kind, worker, prompt, blocks, pick in history:
        tokens = PROMPTS[prompt]
        if kind == "store":
            first = 0
            while first < blocks and tuple(tokens[: (first + 1) * B]) in held[worker]:
                first += 1  # an engine stores only what it does not hold yet, after its parent
            if first < blocks:
                store(index, worker, tokens, first, blocks)
                held[worker].update(tuple(tokens[: (i + 1) * B]) for i in range(first, blocks))
        elif kind == "remove" and held[worker]:
            gone = sorted(held[worker])[pick % len(held[worker])]
            held[worker].discard(gone)
            index.removed(worker, [engine_hash(gone)])
        elif kind == "clear":
            held[worker].clear()
            index.cleared(worker)
    tokens = PROMPTS[probe]
    expected = {}
    for worker, prefixes in held.items():
        n = 0
        while n < len(tokens) // B and tuple(tokens[: (n + 1) * B]) in prefixes:
            n += 1
        if n:
            expected[worker] = n * B
    assert index.match(tokens) == expected


def test_a_speculative_entry_stands_until_the_engine_speaks_or_its_time_is_up() -> None:
    """Between a decision and the engine's first event for it, the router's own decision stands for the prompt."""
    index = BlockIndex(budget_bytes=10**6, spec_seconds=5.0)
    doc = list(range(200, 232))  # 2 blocks of 16, 8 of 4
    store(index, "b", [1] * 4, 0, 1)  # b's engine cuts blocks of 4
    index.speculate("a", doc, now=0.0)  # a said nothing yet: blocks of 16
    index.speculate("b", doc, now=0.0)
    assert index.match(doc, now=1.0) == {"a": 32, "b": 32}
    assert index.match(doc) == {}  # what the engines said: nothing of it yet
    assert index.blocks_of("a") == 0  # placement's view of room leaves guesses out
    assert index.match(doc, now=5.0) == {}  # expired
    index.speculate("b", doc, now=10.0)
    store(index, "b", doc, 0, 8)  # the engine stored it: its word replaces the guess
    index.removed("b", [engine_hash(tuple(doc[:4]))])  # and then evicted the first block
    assert index.match(doc, now=11.0) == {}  # no guess left standing for an evicted block
    index.speculate("a", doc, now=12.0)
    index.cleared("a")
    assert index.match(doc, now=13.0) == {}  # a worker emptied keeps no guess either


def test_speculative_blocks_count_for_this_process_until_they_expire_or_the_engine_speaks() -> None:
    index = BlockIndex(budget_bytes=10**6, spec_seconds=5.0)
    doc = list(range(300, 316))  # 4 blocks of 4
    store(index, "a", [9] * 4, 0, 1)  # one real block, blocks of 4
    index.speculate("a", doc, now=0.0)
    index.speculate("a", doc, now=1.0)  # the same blocks again: counted once
    assert (index.blocks_of("a"), index.blocks_of("a", speculative=True, now=2.0)) == (1, 5)
    store(index, "a", doc, 0, 2)  # the engine said two of them
    assert (index.blocks_of("a"), index.blocks_of("a", speculative=True, now=2.0)) == (3, 5)
    assert index.blocks_of("a", speculative=True, now=6.0) == 3  # the other two guesses expired
