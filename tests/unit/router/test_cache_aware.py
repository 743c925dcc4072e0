"""cache_aware decisions against the rule of docs/architecture.md, with real metrics and a real load view."""

from __future__ import annotations

import json
from typing import Any

import pytest
from smg_router.policies.registry import PolicyRegistry
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


def _replica(workers_at: tuple[int, ...] = (2, 3, 4), **settings: object) -> tuple[Env, object, list]:
    """One router replica: its own metrics, load view, policy and Worker objects for the same URLs."""
    env = Env(**settings)
    workers = [make_worker(i) for i in workers_at]
    return env, _policy(env, workers), workers


def test_replicas_place_every_new_prefix_on_the_same_worker_whatever_the_order() -> None:
    """Rendezvous placement: a prefix nobody holds goes where its leading chars rank first, a function of the
    text and the fleet only, so two replicas that saw the prefixes in opposite orders agree on every one."""
    prefixes = [f"group {i}: " + chr(65 + i % 26) * 300 for i in range(60)]
    _, a, wa = _replica()
    _, b, wb = _replica()
    placed_a = {}
    for text in prefixes:
        w = a.select(wa, RouteRequest("m", text), NOW)
        w.processed += 1  # the proxy counts it (the old rule spread new prefixes by this)
        placed_a[text] = w.url
    placed_b = {}
    for text in reversed(prefixes):
        w = b.select(wb, RouteRequest("m", text), NOW)
        w.processed += 1
        placed_b[text] = w.url
    assert placed_a == placed_b
    per_worker = [list(placed_a.values()).count(w.url) for w in wa]
    assert min(per_worker) >= 60 // 3 // 2, per_worker  # spread over the fleet, not piled on one worker
    # ... and the question after the prefix does not matter: a group's requests rank alike
    for text in prefixes[:10]:
        assert b.select(wb, RouteRequest("m", text[:200] + " another question"), NOW).url == placed_a[text]


@pytest.mark.parametrize("choices", [0, 4, 2, 1])
def test_a_new_group_skips_first_choices_with_no_kv_room_left_for_the_best_ranked_with_room(choices: int) -> None:
    """Placement accounts for what each worker holds: a miss goes to the best-ranked of the first
    ``--placement-choices`` workers whose tree share can take the prompt under its KV cap (0, the default: all of
    them; 2: the second when the first is full); with 1 it always goes to the first; where none of them has
    room, to the first."""
    from smg_router.policies.placement import placement_key, rendezvous_ranked

    env = Env(tree_chars_per_token=1.0, placement_choices=choices)
    workers = [make_worker(i) for i in (2, 3, 4, 5)]
    p = env.factory.create("cache_aware", role="regular")
    p.sync(workers)
    for w in workers:
        env.loads.record(w.id, 0, at=NOW)
        env.loads.record_kv(w.id, 1000)  # every share capped at 1000 chars

    def group(i: int) -> str:
        return f"document {i:03d} " + "abcdefghij"[i % 10] * 390  # 403 chars: two fit in 1000, three do not

    ranks = {i: rendezvous_ranked(workers, [True] * 4, placement_key(group(i), 1024), 4) for i in range(400)}
    assert all(sorted(r) == [0, 1, 2, 3] for r in ranks.values())
    home = workers[0]
    mine = [i for i, ranked in ranks.items() if ranked[0] == 0]
    for i in mine[:2]:  # two groups fill the first worker's share as far as a third cannot fit
        assert p.select(workers, RouteRequest("m", group(i)), NOW) is home
    third = mine[2]
    second = workers[ranks[third][1]]
    got = p.select(workers, RouteRequest("m", group(third)), NOW)
    assert got is (home if choices == 1 else second)
    assert env.sample("smg_routing_decisions_total", model="m", role="regular", branch="miss") == 3
    # the group stays where it went: its next request is a hit there
    assert p.select(workers, RouteRequest("m", group(third) + " a question"), NOW) is got
    if choices == 1:
        return
    # the second-ranked worker is full too: the third-ranked takes it if it may be chosen, else the first keeps it
    tree = p._trees["m"]
    tree.insert("x" * 999, second.url)
    fourth = next(i for i in mine[3:] if ranks[i][1] == ranks[third][1])
    got = p.select(workers, RouteRequest("m", group(fourth)), NOW)
    assert got is (home if choices == 2 else workers[ranks[fourth][2]])


def test_placement_depends_on_the_leading_chars_only(env: Env) -> None:
    env = Env(placement_prefix_chars=16, cache_threshold=0.99)  # every request below is a miss
    workers = [make_worker(i) for i in range(2, 10)]
    p = _policy(env, workers)
    head = "0123456789abcdef"
    first = p.select(workers, RouteRequest("m", head + "x" * 50), NOW)
    assert all(p.select(workers, RouteRequest("m", head + f"{i}" * 60), NOW) is first for i in range(10))
    assert env.sample("smg_routing_decisions_total", model="m", role="regular", branch="miss") == 11
    heads = {p.select(workers, RouteRequest("m", f"{i:016d}" + "y" * 50), NOW).url for i in range(40)}
    assert len(heads) >= 6  # other heads, other workers


def test_threshold_is_strict(env: Env) -> None:
    env = Env(cache_threshold=0.5)
    workers = [make_worker(i) for i in (2, 3)]
    p = _policy(env, workers)
    p.select(workers, RouteRequest("m", "aaaa"), NOW)
    # "aaaabbbb": 4 of 8 chars match -> rate 0.5, not > 0.5 -> a miss (placed by rendezvous)
    p.select(workers, RouteRequest("m", "aaaabbbb"), NOW)
    assert env.sample("smg_cache_tree_hits_total", model="m", role="regular") == 0
    assert env.sample("smg_routing_decisions_total", model="m", role="regular", branch="miss") == 2
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


@pytest.mark.parametrize(("hi", "lo", "imbalanced"), [(5, 0, True), (4, 0, False), (200, 140, False), (300, 100, True)])
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
    """max(snapshot, local): a burst of new prompts between polls does not all land on the worker that looked
    idle; rendezvous picks only among the workers within the placement slack of the least loaded."""
    workers = [make_worker(i) for i in (2, 3)]
    p = _policy(env, workers)
    seen = []
    for i in range(40):
        w = p.select(workers, RouteRequest("m", f"burst {i} " + "z" * 50), NOW)
        w.inflight += 1  # still running: the proxy holds it
        seen.append(w)
        lo = min(w.inflight for w in workers)
        gate = max(env.settings.balance_abs_threshold, (env.settings.balance_rel_threshold - 1) * lo)
        assert abs(workers[0].inflight - workers[1].inflight) <= gate + 1
    assert {w.url for w in seen} == {w.url for w in workers}


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
    from smg_router.policies.placement import placement_key, rendezvous_ranked

    def first_on(i: int) -> str:  # a prompt that ranks first on workers[i]
        return next(
            t
            for c in "abcdefgh"
            if rendezvous_ranked(workers, [True, True], placement_key(t := c * 100, 1024), 1) == [i]
        )

    a = p.select(workers, RouteRequest("m", first_on(0)), NOW)
    b = p.select(workers, RouteRequest("m", b_text := first_on(1)), NOW)
    assert a is not b
    p.sync([b])
    sizes = {w: c for _, w, c in p.tree_sizes()}
    assert sizes == {b.url: 100}
    assert p.select([b], RouteRequest("m", b_text), NOW) is b
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


def _upkeep(reg: PolicyRegistry, *, periodic: bool) -> int:
    """Run one upkeep round to its end, as the router's task does between its slices; returns the slices."""
    return sum(1 for _ in reg.tree_upkeep(periodic=periodic)) + 1


def test_high_water_mark_evicts_between_periods() -> None:
    """The request path never evicts; the next upkeep round (every 0.5 s, not every eviction_interval)
    brings a worker past the high-water mark back to max_tree_size."""
    env = Env(max_tree_size=1000, high_water_ratio=1.2)
    reg = PolicyRegistry(env.factory, env.settings)
    workers = [make_worker(2)]
    reg.sync(workers)
    env.loads.record(workers[0].id, 0, at=NOW)
    p = reg.default
    for i in range(30):
        p.select(workers, RouteRequest("m", chr(65 + i) + "p" * 99), NOW)
    ((_, _, size),) = list(p.tree_sizes())
    assert size == 3000  # nothing evicted on the request path
    _upkeep(reg, periodic=False)
    ((_, _, size),) = list(p.tree_sizes())
    assert size <= 1000
    assert env.sample("smg_cache_tree_evictions_total", model="m", role="regular") > 0


def test_between_periods_only_workers_past_the_high_water_mark_are_evicted() -> None:
    env = Env(max_tree_size=1000, high_water_ratio=1.5)
    reg = PolicyRegistry(env.factory, env.settings)
    workers = [make_worker(2)]
    reg.sync(workers)
    env.loads.record(workers[0].id, 0, at=NOW)
    for i in range(12):  # 1200 chars: over max_tree_size, under the high-water mark (1500)
        reg.default.select(workers, RouteRequest("m", chr(65 + i) * 100), NOW)
    _upkeep(reg, periodic=False)
    assert [size for *_, size in reg.default.tree_sizes()] == [1200]
    _upkeep(reg, periodic=True)
    assert [size for *_, size in reg.default.tree_sizes()] == [1000]


def test_periodic_maintain_evicts_to_budget() -> None:
    env = Env(max_tree_size=500, high_water_ratio=100.0)
    workers = [make_worker(2)]
    p = _policy(env, workers)
    for i in range(20):
        p.select(workers, RouteRequest("m", f"{i:03d}" + "p" * 97), NOW)
    p.maintain()
    ((_, _, size),) = list(p.tree_sizes())
    assert size <= 500


def _registry(env: Env, workers) -> PolicyRegistry:
    reg = PolicyRegistry(env.factory, env.settings)
    reg.sync(workers)
    for w in workers:
        env.loads.record(w.id, 0, at=NOW)
    return reg


def test_a_removed_worker_leaves_every_match_at_once_even_back_under_the_same_url(env: Env) -> None:
    """Removal detaches the worker at once and reclaims its nodes later: meanwhile nothing routes by what
    it held, not even the same URL registered again (a new worker with an empty cache)."""
    a, b = make_worker(2), make_worker(3)
    reg = _registry(env, [a, b])
    text = "cached prompt " * 20
    holder = reg.default.select([a, b], RouteRequest("m", text), NOW)
    other = b if holder is a else a
    reg.sync([other])  # the holder leaves...
    assert {w for _, w, _ in reg.default.tree_sizes()} == set()
    reg.sync([holder, other])  # ...and comes back before upkeep reclaimed anything
    again = reg.default.select([holder, other], RouteRequest("m", text), NOW)  # a miss, not a hit
    assert env.sample("smg_cache_tree_hits_total", model="m", role="regular") == 0
    assert env.sample("smg_routing_decisions_total", model="m", role="regular", branch="miss") == 2
    assert {w for _, w, _ in reg.default.tree_sizes()} == {again.url}
    for _ in reg.tree_upkeep(periodic=False):
        pass
    assert reg.default.select([holder, other], RouteRequest("m", text), NOW) is again  # now a hit
    assert env.sample("smg_cache_tree_hits_total", model="m", role="regular") == 1


def test_trees_of_a_model_that_left_are_reclaimed_by_upkeep_and_counted_until_then(env: Env) -> None:
    workers = [make_worker(2, model="gone"), make_worker(3)]
    reg = _registry(env, workers)
    env.metrics.add_tree_bytes_source(reg.tree_bytes)
    for i in range(200):
        reg.default.select(workers[:1], RouteRequest("gone", f"{i:04d} " + "g" * 50), NOW)
    held = env.sample("smg_cache_tree_bytes", model="gone", role="regular")
    assert held > 200 * 50
    reg.sync(workers[1:])  # the model's last worker left: its tree is retired, not freed in one go
    assert not reg.default.has_tree("gone")
    assert env.sample("smg_cache_tree_bytes", model="gone", role="regular") == held
    for _ in reg.tree_upkeep(periodic=False):
        pass
    assert env.metrics.registry.get_sample_value("smg_cache_tree_bytes", {"model": "gone", "role": "regular"}) is None


def test_one_budget_covers_every_policy_instance() -> None:
    """Default, prefill and decode instances each keep their trees; the budget is for all of them."""
    budget = 400_000
    env = Env(tree_memory_budget=budget)
    regular, pre, dec = make_worker(2), make_worker(3, role="prefill"), make_worker(4, role="decode")
    reg = _registry(env, [regular, pre, dec])
    env.metrics.add_tree_bytes_source(reg.tree_bytes)
    for policy, w in ((reg.default, regular), (reg.prefill, pre), (reg.decode, dec)):
        for i in range(600):
            policy.select([w], RouteRequest("m", f"{i:05d} unique tail {i * 7919}"), NOW)
    total = sum(n for *_, n in reg.tree_bytes())
    assert total > budget
    for _ in reg.tree_upkeep(periodic=False):
        pass
    by_role = {role: n for _, role, n in reg.tree_bytes()}
    assert sum(by_role.values()) <= budget
    assert set(by_role) == {"regular", "prefill", "decode"} and min(by_role.values()) > budget // 10
    for role in by_role:
        assert env.sample("smg_cache_tree_evictions_total", model="m", role=role) > 0
        assert env.sample("smg_cache_tree_bytes", model="m", role=role) == by_role[role]


def test_a_dropped_per_model_instance_keeps_its_trees_until_upkeep_reclaims_them(env: Env) -> None:
    labelled = make_worker(2, model="b", labels={"policy": "cache_aware"})
    reg = _registry(env, [labelled])
    for i in range(100):
        reg.by_model["b"].select([labelled], RouteRequest("b", f"{i:04d} " + "b" * 40), NOW)
    reg.sync([])  # the worker left: the per-model instance goes, its tree is not freed in one go
    assert "b" not in reg.by_model
    assert [model for model, _, n in reg.tree_bytes() if n > 100 * 40] == ["b"]
    for _ in reg.tree_upkeep(periodic=False):
        pass
    assert list(reg.tree_bytes()) == []


def test_tree_memory_budget_comes_from_the_flag_or_the_environment(monkeypatch) -> None:
    from smg_router.settings import PolicySettings, parse_settings

    assert PolicySettings().tree_memory_budget == 256 * 2**20
    monkeypatch.setenv("SMG_TREE_MEMORY_BUDGET", "1000000")
    assert parse_settings([]).policy.tree_memory_budget == 1_000_000
    assert parse_settings(["--tree-memory-budget", "2000000"]).policy.tree_memory_budget == 2_000_000
    with pytest.raises(SystemExit):
        parse_settings(["--tree-memory-budget", "0"])


def test_a_hit_on_a_holder_over_the_load_gate_spills_to_the_rendezvous_choice(env: Env) -> None:
    workers = [make_worker(i) for i in (2, 3, 4)]
    p = _policy(env, workers)
    text = "shared prompt " * 50
    holder = p.select(workers, RouteRequest("m", text), NOW)
    env.loads.record(holder.id, 500, at=NOW)  # far over the gate (abs 4, rel 1.5)
    spilled = p.select(workers, RouteRequest("m", text), NOW)
    assert spilled is not holder
    branches = {
        b: env.sample("smg_routing_decisions_total", model="m", role="regular", branch=b)
        for b in ("hit", "miss", "spill")
    }
    assert branches == {"hit": 0, "miss": 1, "spill": 1}
    # the spill went where a replica that never saw the text would place it: agreement even under load
    _, other_replica, other_workers = _replica()
    fresh = next(w for w in other_workers if w.url == holder.url)
    other_replica.ctx.loads.record(fresh.id, 500, at=NOW)
    assert other_replica.select(other_workers, RouteRequest("m", text), NOW).url == spilled.url


def test_cache_namespaces_never_match_each_other(env: Env) -> None:
    """The routing text carries the request's cache namespace (request.cache_namespace): the same prompt
    with another cache_salt or LoRA adapter is a miss, placed on its own."""
    from smg_router.request import cache_namespace

    workers = [make_worker(i) for i in (2, 3, 4)]
    p = _policy(env, workers)
    prompt = "a long shared system prompt " * 40
    texts = [
        cache_namespace(body) + prompt
        for body in ({}, {"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}, {"lora_path": "adapter-1"})
    ]
    assert len(set(texts)) == 4
    for text in texts:
        p.select(workers, RouteRequest("m", text), NOW)
    assert env.sample("smg_cache_tree_hits_total", model="m", role="regular") == 0
    for text in texts:  # each namespace hits only its own
        p.select(workers, RouteRequest("m", text + " more"), NOW)
    assert env.sample("smg_cache_tree_hits_total", model="m", role="regular") == 4


def test_a_workers_tree_share_is_capped_at_its_engines_kv_capacity() -> None:
    """tree_chars_per_token x the engine's reported KV tokens: the tree forgets what a full engine evicted."""
    env = Env(tree_chars_per_token=1.0)
    workers = [make_worker(2)]
    p = _policy(env, workers)
    env.loads.record(workers[0].id, 0, at=NOW)
    env.loads.record_kv(workers[0].id, 3000)
    reg = PolicyRegistry(env.factory, env.settings)
    reg.default = p  # the registry's upkeep over this instance
    first, second = "first prefix " * 160, "second prefix " * 150  # ~2000 chars each
    p.select(workers, RouteRequest("m", first), NOW)
    p.select(workers, RouteRequest("m", second), NOW)
    for _ in reg.tree_upkeep(periodic=False):
        pass
    ((_, _, size),) = list(p.tree_sizes())
    assert size <= 3000
    assert env.sample("smg_cache_tree_evictions_total", model="m", role="regular") >= 1000
    p.select(workers, RouteRequest("m", first), NOW)  # the least recent one went, as in the engine
    assert env.sample("smg_cache_tree_hits_total", model="m", role="regular") == 0
    # no capacity reported, or the cap turned off: only max_tree_size applies
    assert p.tenant_cap(workers[0].url) == 3000
    assert Env(tree_chars_per_token=0).factory.create("cache_aware", role="regular").tenant_cap(workers[0].url) is None


def test_placement_flags_and_their_environment_variables(monkeypatch) -> None:
    from smg_router.settings import PolicySettings, parse_settings

    d = PolicySettings()
    assert (d.placement_prefix_chars, d.tree_chars_per_token, d.balance_abs_threshold) == (1024, 3.0, 4)
    assert d.placement_choices == 0
    monkeypatch.setenv("SMG_PLACEMENT_PREFIX_CHARS", "256")
    monkeypatch.setenv("SMG_TREE_CHARS_PER_TOKEN", "1")
    monkeypatch.setenv("SMG_PLACEMENT_CHOICES", "1")
    got = parse_settings([]).policy
    assert (got.placement_prefix_chars, got.tree_chars_per_token, got.placement_choices) == (256, 1.0, 1)
    for bad in (
        ["--placement-choices", "-1"],
        ["--placement-prefix-chars", "0"],
        ["--tree-chars-per-token", "-1"],
        ["--tree-chars-per-token", "nan"],
    ):
        with pytest.raises(SystemExit):
            parse_settings(bad)


def test_every_turn_of_a_conversation_is_placed_where_its_first_turn_was() -> None:
    """Placement hashes the head of a chat (up to its first user message), which every later turn repeats:
    a replica that sees turn 5 of a conversation first sends it where another replica sent turn 1."""
    from smg_router.request import parse_request

    system = {"role": "system", "content": "You are a helpful assistant. " * 15}  # ~430 chars, shared by all

    def turn(session: int, n: int) -> RouteRequest:
        messages = [system, {"role": "user", "content": f"session {session}: first question"}]
        for k in range(1, n):
            messages += [{"role": "assistant", "content": "an answer " * 30}, {"role": "user", "content": f"q{k}"}]
        req = parse_request("chat", json.dumps({"messages": messages}).encode())
        return RouteRequest("m", req.text, req.head)

    firsts, lasts = {}, {}
    _, a, wa = _replica(cache_threshold=0.99)  # every request a miss: placement alone decides
    _, b, wb = _replica(cache_threshold=0.99)
    for session in range(30):
        firsts[session] = a.select(wa, turn(session, 1), NOW).url
        lasts[session] = b.select(wb, turn(session, 5), NOW).url
    assert firsts == lasts
    assert len(set(firsts.values())) == 3  # sessions spread although they share the system prompt


def test_one_replica_of_several_places_a_miss_by_rank_alone_as_every_other_replica_does() -> None:
    """Room is judged from this router's tree, which sees only its share of the traffic: a router whose polls
    show it sends under ALONE_SHARE of the fleet's backlog places every miss on the first-ranked worker (what
    every replica computes alike), and judges room again once it sends most of the backlog."""
    from smg_router.policies.cache_aware import ALONE_SHARE
    from smg_router.policies.placement import placement_key, rendezvous_ranked

    env = Env(tree_chars_per_token=1.0)
    workers = [make_worker(i) for i in (2, 3, 4, 5)]
    p = env.factory.create("cache_aware", role="regular")
    p.sync(workers)

    def poll(backlog: int, ours: int) -> None:
        for w in workers:
            env.loads.record(w.id, backlog, at=NOW, inflight=ours)
            env.loads.record_kv(w.id, 1000)

    def group(i: int) -> str:
        return f"document {i:03d} " + "abcdefghij"[i % 10] * 390  # two fit in a 1000-char share, three do not

    ranks = {i: rendezvous_ranked(workers, [True] * 4, placement_key(group(i), 1024), 4) for i in range(400)}
    mine = [i for i, ranked in ranks.items() if ranked[0] == 0]
    for i in mine[:2]:  # the first worker's share is full
        assert p.select(workers, RouteRequest("m", group(i)), NOW) is workers[0]
    for _ in range(20):
        poll(4, 1)  # one of four replicas: a quarter of every worker's backlog is ours
    share = env.loads.own_share()
    assert share is not None and 0.2 < share < 0.3 < ALONE_SHARE
    assert p.select(workers, RouteRequest("m", group(mine[2])), NOW) is workers[0]  # by rank, though full
    for _ in range(30):
        poll(4, 4)  # the other replicas left: all of the backlog is ours
    share = env.loads.own_share()
    assert share is not None and share > ALONE_SHARE
    assert p.select(workers, RouteRequest("m", group(mine[3])), NOW) is workers[ranks[mine[3]][1]]


def test_a_routers_share_of_the_backlog_follows_the_polls_and_forgets_what_left() -> None:
    from smg_router.workers.load import LoadView

    v = LoadView(max_age=5.0)
    assert v.own_share() is None  # no poll yet
    v.record("a", 6, at=NOW, inflight=3)
    v.record("b", 2, at=NOW, inflight=1)
    assert v.own_share() == pytest.approx(0.5)
    v.record("c", 0, at=NOW, inflight=2)  # sent, not yet seen by the engine: counts as backlog
    assert v.own_share() == pytest.approx(6 / 10)
    v.forget("a")
    assert v.own_share() == pytest.approx(3 / 4)
    for _ in range(200):  # a long idle spell: the sums decay below one request's worth
        v.record("b", 0, at=NOW, inflight=0)
        v.record("c", 0, at=NOW, inflight=0)
    assert v.own_share() is None


def test_requests_sent_since_the_poll_count_on_top_of_the_polled_backlog(env: Env) -> None:
    """Optimistic accounting: the snapshot already counts every replica's requests; what this router sent
    since the poll went out comes on top, so a burst spills at the gate instead of piling onto the holder
    until its own in-flight count alone passes the snapshot (the old max(snapshot, in-flight))."""
    workers = [make_worker(i) for i in (2, 3)]
    p = _policy(env, workers)
    text = "hot prefix " * 60
    holder = p.select(workers, RouteRequest("m", text), NOW)
    other = next(w for w in workers if w is not holder)
    env.loads.record(holder.id, 3, at=NOW, inflight=0)  # 3 running, none of them ours
    env.loads.record(other.id, 3, at=NOW, inflight=0)
    got = []
    for _ in range(6):
        w = p.select(workers, RouteRequest("m", text + "?"), NOW)
        w.inflight += 1  # the proxy's guard holds it
        got.append(w)
    assert got[:5] == [holder] * 5  # 3 + 4 = 7: within abs 4 of the other's 3
    assert got[5] is other  # 3 + 5 = 8 is over the gate: spilled
    # requests that finished take their share back out; the poll's own count of ours is not counted twice
    holder.inflight = 0
    env.loads.record(holder.id, 3, at=NOW, inflight=5)
    assert env.loads.effective(holder, NOW) == (3, True)


def _grow(p, workers, groups: list[str], question: str = "") -> dict[str, str]:
    """One request per group (its head: the group's prompt, as a chat's system message), {group: worker url}."""
    placed = {}
    for text in groups:
        placed[text] = p.select(workers, RouteRequest("m", text + question, head=len(text)), NOW).url
    return placed


def test_a_worker_that_joins_a_serving_fleet_takes_up_the_groups_rendezvous_places_on_it(env: Env) -> None:
    """Warm-up: a newcomer holds nothing, so hits would never reach it; while it holds less than the mean
    share, a hit whose rendezvous choice (over the fleet with it) is the newcomer goes there (branch warmup),
    and only those: every other group stays where it is cached."""
    workers = [make_worker(i) for i in (2, 3, 4)]
    p = _policy(env, workers)
    groups = [f"group {i} " + chr(65 + i % 26) * 400 for i in range(80)]
    before = _grow(p, workers, groups)
    newcomer = make_worker(5)
    env.loads.record(newcomer.id, 0, at=NOW)
    fleet = [*workers, newcomer]
    p.sync(fleet)
    _, fresh_replica, fresh_workers = _replica((2, 3, 4, 5))  # where a fleet of four places each group
    home = _grow(fresh_replica, fresh_workers, groups)
    moved = [g for g in groups if home[g] == newcomer.url]
    # fewer than a third: past that the newcomer would hold the mean share before the last of them moved
    assert 3 <= len(moved) < len(groups) // 3, len(moved)
    after = _grow(p, fleet, groups, " next question")
    assert {g for g in groups if after[g] == newcomer.url} == set(moved)
    assert all(after[g] == before[g] for g in groups if g not in moved)
    assert env.sample("smg_routing_decisions_total", model="m", role="regular", branch="warmup") == len(moved)
    # a moved group is now held there too: its next request is a plain hit
    assert {g for g, url in _grow(p, fleet, moved, " third").items() if url == newcomer.url} == set(moved)
    assert env.sample("smg_routing_decisions_total", model="m", role="regular", branch="warmup") == len(moved)


def test_no_warm_up_when_it_is_off_or_for_the_fleet_the_router_started_with() -> None:
    groups = [f"group {i} " + chr(65 + i % 26) * 400 for i in range(40)]
    for settings, late in (({"warmup_seconds": 0}, True), ({}, False)):
        env = Env(**settings)
        workers = [make_worker(i) for i in (2, 3, 4)]
        p = _policy(env, workers if late else [*workers, make_worker(5)])
        fleet = [*workers, make_worker(5)]
        env.loads.record(fleet[3].id, 0, at=NOW)
        if late:
            _grow(p, workers, groups)
            p.sync(fleet)
        else:  # the fourth was there from the start but held nothing (placement never chose it: left out)
            _grow(p, workers, groups)
        before = env.sample("smg_routing_decisions_total", model="m", role="regular", branch="hit")
        _grow(p, fleet, groups, " again")
        assert env.sample("smg_routing_decisions_total", model="m", role="regular", branch="warmup") == 0
        assert env.sample("smg_routing_decisions_total", model="m", role="regular", branch="hit") == before + 40


def test_decisions_name_the_namespace_and_count_the_match_offered_against_the_match_chosen(env: Env) -> None:
    from smg_router.request import cache_namespace

    workers = [make_worker(i) for i in (2, 3)]
    p = _policy(env, workers)
    text = "shared prompt " * 50
    holder = p.select(workers, RouteRequest("m", text), NOW)  # a miss: nothing matched
    p.select(workers, RouteRequest("m", cache_namespace({"cache_salt": "t1"}) + text), NOW)
    assert env.sample("smg_routing_decisions_total", model="m", role="regular", branch="namespace") == 1
    assert env.sample("smg_routing_decisions_total", model="m", role="regular", branch="miss") == 1
    p.select(workers, RouteRequest("m", text + "more"), NOW)  # a hit on the whole text
    offered = env.sample("smg_routing_matched_chars_total", model="m", role="regular", of="fleet")
    chosen = env.sample("smg_routing_matched_chars_total", model="m", role="regular", of="chosen")
    assert offered == chosen == len(text)
    env.loads.record(holder.id, 500, at=NOW)  # the holder is over the gate: the next one spills
    p.select(workers, RouteRequest("m", text + "again"), NOW)
    assert env.sample("smg_routing_matched_chars_total", model="m", role="regular", of="fleet") == 2 * len(text)
    assert env.sample("smg_routing_matched_chars_total", model="m", role="regular", of="chosen") == len(text)


def test_no_warm_up_for_workers_registered_one_by_one_before_any_traffic(env: Env) -> None:
    """The router registers its start-up workers (and the operator its pool) one lifecycle round each: a worker
    that joined before the tree held anything joined no serving fleet, so it does not warm up."""
    workers = [make_worker(i) for i in (2, 3, 4, 5)]
    p = env.factory.create("cache_aware", role="regular")
    for n in range(1, len(workers) + 1):  # one sync per registration, as fleet.register does
        p.sync(workers[:n])
    for w in workers:
        env.loads.record(w.id, 0, at=NOW)
    prompts = [f"group {i} " + chr(65 + i % 26) * 400 for i in range(40)]
    placed = {t: p.select(workers, RouteRequest("m", t), NOW) for t in prompts}  # plain prompts: no head
    # the same prompts with another ending: hits, whose rendezvous choice (of the whole short text) differs
    again = {t: p.select(workers, RouteRequest("m", t + " and another question"), NOW) for t in prompts}
    assert env.sample("smg_routing_decisions_total", model="m", role="regular", branch="warmup") == 0
    assert env.sample("smg_routing_decisions_total", model="m", role="regular", branch="hit") == 40
    assert again == placed


def test_a_slot_engine_is_full_once_each_slot_holds_a_prompt_however_short() -> None:
    """llama.cpp keeps one prompt per slot (``LoadView.slots``, from /props): eight groups on four engines of two
    slots go two to each, whatever the hash says and however few chars they are (the tree's char cap, 8192 a worker,
    would count room for dozens); once every slot is taken, placement is by rank; a worker that leaves takes its
    slots' record with it."""
    from smg_router.policies.placement import placement_key, rendezvous_ranked

    env = Env(tree_chars_per_token=1.0)
    workers = [make_worker(i) for i in (2, 3, 4, 5)]
    p = env.factory.create("cache_aware", role="regular")
    p.sync(workers)
    for w in workers:
        env.loads.record_kv(w.id, 8192, slots=2)

    def group(i: int) -> str:
        return f"doc {i:03d} " + "abcdefghij"[i % 10] * 90  # 98 chars

    ranks = {i: rendezvous_ranked(workers, [True] * 4, placement_key(group(i), 1024), 4) for i in range(400)}
    firsts = [ranks[i][0] for i in range(8)]
    assert max(firsts.count(w) for w in range(4)) >= 3  # the hash alone would put three or more on one worker
    placed = [p.select(workers, RouteRequest("m", group(i)), NOW) for i in range(8)]
    assert sorted(placed.count(w) for w in workers) == [2, 2, 2, 2]
    for i in range(8):  # each group's next request is a hit where it went; nothing moves
        assert p.select(workers, RouteRequest("m", group(i) + " a question"), NOW) is placed[i]
    ninth = p.select(workers, RouteRequest("m", group(8)), NOW)  # every slot taken: by rank
    assert ninth is workers[ranks[8][0]]
    p.sync(workers[1:])
    assert workers[0].url not in p._held


def test_a_router_alone_puts_no_new_prompt_on_a_slot_engine_without_a_free_slot_however_idle() -> None:
    """Alone, a miss goes where its prefill waits least: but on a slot engine whose slots all hold other prompts it
    would evict a whole one (a third group on a two-slot llama.cpp thrashed for the rest of the run), so a slot
    engine with a free slot takes it first, even while it prefills; a worker that is no slot engine keeps the old
    order (the prefills, then room)."""
    from smg_router.policies.placement import placement_key, rendezvous_ranked

    env = Env(tree_chars_per_token=1.0)
    workers = [make_worker(i) for i in (2, 3)]
    p = env.factory.create("cache_aware", role="regular")
    p.sync(workers)
    for w in workers:
        env.loads.record_kv(w.id, 8192, slots=2)

    def group(i: int) -> str:
        return f"doc {i:03d} " + "abcdefghij"[i % 10] * 90

    ranks = {i: rendezvous_ranked(workers, [True] * 2, placement_key(group(i), 1024), 2) for i in range(400)}
    first = [i for i, r in ranks.items() if r[0] == 0]
    for i in first[:2]:
        assert p.select(workers, RouteRequest("m", group(i)), NOW) is workers[0]  # its two slots taken
    assert p.select(workers, RouteRequest("m", group(first[2])), NOW) is workers[1]  # full: the other one
    workers[1].prefilling, workers[1].prefill_chars = 1, 5000  # the other one prefills; the full one is idle
    assert p.select(workers, RouteRequest("m", group(first[3])), NOW) is workers[1]  # still: the free slot


def test_the_prompts_sent_before_a_slot_engine_said_its_slots_count_once_it_has() -> None:
    """llama.cpp's /props is read beside the polls, so the first groups may go out before the router knows the
    engine keeps two prompts: those sent then still take a slot (the benchmark's 0.926 -> 0.81 when they did not:
    a third group onto a worker whose slots held two).  A worker that reported a capacity without slots (SGLang,
    vLLM) is no slot engine: nothing is kept for it."""
    from smg_router.policies.placement import placement_key, rendezvous_ranked

    env = Env(tree_chars_per_token=1.0)
    workers = [make_worker(i) for i in (2, 3, 4, 5)]
    p = env.factory.create("cache_aware", role="regular")
    p.sync(workers)

    def group(i: int) -> str:
        return f"doc {i:03d} " + "abcdefghij"[i % 10] * 90

    ranks = {i: rendezvous_ranked(workers, [True] * 4, placement_key(group(i), 1024), 4) for i in range(400)}
    mine = [i for i, ranked in ranks.items() if ranked[0] == 0]
    assert p.select(workers, RouteRequest("m", group(mine[0])), NOW) is workers[0]  # slots not known yet
    for w in workers:
        env.loads.record_kv(w.id, 8192, slots=2)
    assert p.select(workers, RouteRequest("m", group(mine[1])), NOW) is workers[0]
    third = p.select(workers, RouteRequest("m", group(mine[2])), NOW)
    assert third is workers[ranks[mine[2]][1]], "a third group onto the worker whose two slots are taken"
    sglang = Env(tree_chars_per_token=1.0)  # engines that reported a capacity and no slots: nothing is kept
    q = sglang.factory.create("cache_aware", role="regular")
    q.sync(workers)
    for w in workers:
        sglang.loads.record_kv(w.id, 100_000)
    for i in range(8):
        q.select(workers, RouteRequest("m", group(i)), NOW)
    assert not q._held


def test_a_router_that_sends_the_traffic_places_a_miss_where_it_waits_least_among_the_ranked() -> None:
    """Alone (no share known yet, or most of the backlog), a miss goes to the best-ranked worker at most ALONE_SLACK
    busier than the least loaded of those with room: nobody else has to agree.  One of several replicas keeps the
    first-ranked whatever the loads (within the gate), as every replica computes."""
    from smg_router.policies.cache_aware import ALONE_SHARE, ALONE_SLACK
    from smg_router.policies.placement import placement_key, rendezvous_ranked

    env = Env(balance_abs_threshold=100)  # the gate rules nobody out: only the slack decides
    workers = [make_worker(i) for i in (2, 3, 4, 5)]
    p = env.factory.create("cache_aware", role="regular")
    p.sync(workers)

    def ranks(text: str) -> list[int]:
        return rendezvous_ranked(workers, [True] * 4, placement_key(text, 1024), 4)

    def poll(loads: dict[int, int], ours: int) -> None:
        for i, w in enumerate(workers):
            env.loads.record(w.id, loads.get(i, 0), at=NOW, inflight=min(ours, loads.get(i, 0)))

    one, two, three = "one " * 300, "two " * 300, "three " * 200
    r = ranks(one)
    poll({r[0]: ALONE_SLACK}, ours=100)  # within the slack of the idle ones: rank decides
    assert p.select(workers, RouteRequest("m", one), NOW) is workers[r[0]]
    r = ranks(two)
    poll({r[0]: ALONE_SLACK + 3, r[1]: ALONE_SLACK + 1}, ours=100)
    assert p.select(workers, RouteRequest("m", two), NOW) is workers[r[2]]  # the best-ranked idle one
    for _ in range(30):  # one of four replicas: a quarter of the backlog is ours
        poll({i: 8 for i in range(4)}, ours=2)
    r = ranks(three)
    poll({r[0]: ALONE_SLACK + 3}, ours=0)
    share = env.loads.own_share()
    assert share is not None and share < ALONE_SHARE
    assert p.select(workers, RouteRequest("m", three), NOW) is workers[r[0]]  # by rank, though busier


def test_a_lone_routers_miss_goes_where_its_prefill_waits_least() -> None:
    """Engines prefill before they decode: a prompt sent to a worker still prefilling others waits for them.  A lone
    router's miss goes to the best-ranked worker prefilling nothing it sent, else to the one with the fewest chars
    left to prefill (as many: the one sent to longest ago, the nearer done), whatever they decode."""
    from smg_router.policies.placement import placement_key, rendezvous_ranked

    env = Env(balance_abs_threshold=100)
    workers = [make_worker(i) for i in (2, 3, 4, 5)]
    p = _policy(env, workers)

    def ranked(text: str) -> list[int]:
        return rendezvous_ranked(workers, [True] * 4, placement_key(text, 1024), 4)

    def prefilling(order: list[int], *queued: tuple[int, int, float]) -> None:
        for i, (count, chars, at) in zip(order, queued, strict=True):
            workers[i].prefilling, workers[i].prefill_chars, workers[i].sent_at = count, chars, at

    text = "a new prompt " * 100
    r = ranked(text)
    prefilling(r, (1, 3000, 30.0), (1, 1000, 10.0), (1, 2000, 20.0), (0, 0, 0.0))  # the last-ranked prefills nothing
    d = p.decide(workers, RouteRequest("m", text), NOW)
    assert d.worker is workers[r[3]]
    assert (d.branch, d.prefill, d.matched) == ("miss", len(text), 0)  # a miss: the engine prefills all of it
    text = "another prompt " * 90
    r = ranked(text)  # all prefill; the third-ranked has the most requests but the fewest chars (cached prefixes)
    prefilling(r, (1, 4000, 1.0), (1, 2000, 2.0), (3, 300, 3.0), (2, 3000, 4.0))
    assert p.select(workers, RouteRequest("m", text), NOW) is workers[r[2]]
    text = "yet another " * 100
    r = ranked(text)
    prefilling(r, (1, 1000, 53.0), (1, 1000, 52.0), (1, 1000, 51.0), (1, 1000, 50.0))  # as much: the oldest
    assert p.select(workers, RouteRequest("m", text), NOW) is workers[r[3]]
    text = "and a fourth " * 80
    r = ranked(text)
    prefilling(r, *[(0, 0, 0.0)] * 4)
    assert p.select(workers, RouteRequest("m", text), NOW) is workers[r[0]]  # nobody prefills: rank decides


def test_a_hit_goes_to_the_holder_with_the_least_left_to_prefill_and_says_what_it_will_prefill(env: Env) -> None:
    workers = [make_worker(i) for i in (2, 3, 4)]
    p = _policy(env, workers)
    prefix = "the manual of the machine. " * 60
    for w in workers[:2]:  # two holders (a spill made the second)
        assert p.observe("m", w.url, prefix + "first question", 0)
    env.loads.record(workers[0].id, 1, at=NOW)
    env.loads.record(workers[1].id, 3, at=NOW)  # busier, within the gate
    workers[0].prefilling, workers[0].prefill_chars, workers[0].sent_at = 1, 2500, 5.0
    text = prefix + "second question"
    d = p.decide(workers, RouteRequest("m", text), NOW)
    assert d.worker is workers[1] and d.branch == "hit"  # waits for nothing there
    assert d.prefill is not None and d.prefill <= len(text) - len(prefix)  # only the new question
    assert d.matched == len(text) - d.prefill >= len(prefix)
    workers[0].prefilling = workers[0].prefill_chars = 0
    assert p.select(workers, RouteRequest("m", prefix + "third question"), NOW) is workers[0]  # less loaded


def _one_of_four_replicas(workers_at: tuple[int, ...]) -> tuple[FakePeers, Any, list[Any]]:
    """A cache_aware instance with peers (in sync), a 1000-token KV per worker (1 char a token), sending a quarter of
    the fleet's backlog: one of four replicas."""
    from smg_router.policies.factory import PolicyFactory

    env = Env(tree_chars_per_token=1.0)
    peers = FakePeers()
    factory = PolicyFactory(settings=env.settings, loads=env.loads, metrics=env.metrics, peers=peers, seed=7)
    workers = [make_worker(i) for i in workers_at]
    p = factory.create("cache_aware", role="regular")
    p.sync(workers)
    for _ in range(20):
        for w in workers:
            env.loads.record(w.id, 4, at=NOW, inflight=1)
            env.loads.record_kv(w.id, 1000)
    return peers, p, workers


class FakePeers:
    """The policy's view of its peers (``policies.base.Peers``): in sync or not, and what it was told to tell."""

    def __init__(self) -> None:
        self.synced = True
        self.told: list[tuple[str, str, str, str, int]] = []

    def tell(self, role: str, model: str, worker_url: str, text: str, head: int) -> None:
        self.told.append((role, model, worker_url, text, head))

    def in_sync(self) -> bool:
        return self.synced


def test_a_replica_whose_peers_are_in_sync_judges_room_from_their_routes_too() -> None:
    """One of four replicas (a quarter of the backlog): its peers' routes (``observe``) filled the first worker's
    share, so while the peers are in sync it places a miss on the best-ranked worker with room, as a router alone
    would, and tells its peers where; out of sync, by rank alone again."""
    from smg_router.policies.placement import placement_key, rendezvous_ranked

    peers, p, workers = _one_of_four_replicas((2, 3, 4, 5))

    def group(i: int) -> str:
        return f"document {i:03d} " + "abcdefghij"[i % 10] * 390  # two fit in a 1000-char share, three do not

    ranks = {i: rendezvous_ranked(workers, [True] * 4, placement_key(group(i), 1024), 4) for i in range(400)}
    mine = [i for i, ranked in ranks.items() if ranked[0] == 0]
    for i in mine[:2]:  # the peers sent two groups to the first worker
        assert p.observe("m", workers[0].url, group(i), 0)
    assert not p.observe("m", "http://127.0.0.9:8000", group(mine[0]), 0)  # a worker this router does not serve
    assert not peers.told
    chosen = p.select(workers, RouteRequest("m", group(mine[2])), NOW)
    assert chosen is workers[ranks[mine[2]][1]], "placed on the full first worker"
    assert peers.told == [("regular", "m", chosen.url, group(mine[2]), 0)]
    assert p.select(workers, RouteRequest("m", group(mine[0]) + " next"), NOW) is workers[0]  # a peer's group: a hit
    peers.synced = False
    assert p.select(workers, RouteRequest("m", group(mine[3])), NOW) is workers[0]  # by rank, though full


def test_a_lone_router_spills_where_the_prefill_waits_least_and_replicas_in_sync_by_rank() -> None:
    """A spill is placed as a miss is: alone, away from a worker busy prefilling; in sync with peers, by rank alone
    (every replica spills a hot prefix to the same worker, whatever its own prefills)."""
    from smg_router.policies.factory import PolicyFactory
    from smg_router.policies.placement import placement_key, rendezvous_ranked

    env = Env()
    peers = FakePeers()
    peers.synced = False
    factory = PolicyFactory(settings=env.settings, loads=env.loads, metrics=env.metrics, peers=peers, seed=7)
    workers = [make_worker(i) for i in (2, 3, 4, 5)]
    p = factory.create("cache_aware", role="regular")
    p.sync(workers)
    text = "a hot prompt " * 80
    holder = p.select(workers, RouteRequest("m", text), NOW)
    for w in workers:  # the holder far over the gate, with this router's requests (it sends the traffic)
        load = 500 if w is holder else 0
        env.loads.record(w.id, load, at=NOW, inflight=load)
    ok = [w is not holder for w in workers]
    first, second = rendezvous_ranked(workers, ok, placement_key(text, 1024), 2)
    workers[first].prefilling, workers[first].prefill_chars, workers[first].sent_at = 2, 4000, 1.0
    assert p.select(workers, RouteRequest("m", text + " again"), NOW) is workers[second]  # alone: waits less
    env.loads.record(workers[second].id, 500, at=NOW, inflight=500)  # it holds the prefix now: over the gate too
    peers.synced = True
    assert p.select(workers, RouteRequest("m", text + " and again"), NOW) is workers[first]  # in sync: by rank
    assert env.sample("smg_routing_decisions_total", model="m", role="regular", branch="spill") == 2


def test_a_choice_says_by_which_leading_chars_it_knows_the_prompt_and_whether_its_worker_held_them(env: Env) -> None:
    """``Decision.prefix`` / ``Decision.cold`` (read by ``attempt.Holds``): the leading chars placement hashes (a
    chat's head, at most placement_prefix_chars), and whether the chosen worker held them before this request."""
    workers = [make_worker(i) for i in (2, 3)]
    p = _policy(env, workers)
    doc = "manual: " + "x" * 2000
    d = p.route(workers, RouteRequest("m", doc + " first question"), NOW)
    assert d.prefix == doc[:1024] and d.cold and d.branch == "miss"
    d = p.route(workers, RouteRequest("m", doc + " second question"), NOW)
    assert d.prefix == doc[:1024] and not d.cold and d.branch == "hit"  # a hit on the holder
    chat = "<|system|>be brief\n<|user|>hello\n"
    d = p.route(workers, RouteRequest("m", chat + "<|assistant|>hi\n", head=len(chat)), NOW)
    assert d.prefix == chat and d.cold
    d = p.route(workers, RouteRequest("m", "hi", routing_key="session-1"), NOW)  # pinned: no placement
    assert d.prefix is None and not d.cold and d.branch == "session" and d.prefill is None


def test_requests_on_a_prefix_not_yet_prefilled_count_as_one_for_a_request_that_joins_them(env: Env) -> None:
    """Streamed requests with the same leading chars that have not started their answer on a worker (``Worker.joining``:
    held behind the first prefill of their prefix, or sent together to a worker that holds it) are prefilled together,
    one prefill, not one each: the load gate does not count them against a request on the same prefix, which joins
    them on the holder; a request on another prefix still sees the holder as busy as it is."""
    workers = [make_worker(i) for i in (2, 3, 4)]
    p = _policy(env, workers)
    doc = "manual: " + "x" * 2000
    holder = p.select(workers, RouteRequest("m", doc + " question 0"), NOW)
    holder.inflight = 6  # 6 sent at once, none started: over the gate (abs 4, rel 1.5) against idle workers
    holder.joining[doc[:1024]] = 6
    assert p.select(workers, RouteRequest("m", doc + " question 6"), NOW) is holder
    other = "another manual: " + "y" * 2000
    p.select(workers, RouteRequest("m", other + " question 0"), NOW)
    holder.joining[other[:1024]] = 1  # what joins another prefix is no discount for this one
    holder.joining.pop(doc[:1024])  # they started their answers: they decode there now
    spilled = p.select(workers, RouteRequest("m", doc + " question 7"), NOW)
    assert spilled is not holder  # nothing of this prefix is left to prefill: the gate counts all 6
    assert env.sample("smg_routing_decisions_total", model="m", role="regular", branch="spill") == 1


def test_a_replica_in_sync_puts_a_new_group_where_the_fewest_prompts_of_its_size_are_held() -> None:
    """In sync with its peers, a replica places a miss among the workers with room on the one whose share holds the
    fewest prompts of its size (rank only breaks ties): not a third document onto a worker that holds two while
    another holds none, whatever the hash draw (the routing benchmark's long workload: 4 of 6 documents ranked first on
    one worker)."""
    from smg_router.policies.placement import placement_key, rendezvous_ranked

    peers, p, workers = _one_of_four_replicas((2, 3, 4))

    def doc(i: int) -> str:
        return f"document {i:03d} " + "abcdefghij"[i % 10] * 280  # three fit in a 1000-char share

    ranks = {i: rendezvous_ranked(workers, [True] * 3, placement_key(doc(i), 1024), 3) for i in range(400)}
    first = [i for i, ranked in ranks.items() if ranked[0] == 0]
    assert p.observe("m", workers[0].url, doc(first[0]), 0)
    assert p.observe("m", workers[0].url, doc(first[1]) + "x", 0)  # a char longer than the new one: still one
    assert p.observe("m", workers[1].url, doc(first[2])[:-1], 0)  # a char shorter: one too
    chosen = p.select(workers, RouteRequest("m", doc(first[3])), NOW)
    assert chosen is workers[2], "placed by rank on the worker that holds two, with one that holds none"
    second = next(i for i in first[4:] if ranks[i][1] == 1)  # ranks the worker holding one before the one holding one
    assert p.select(workers, RouteRequest("m", doc(second)), NOW) is workers[1]  # now 2, 1, 1: the ranking decides
    peers.synced = False
    last = next(i for i in first[4:] if i != second)
    assert p.select(workers, RouteRequest("m", doc(last)), NOW) is workers[0]  # out of sync: by rank alone
