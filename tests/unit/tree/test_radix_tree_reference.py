"""Property tests: RadixTree against a naive reference (per tenant, the set of all prefixes it holds).

In the reference every stored char is one distinct prefix string, so a tenant's size is exactly the number
of prefixes it holds and the tree's total chars is the size of the union.
"""

from __future__ import annotations

from itertools import product

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from smg_router.tree import Match, RadixTree

TENANTS = ["w0", "w1", "w2"]
SETTINGS = settings(
    max_examples=300,
    deadline=None,
    database=None,  # do not write a .hypothesis/ directory into the repository
    suppress_health_check=[HealthCheck.too_slow],
)
# every string of length <= 4 over "abc" (121 probes), matched after every operation
PROBES = ["".join(p) for n in range(5) for p in product("abc", repeat=n)]


class Reference:
    def __init__(self) -> None:
        self.prefixes: dict[str, set[str]] = {}

    def insert(self, text: str, tenant: str) -> None:
        if text:
            self.prefixes.setdefault(tenant, set()).update(text[:i] for i in range(1, len(text) + 1))

    def remove(self, tenant: str) -> int:
        return len(self.prefixes.pop(tenant, ()))

    def match(self, text: str) -> Match:
        for k in range(len(text), 0, -1):
            p = text[:k]
            holders = frozenset(t for t, s in self.prefixes.items() if p in s)
            if holders:
                return Match(k, holders)
        return Match(0, frozenset())

    def sizes(self) -> dict[str, int]:
        return {t: len(s) for t, s in self.prefixes.items() if s}

    def total(self) -> int:
        return len(set().union(*self.prefixes.values())) if self.prefixes else 0


texts = {alpha: st.text(alphabet=alpha, max_size=10) for alpha in ("ab", "abc")}
tenant_st = st.sampled_from(TENANTS)


def ops_strategy(alpha: str, with_evict: bool) -> st.SearchStrategy[list[tuple]]:
    text = texts[alpha]
    choices = [
        st.tuples(st.just("insert"), text, tenant_st),
        st.tuples(st.just("insert"), text, tenant_st),
        st.tuples(st.just("match_and_insert"), text, tenant_st),
        st.tuples(st.just("remove"), tenant_st),
        st.tuples(st.just("match"), text),
    ]
    if with_evict:
        choices += [
            st.tuples(st.just("evict_tenant"), tenant_st, st.integers(0, 12)),
            st.tuples(st.just("evict"), st.integers(0, 12)),
        ]
    return st.lists(st.one_of(choices), max_size=40)


def compare(tree: RadixTree, ref: Reference) -> None:
    assert tree.tenant_sizes() == ref.sizes()
    assert tree.tenants() == frozenset(ref.sizes())
    assert tree.total_chars() == ref.total()
    for probe in PROBES:
        assert tree.match(probe) == ref.match(probe), probe


def apply(op: tuple, tree: RadixTree, ref: Reference, held) -> None:
    kind = op[0]
    if kind == "insert":
        _, text, tenant = op
        tree.insert(text, tenant)
        ref.insert(text, tenant)
    elif kind == "match_and_insert":
        _, text, tenant = op
        expected = ref.match(text)
        seen: list[Match] = []
        assert tree.match_and_insert(text, lambda m: seen.append(m) or tenant) == tenant
        assert seen == [expected]
        ref.insert(text, tenant)
    elif kind == "remove":
        _, tenant = op
        assert tree.remove_tenant(tenant) == ref.remove(tenant)
    elif kind == "match":
        _, text = op
        assert tree.match(text) == ref.match(text)
    elif kind in ("evict_tenant", "evict"):
        if kind == "evict_tenant":
            _, tenant, budget = op
            evicted = {tenant: tree.evict_tenant(tenant, budget)}
            victims = [tenant]
        else:
            _, budget = op
            evicted = tree.evict(budget)
            assert all(n > 0 for n in evicted.values())
            victims = list(ref.prefixes)
        for tenant in victims:
            before = ref.prefixes.get(tenant, set())
            after = held(tree, tenant)
            # never invents data, stays prefix-closed, honours the budget, reports what it removed
            assert after <= before
            assert all(p[:i] in after for p in after for i in range(1, len(p)))
            assert len(after) == tree.tenant_size(tenant)
            if len(before) > budget:
                assert len(after) <= budget
                assert evicted.get(tenant, 0) == len(before) - len(after)
            else:
                assert after == before
                assert evicted.get(tenant, 0) == 0
            if after:
                ref.prefixes[tenant] = after
            else:
                ref.prefixes.pop(tenant, None)
    else:  # pragma: no cover
        raise AssertionError(kind)


@SETTINGS
@given(ops=ops_strategy("ab", with_evict=False))
def test_matches_reference_ab(ops, check, held) -> None:
    tree, ref = RadixTree(), Reference()
    for op in ops:
        apply(op, tree, ref, held)
        check(tree)
        compare(tree, ref)


@SETTINGS
@given(ops=ops_strategy("abc", with_evict=False))
def test_matches_reference_abc(ops, check, held) -> None:
    tree, ref = RadixTree(), Reference()
    for op in ops:
        apply(op, tree, ref, held)
        check(tree)
        compare(tree, ref)


@SETTINGS
@given(ops=ops_strategy("ab", with_evict=True))
def test_eviction_properties_ab(ops, check, held) -> None:
    tree, ref = RadixTree(), Reference()
    for op in ops:
        apply(op, tree, ref, held)
        check(tree)
        compare(tree, ref)


@SETTINGS
@given(ops=ops_strategy("abc", with_evict=True))
def test_eviction_properties_abc(ops, check, held) -> None:
    tree, ref = RadixTree(), Reference()
    for op in ops:
        apply(op, tree, ref, held)
        check(tree)
        compare(tree, ref)


@SETTINGS
@given(
    inserts=st.lists(st.tuples(texts["abc"], tenant_st), max_size=30),
    refresh=st.lists(texts["abc"], max_size=5),
    budget=st.integers(0, 20),
)
def test_eviction_keeps_most_recent_insert_when_it_fits(inserts, refresh, budget, check, held) -> None:
    """LRU property: the most recently inserted text of a tenant is the last thing evicted."""
    tree = RadixTree()
    for text, tenant in inserts:
        tree.insert(text, tenant)
    last = None
    for text in refresh:
        tree.insert(text, "w0")
        last = text or last
    if last is None:
        return
    tree.evict(budget)
    check(tree)
    got = tree.match(last)
    if len(last) <= budget:
        # every node on last's path has the newest tick; only whole nodes are evicted, so the path survives
        assert got.matched_chars == len(last)
        assert "w0" in got.tenants
    assert tree.tenant_size("w0") <= budget


# ---------------------------------------------------------------------- resumable work, interleaved


def sliced_ops_strategy(text: st.SearchStrategy[str]) -> st.SearchStrategy[list[tuple]]:
    """Requests (insert, match_and_insert, match) interleaved with the halves of removal and with the
    steps of an eviction job: the upkeep task's slices between requests."""
    return st.lists(
        st.one_of(
            st.tuples(st.just("insert"), text, tenant_st),
            st.tuples(st.just("insert"), text, tenant_st),
            st.tuples(st.just("match_and_insert"), text, tenant_st),
            st.tuples(st.just("match"), text),
            st.tuples(st.just("detach"), tenant_st),
            st.tuples(st.just("reclaim"), st.integers(1, 4)),
            st.tuples(st.just("reclaim"), st.just(1)),
            st.tuples(st.just("start_eviction"), tenant_st, st.integers(0, 12)),
            st.tuples(st.just("step"), st.integers(1, 4)),
            st.tuples(st.just("step"), st.just(1)),
            st.tuples(st.just("remove"), tenant_st),
        ),
        min_size=20,
        max_size=45,
    )  # long enough for a job to be queued, then overtaken by requests


def compare_live(tree: RadixTree, ref: Reference, probes: list[str]) -> None:
    """``compare`` while dead entries may remain: they still count in total_chars until reclaimed."""
    assert tree.tenant_sizes() == ref.sizes()
    assert tree.tenants() == frozenset(ref.sizes())
    if not tree.reclaim_pending():
        assert tree.total_chars() == ref.total()
    for probe in probes:
        assert tree.match(probe) == ref.match(probe), probe


def run_sliced(ops: list[tuple], check, held, probes: list[str] = PROBES) -> None:
    tree, ref = RadixTree(), Reference()
    job = None
    job_grown = False  # the job's tenant got an insert since the job started
    for op in ops:
        kind = op[0]
        if kind == "detach":
            assert tree.detach_tenant(op[1]) == ref.remove(op[1])
        elif kind == "reclaim":
            tree.reclaim(op[1])
        elif kind == "start_eviction":
            job, job_grown = tree.eviction(op[1], op[2]), False
        elif kind == "step":
            if job is None:
                continue
            tenant = job.tenant
            before, evicted = ref.prefixes.get(tenant, set()), job.evicted
            more = job.step(op[1])
            after = held(tree, tenant)
            # never invents data, stays prefix-closed, reports what it removed, touches no other tenant
            assert after <= before
            assert all(p[:i] in after for p in after for i in range(1, len(p)))
            assert job.evicted - evicted == len(before) - len(after)
            if after:
                ref.prefixes[tenant] = after
            else:
                ref.prefixes.pop(tenant, None)
            if not more:
                if not job_grown:  # the budget holds unless newer nodes of the tenant came in meanwhile
                    assert tree.tenant_size(tenant) <= job.max_chars
                job = None
        else:
            if job is not None and kind in ("insert", "match_and_insert") and op[2] == job.tenant:
                job_grown = True
            apply(op, tree, ref, held)
        check(tree)
        compare_live(tree, ref, probes)
    # whatever was left half done finishes, and the tree is exactly the reference again
    if job is not None:
        job.run()
        after = held(tree, job.tenant)
        assert after <= ref.prefixes.get(job.tenant, set())
        if after:
            ref.prefixes[job.tenant] = after
        else:
            ref.prefixes.pop(job.tenant, None)
    while tree.reclaim(3):
        check(tree)
        compare_live(tree, ref, probes)
    check(tree)
    compare_live(tree, ref, probes)
    assert len(tree._dead) == 0 and tree._graves == []


SLICED_SETTINGS = settings(SETTINGS, max_examples=150)  # ~45 ops with a full check after each: ~3 s a test


@SLICED_SETTINGS
@given(ops=sliced_ops_strategy(texts["ab"]))
def test_sliced_removal_and_eviction_match_reference_ab(ops, check, held) -> None:
    run_sliced(ops, check, held)


@SLICED_SETTINGS
@given(ops=sliced_ops_strategy(texts["abc"]))
def test_sliced_removal_and_eviction_match_reference_abc(ops, check, held) -> None:
    run_sliced(ops, check, held)


@SLICED_SETTINGS
@given(ops=sliced_ops_strategy(st.text(alphabet="ab", max_size=5)))
def test_sliced_work_on_a_dense_tree_matches_reference(ops, check, held) -> None:
    """Short texts over two letters: every tenant shares most nodes, so removals overlap, steps meet nodes
    refreshed, grown or evicted since they were queued, and pruned nodes leave orphans behind."""
    run_sliced(ops, check, held)


WIDE_PROBES = ["".join(p) for n in range(5) for p in product("a\u00e9\u4e2d", repeat=n)]


@SLICED_SETTINGS
@given(ops=sliced_ops_strategy(st.text(alphabet="a\u00e9\u4e2d", max_size=6)))
def test_sliced_work_keeps_the_bytes_of_wide_chars_exact(ops, check, held) -> None:
    """ASCII, Latin-1 and CJK edges (1 and 2 bytes per char) split, merge and go: ``check``
    recomputes what non-ASCII edges cost from the structure after every step."""
    run_sliced(ops, check, held, WIDE_PROBES)
