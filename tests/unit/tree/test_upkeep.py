"""tree.Upkeep: reclaim, caps and the byte budget in bounded slices, the trees usable between two slices."""

from __future__ import annotations

import random

from smg_router.tree import Limits, Match, RadixTree, Upkeep

A, B, C = "worker-a", "worker-b", "worker-c"
BIG = 1 << 40


def _fill(tree: RadixTree, tenant: str, n: int, *, seed: int = 1, length: int = 20) -> list[str]:
    rng = random.Random(seed)
    texts = ["".join(rng.choices("abcdefgh", k=length)) for _ in range(n)]
    for text in texts:
        tree.insert(text, tenant)
    return texts


def _upkeep(*, budget: int = BIG, unit: int = 16) -> Upkeep[str]:
    """Every pause yields (a clock that never moves, a zero slice): the most interleaving there can be."""
    return Upkeep(Limits(budget_bytes=budget), clock=lambda: 0.0, slice_seconds=0.0, unit=unit)


def test_removed_tenant_is_reclaimed_in_bounded_steps_and_never_matched_meanwhile(check) -> None:
    tree = RadixTree()
    texts = _fill(tree, A, 300)
    _fill(tree, B, 100, seed=2)
    shared = texts[0]
    tree.insert(shared, B)
    tree.detach_tenant(A)
    assert tree.tenants() == frozenset({B})
    slots = [("m", tree)]
    entries = [len(g) for _, g in tree._graves]
    slices = 0
    for _ in _upkeep(unit=16).run(lambda: slots, lambda k, n: None):
        slices += 1
        left = sum(len(g) for _, g in tree._graves)
        assert entries[-1] - left <= 16  # one step: at most `unit` entries (a pruned node's children count too)
        entries.append(left)
        # requests in between: A is gone for every match, B is matched as before, inserts go on
        for text in texts[:20]:
            assert A not in tree.match(text).tenants
        assert tree.match(shared) == Match(20, frozenset({B}))
        tree.insert(f"new {slices}", C)
        check(tree)
    assert slices >= entries[0] // 16  # A's nodes took many slices
    assert not tree.reclaim_pending()
    check(tree)
    assert tree.tenant_size(A) == 0 and tree.match(texts[1]).matched_chars < 20


def test_a_tenant_back_under_the_same_name_takes_over_only_what_it_inserts_again(check) -> None:
    tree = RadixTree()
    old = _fill(tree, A, 50)
    tree.detach_tenant(A)
    tree.insert(old[0], A)  # the worker came back (same URL) before its old nodes were reclaimed
    assert tree.match(old[0]) == Match(20, frozenset({A}))
    assert tree.match(old[1]).tenants == frozenset()  # never credited with what its old self held
    assert tree.tenant_size(A) == 20
    check(tree)
    for _ in _upkeep().run(lambda: [("m", tree)], lambda k, n: None):
        assert tree.match(old[0]) == Match(20, frozenset({A}))
        check(tree)
    assert len(tree) == 1 and tree.total_chars() == 20


def test_budget_shrinks_every_tenant_of_every_tree_by_the_same_fraction(check) -> None:
    trees = {"m1": RadixTree(), "m2": RadixTree()}
    _fill(trees["m1"], A, 2000)
    _fill(trees["m1"], B, 1000, seed=2)
    _fill(trees["m2"], A, 1000, seed=3)
    before = {(k, t): n for k, tree in trees.items() for t, n in tree.tenant_sizes().items()}
    total = sum(t.estimated_bytes() for t in trees.values())
    budget = total // 3
    evicted: dict[str, int] = {}
    upkeep = _upkeep(budget=budget, unit=64)
    for _ in upkeep.run(lambda: list(trees.items()), lambda k, n: evicted.update({k: evicted.get(k, 0) + n})):
        pass
    assert sum(t.estimated_bytes() for t in trees.values()) <= budget
    after = {(k, t): n for k, tree in trees.items() for t, n in tree.tenant_sizes().items()}
    fractions = [after[key] / before[key] for key in before]
    assert max(fractions) - min(fractions) < 0.1, fractions  # the same share for everyone, LRU within it
    for k, tree in trees.items():
        assert evicted[k] == sum(
            before[(k, t)] - after.get((k, t), 0) for t in ("worker-a", "worker-b") if (k, t) in before
        )
        check(tree)


def test_under_budget_and_caps_nothing_is_evicted() -> None:
    tree = RadixTree()
    _fill(tree, A, 100)
    size = tree.tenant_size(A)
    calls: list[int] = []
    assert (
        list(
            _upkeep(budget=tree.estimated_bytes()).run(
                lambda: [("m", tree)], lambda k, n: calls.append(n), tenant_cap=lambda k, t: size
            )
        )
        == []
    )
    assert calls == [] and tree.tenant_size(A) == size


def test_a_tenant_past_its_own_cap_goes_down_to_the_low_water_mark_and_one_without_a_cap_stays() -> None:
    tree = RadixTree()
    for i in range(12):
        tree.insert(chr(65 + i) * 100, A)
        tree.insert(chr(97 + i) * 100, "b")
    upkeep = Upkeep(Limits(budget_bytes=BIG, low_water_ratio=0.8), clock=lambda: 0.0)
    for _ in upkeep.run(lambda: [("m", tree)], lambda k, n: None, tenant_cap=lambda k, t: 1000 if t == A else None):
        pass
    assert (tree.tenant_size(A), tree.tenant_size("b")) == (800, 1200)


def test_eviction_job_meets_requests_between_its_steps(check) -> None:
    """Refreshes, matches and a removal between two steps: the job re-checks every node it queued, keeps
    what was refreshed meanwhile (now the most recent) and still ends within its budget."""
    tree = RadixTree()
    texts = _fill(tree, A, 400)
    _fill(tree, B, 50, seed=5)
    hot = texts[::40]  # 10 prompts the requests keep asking for while the job runs
    job = tree.eviction(A, 1000)
    rng = random.Random(9)
    steps = 0
    while job.step(8):
        steps += 1
        tree.insert(hot[steps % len(hot)], A)
        tree.match(rng.choice(texts))
        if steps == 50:
            tree.remove_tenant(B)
        check(tree)
    assert steps > 100
    assert tree.tenant_size(A) <= 1000
    assert all(tree.match(text) == Match(20, frozenset({A})) for text in hot)
    check(tree)


def test_a_slice_ends_when_the_clock_says_so(monkeypatch) -> None:
    """Slices are cut by the caller's clock: a clock that moves 1 ms per reading and a 4 ms slice give a
    pause every few steps, not after each one and not never."""
    now = [0.0]

    def clock() -> float:
        now[0] += 0.001
        return now[0]

    tree = RadixTree()
    _fill(tree, A, 500)
    tree.detach_tenant(A)
    steps = 0
    real = RadixTree.reclaim

    def counting(self: RadixTree, budget: int) -> bool:
        nonlocal steps
        steps += 1
        return real(self, budget)

    monkeypatch.setattr(RadixTree, "reclaim", counting)
    upkeep = Upkeep(Limits(budget_bytes=BIG), clock=clock, slice_seconds=0.004, unit=8)
    slices = sum(1 for _ in upkeep.run(lambda: [("m", tree)], lambda k, n: None))
    assert 1 < slices < steps
