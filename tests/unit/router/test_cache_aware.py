"""cache_aware decisions against the rule of DESIGN 2.3, with real metrics and a real load view."""

from __future__ import annotations

import pytest
from support.policy_env import Env, RouteRequest, make_worker

NOW = 1000.0


def _policy(env: Env, workers):
    p = env.factory.create("cache_aware", role="regular")
    p.sync(workers)
    for w in workers:
        env.loads.record(w.id, 0, at=NOW)
    return p


def test_shared_prefix_goes_to_the_worker_that_holds_it(env: Env) -> None:
    workers = [make_worker(i) for i in (2, 3, 4)]
    p = _policy(env, workers)
    prefix = "system: you are a helpful assistant. " * 20
    first = p.select(workers, RouteRequest("m", prefix + "question one"), NOW)
    for q in ("question two", "another", "third one"):
        assert p.select(workers, RouteRequest("m", prefix + q), NOW) is first
    assert env.sample("smg_cache_tree_hits_total", model="m", role="regular") == 3
    assert env.sample("smg_cache_tree_misses_total", model="m", role="regular") == 1


def test_distinct_prefixes_spread_over_workers(env: Env) -> None:
    workers = [make_worker(i) for i in (2, 3, 4)]
    p = _policy(env, workers)
    chosen = set()
    for i in range(3):
        w = p.select(workers, RouteRequest("m", f"{i}-" + chr(65 + i) * 200), NOW)
        w.processed += 1  # the proxy counts it
        chosen.add(w.url)
    assert len(chosen) == 3


def test_threshold_is_strict(env: Env) -> None:
    env = Env(cache_threshold=0.5)
    workers = [make_worker(i) for i in (2, 3)]
    p = _policy(env, workers)
    holder = p.select(workers, RouteRequest("m", "aaaa"), NOW)
    holder.processed += 5  # make the other worker the least-loaded tie-break choice
    # "aaaabbbb": 4 of 8 chars match -> rate 0.5, not > 0.5 -> a miss, goes to the least loaded
    other = p.select(workers, RouteRequest("m", "aaaabbbb"), NOW)
    assert other is not holder
    assert env.sample("smg_cache_tree_hits_total", model="m", role="regular") == 0
    # "aaaab": 4/5 = 0.8 > 0.5 -> a hit on a holder of the deepest node ("aaaa" is held by both now)
    p.select(workers, RouteRequest("m", "aaaab"), NOW)
    assert env.sample("smg_cache_tree_hits_total", model="m", role="regular") == 1


def test_imbalance_uses_backend_backlog_even_without_local_inflight(env: Env) -> None:
    workers = [make_worker(i) for i in (2, 3)]
    p = _policy(env, workers)
    text = "shared prompt " * 50
    holder = p.select(workers, RouteRequest("m", text), NOW)
    other = next(w for w in workers if w is not holder)
    env.loads.record(holder.id, 200, at=NOW)  # backend backlog; the router's own inflight stays 0
    assert holder.inflight == 0
    assert p.select(workers, RouteRequest("m", text), NOW) is other
    assert (
        env.sample("smg_routing_fallbacks_total", model="m", role="regular", policy="cache_aware", reason="imbalance")
        == 1
    )


@pytest.mark.parametrize(
    ("hi", "lo", "imbalanced"), [(65, 0, True), (64, 0, False), (200, 140, False), (300, 100, True)]
)
def test_imbalance_needs_both_conditions(hi: int, lo: int, imbalanced: bool) -> None:
    env = Env()
    workers = [make_worker(i) for i in (2, 3)]
    p = _policy(env, workers)
    text = "x" * 100
    holder = p.select(workers, RouteRequest("m", text), NOW)
    other = next(w for w in workers if w is not holder)
    env.loads.record(holder.id, hi, at=NOW)
    env.loads.record(other.id, lo, at=NOW)
    got = p.select(workers, RouteRequest("m", text), NOW)
    assert (got is other) == imbalanced
    assert env.sample(
        "smg_routing_fallbacks_total", model="m", role="regular", policy="cache_aware", reason="imbalance"
    ) == (1 if imbalanced else 0)


def test_local_inflight_wins_over_an_older_idle_snapshot(env: Env) -> None:
    """max(snapshot, local): a burst between polls does not all land on the worker that looked idle."""
    workers = [make_worker(i) for i in (2, 3)]
    p = _policy(env, workers)
    seen = []
    for i in range(10):
        w = p.select(workers, RouteRequest("m", f"burst {i} " + "z" * 50), NOW)
        w.inflight += 1  # still running: the proxy holds it
        seen.append(w)
    assert {w.url for w in seen} == {w.url for w in workers}
    assert abs(workers[0].inflight - workers[1].inflight) <= 1


def test_stale_snapshot_counts_no_load_data(env: Env) -> None:
    workers = [make_worker(i) for i in (2, 3)]
    p = _policy(env, workers)
    p.select(workers, RouteRequest("m", "abc"), NOW + 60)  # snapshot is 60 s old (max_age 5)
    assert (
        env.sample(
            "smg_routing_fallbacks_total", model="m", role="regular", policy="cache_aware", reason="no_load_data"
        )
        == 1
    )


def test_unroutable_holder_counts_stale_tenant(env: Env) -> None:
    workers = [make_worker(i) for i in (2, 3)]
    p = _policy(env, workers)
    text = "q" * 100
    holder = p.select(workers, RouteRequest("m", text), NOW)
    rest = [w for w in workers if w is not holder]  # the holder is not routable right now
    assert p.select(rest, RouteRequest("m", text), NOW) is rest[0]
    assert (
        env.sample(
            "smg_routing_fallbacks_total", model="m", role="regular", policy="cache_aware", reason="stale_tenant"
        )
        == 1
    )


def test_sync_removes_a_worker_from_the_tree_and_keeps_others(env: Env) -> None:
    workers = [make_worker(i) for i in (2, 3)]
    p = _policy(env, workers)
    a = p.select(workers, RouteRequest("m", "a" * 100), NOW)
    a.processed += 1
    b = p.select(workers, RouteRequest("m", "b" * 100), NOW)
    assert a is not b
    p.sync([b])
    sizes = {w: c for _, w, c in p.tree_sizes()}
    assert sizes == {b.url: 100}
    assert p.select([b], RouteRequest("m", "b" * 100), NOW) is b
    assert env.sample("smg_cache_tree_hits_total", model="m", role="regular") == 1


def test_missing_tree_is_created_and_counted(env: Env) -> None:
    workers = [make_worker(i, model="other") for i in (2, 3)]
    p = _policy(env, [])  # lifecycle never told it about these workers
    p.select(workers, RouteRequest("other", "hello"), NOW)
    assert p.has_tree("other")
    assert (
        env.sample("smg_routing_fallbacks_total", model="other", role="regular", policy="cache_aware", reason="no_tree")
        == 1
    )
    p.select(workers, RouteRequest("other", "hello"), NOW)
    assert (
        env.sample("smg_routing_fallbacks_total", model="other", role="regular", policy="cache_aware", reason="no_tree")
        == 1
    )


def test_high_water_mark_evicts_between_periods() -> None:
    env = Env(max_tree_size=1000, high_water_ratio=1.2)
    workers = [make_worker(2)]
    p = _policy(env, workers)
    for i in range(30):
        p.select(workers, RouteRequest("m", f"{i:03d}" + "p" * 97), NOW)
    ((_, _, size),) = list(p.tree_sizes())
    assert size <= 1200
    assert env.sample("smg_cache_tree_evictions_total", model="m", role="regular") > 0


def test_periodic_maintain_evicts_to_budget() -> None:
    env = Env(max_tree_size=500, high_water_ratio=100.0)
    workers = [make_worker(2)]
    p = _policy(env, workers)
    for i in range(20):
        p.select(workers, RouteRequest("m", f"{i:03d}" + "p" * 97), NOW)
    p.maintain()
    ((_, _, size),) = list(p.tree_sizes())
    assert size <= 500


def test_tree_memory_budget_comes_from_the_flag_or_the_environment(monkeypatch) -> None:
    from smg_router.settings import PolicySettings, parse_settings

    assert PolicySettings().tree_memory_budget == 256 * 2**20
    monkeypatch.setenv("SMG_TREE_MEMORY_BUDGET", "1000000")
    assert parse_settings([]).policy.tree_memory_budget == 1_000_000
    assert parse_settings(["--tree-memory-budget", "2000000"]).policy.tree_memory_budget == 2_000_000
    with pytest.raises(SystemExit):
        parse_settings(["--tree-memory-budget", "0"])
