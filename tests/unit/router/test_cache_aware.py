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
    _, a, wa = _replica(index_complete=False)  # replicas that never talk: each knows only what it sent
    _, b, wb = _replica(index_complete=False)
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


def test_a_new_group_skips_workers_with_no_kv_room_left_whatever_they_hold() -> None:
    """Placement accounts for what each worker's engine can cache: a miss goes to a worker whose index share can take
    the prompt under its KV cap, before one that holds fewer prompts but has no room for this one; where none has
    room, the other criteria decide (here: the fewest prompts held)."""
    from smg_router.policies.placement import placement_key, rendezvous_ranked

    env = Env(tree_chars_per_token=1.0)
    workers = [make_worker(i) for i in (2, 3, 4, 5)]
    p = _policy(env, workers)
    text = "document: " + "d" * 590  # 600 chars
    first = workers[rendezvous_ranked(workers, [True] * 4, placement_key(text[:1024], 1024), 1)[0]]
    others = [w for w in workers if w is not first]
    env.loads.record_kv(first.id, 500)  # the first-ranked holds nothing, but this prompt does not fit its cache
    for n, w in enumerate(others):
        env.loads.record_kv(w.id, 100_000)
        for k in range(n + 1):  # 1, 2 and 3 prompts of this size held: room for more
            assert p.observe("m", w.url, f"held {n}.{k} " + "h" * 590, 0)
    got = p.select(workers, RouteRequest("m", text), NOW)
    assert got is others[0], "room first, then the fewest prompts held"
    assert env.sample("smg_routing_decisions_total", model="m", role="regular", branch="miss") == 1
    assert p.select(workers, RouteRequest("m", text + " a question"), NOW) is got  # a hit where it went
    for w in others:  # nobody has room now
        env.loads.record_kv(w.id, 500)
    third = p.select(workers, RouteRequest("m", "another document: " + "e" * 590), NOW)
    assert third is first  # holds none of them


def test_placement_depends_on_the_leading_chars_only(env: Env) -> None:
    env = Env(placement_prefix_chars=16, cache_threshold=0.99, index_complete=False)  # every request a miss, by rank
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


@pytest.mark.parametrize(
    ("slots", "loads", "within"),
    [
        # engines of 16 slots: a worker is over only once requests wait there (past 16 running) and not elsewhere
        ((16, 16), (15, 0), (True, True)),
        ((16, 16), (16, 0), (True, True)),  # every slot busy, none waiting: the request starts at the next finish
        ((16, 16), (17, 0), (False, True)),
        ((16, 16), (17, 15), (True, True)),  # 17 is not more than 1.5 times 15
        # llama.cpp's 2 slots: both busy is no queue; one waiting is
        ((2, 2), (2, 0), (True, True)),
        ((2, 2), (3, 0), (False, True)),
        ((16, 16), (40, 17), (False, True)),  # both full: it waits less on the other, and 40 > 25.5
        ((16, 16), (24, 17), (True, True)),  # both full, within the relative threshold: not worth a prefill
        # a 256-slot engine is not over at 40 requests, where a 16-slot one is
        ((256, 256), (40, 0), (True, True)),
        ((16, 256), (40, 0), (False, True)),
        # an engine that never reported its slots nor made a request wait has shown no limit
        ((None, 16), (300, 0), (True, True)),
        ((16, None), (30, 0), (False, True)),
        ((None, None), (300, 0), (True, True)),
    ],
)
def test_the_load_gate_is_the_engines_running_slots(
    slots: tuple[int | None, ...], loads: tuple[int, ...], within: tuple[bool, ...]
) -> None:
    """A hit is worth a wait only where the engine would not make the request wait: the gate follows each engine's
    running slots (16 on the simulator, 256 on a vLLM), not a count fitted to one of them."""
    from smg_router.policies.placement import within_gate
    from smg_router.settings import PolicySettings

    assert within_gate(loads, slots, PolicySettings()) == list(within)


@pytest.mark.parametrize(
    ("hi", "lo", "imbalanced"), [(6, 0, True), (5, 0, False), (4, 0, False), (200, 140, False), (300, 100, True)]
)
def test_imbalance_needs_both_conditions(hi: int, lo: int, imbalanced: bool) -> None:
    """Engines of 5 running slots: the holder is over the gate at 6 (one request waiting) against an idle worker,
    never within 1.5 times the least load."""
    env = Env(slots=5)
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
        gate = max(env.loads.default_slots or 0, (env.settings.balance_rel_threshold - 1) * lo)
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


def test_the_request_path_never_evicts_the_next_upkeep_round_caps_each_worker_at_its_engines_kv() -> None:
    """The request path never evicts; the next upkeep round (every 0.5 s) brings a worker past its engine's KV
    capacity back under it, and ``maintain`` (tests, tools) does the same at once."""
    env = Env(tree_chars_per_token=1.0)
    reg = PolicyRegistry(env.factory, env.settings)
    workers = [make_worker(2)]
    reg.sync(workers)
    env.loads.record(workers[0].id, 0, at=NOW)
    env.loads.record_kv(workers[0].id, 1000)
    p = reg.default
    for i in range(30):
        p.select(workers, RouteRequest("m", chr(65 + i) + "p" * 99), NOW)
    ((_, _, size),) = list(p.tree_sizes())
    assert size == 3000  # nothing evicted on the request path
    assert sum(1 for _ in reg.tree_upkeep()) >= 0
    ((_, _, size),) = list(p.tree_sizes())
    assert size <= 1000
    assert env.sample("smg_cache_tree_evictions_total", model="m", role="regular") > 0
    for i in range(30):
        p.select(workers, RouteRequest("m", chr(97 + i) + "q" * 99), NOW)
    p.maintain()
    ((_, _, size),) = list(p.tree_sizes())
    assert size <= 1000


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
    for _ in reg.tree_upkeep():
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
    for _ in reg.tree_upkeep():
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
    for _ in reg.tree_upkeep():
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
    for _ in reg.tree_upkeep():
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
    for _ in reg.tree_upkeep():
        pass
    ((_, _, size),) = list(p.tree_sizes())
    assert size <= 3000
    assert env.sample("smg_cache_tree_evictions_total", model="m", role="regular") >= 1000
    p.select(workers, RouteRequest("m", first), NOW)  # the least recent one went, as in the engine
    assert env.sample("smg_cache_tree_hits_total", model="m", role="regular") == 0
    # no capacity reported, or the cap turned off: the memory budget alone bounds it
    assert p.tenant_cap(workers[0].url) == 3000
    assert Env(tree_chars_per_token=0).factory.create("cache_aware", role="regular").tenant_cap(workers[0].url) is None


def test_placement_flags_and_their_environment_variables(monkeypatch) -> None:
    from smg_router.settings import PolicySettings, parse_settings

    d = PolicySettings()
    assert (d.placement_prefix_chars, d.tree_chars_per_token, d.balance_rel_threshold) == (1024, 3.0, 1.5)
    monkeypatch.setenv("SMG_PLACEMENT_PREFIX_CHARS", "256")
    monkeypatch.setenv("SMG_TREE_CHARS_PER_TOKEN", "1")
    got = parse_settings([]).policy
    assert (got.placement_prefix_chars, got.tree_chars_per_token) == (256, 1.0)
    for bad in (
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
    _, a, wa = _replica(cache_threshold=0.99, index_complete=False)  # every request a miss: placement by rank decides
    _, b, wb = _replica(cache_threshold=0.99, index_complete=False)
    for session in range(30):
        firsts[session] = a.select(wa, turn(session, 1), NOW).url
        lasts[session] = b.select(wb, turn(session, 5), NOW).url
    assert firsts == lasts
    assert len(set(firsts.values())) == 3  # sessions spread although they share the system prompt


def test_requests_sent_since_the_poll_count_on_top_of_the_polled_backlog() -> None:
    """Optimistic accounting: the snapshot already counts every replica's requests; what this router sent
    since the poll went out comes on top, so a burst spills at the gate instead of piling onto the holder
    until its own in-flight count alone passes the snapshot (the old max(snapshot, in-flight))."""
    env = Env(slots=8)
    workers = [make_worker(i) for i in (2, 3)]
    p = _policy(env, workers)
    text = "hot prefix " * 60
    holder = p.select(workers, RouteRequest("m", text), NOW)
    other = next(w for w in workers if w is not holder)
    env.loads.record(holder.id, 3, at=NOW, inflight=0)  # 3 running, none of them ours
    env.loads.record(other.id, 3, at=NOW, inflight=0)
    got = []
    for _ in range(7):
        w = p.select(workers, RouteRequest("m", text + "?"), NOW)
        w.inflight += 1  # the proxy's guard holds it
        got.append(w)
    assert got[:6] == [holder] * 6  # 3 + 5 = 8: every running slot of its 8 busy, none waiting yet
    assert got[6] is other  # 3 + 6 = 9: a request already waits there, not on the other: spilled
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


def group(i: int) -> str:
    """The prompt of document group ``i``: 98 chars, each group's own."""
    return f"doc {i:03d} " + "abcdefghij"[i % 10] * 90


def _slot_fleet(**settings: Any) -> tuple[Env, list[Any], Any]:
    """Two llama.cpp-like engines of 2 slots each (one prompt per slot), one char a token, and a policy over them."""
    env = Env(tree_chars_per_token=1.0, **settings)
    workers = [make_worker(i) for i in (2, 3)]
    p = _policy(env, workers)
    for w in workers:
        env.loads.record_kv(w.id, 8192, slots=2)
    return env, workers, p


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


def test_no_new_prompt_goes_to_a_slot_engine_without_a_free_slot_however_idle() -> None:
    """On a slot engine whose slots all hold other prompts a new one would evict a whole one (a third group on a
    two-slot llama.cpp thrashed for the rest of the run): a miss goes to an engine with a free slot, busier or not,
    while it is within the load gate."""
    from smg_router.policies.placement import placement_key, rendezvous_ranked

    env, workers, p = _slot_fleet()
    ranks = {i: rendezvous_ranked(workers, [True] * 2, placement_key(group(i), 1024), 2) for i in range(400)}
    first = [i for i, r in ranks.items() if r[0] == 0]
    full, free = workers
    for i in first[:2]:
        assert p.observe("m", full.url, group(i), 0)  # both its slots taken
    assert p.observe("m", free.url, group(first[2]), 0)  # one of two
    env.loads.record(free.id, 1, at=NOW)  # busier (one of its two slots runs), within the gate, and prefilling
    free.prefilling = 1
    assert p.select(workers, RouteRequest("m", group(first[3])), NOW) is free
    assert p.select(workers, RouteRequest("m", group(first[4])), NOW) is full  # both full: the fewest prefills
    p.sync(workers[1:])
    assert workers[0].url not in p._held


def test_a_hit_on_a_busy_slot_engine_waits_rather_than_evict_another_groups_slot() -> None:
    """On engines that keep one prompt per slot a spill evicts a whole other group's prompt (its next request is cold
    too): a hit whose holder is over the gate waits there unless some worker within the gate has a free slot.
    llama.cpp's 2-slot engines kept 0.75 of their cached share instead of 0.93 when such spills happened."""
    env, workers, p = _slot_fleet()
    holder, other = workers
    assert p.observe("m", holder.url, group(0), 0)
    assert p.observe("m", holder.url, group(1), 0)
    assert p.observe("m", other.url, group(2), 0)  # one of its two slots free
    env.loads.record(holder.id, 3, at=NOW)  # both slots running, one request waiting: over the gate
    env.loads.record(other.id, 0, at=NOW)
    assert p.select(workers, RouteRequest("m", group(0) + " a question"), NOW) is other  # a free slot: spilled
    assert p.observe("m", other.url, group(3), 0)  # now every slot of the other holds a prompt
    env.loads.record(other.id, 0, at=NOW)
    decision = p.decide(workers, RouteRequest("m", group(1) + " a question"), NOW)
    assert decision.worker is holder and decision.branch == "hit" and decision.fallback is None


def test_a_slot_engine_whose_slots_took_other_prompts_since_no_longer_holds_a_prompt() -> None:
    """A slot engine keeps the prompts of its last requests, one a slot: a group spilled there once is gone once its
    slots took two other groups, though the tree still has its chars.  Sent there, the group's next request would
    prefill it again and evict one of those two, whose next request is cold too (on llama.cpp one spill cost
    eleven more misses so).  The hit goes to the holder whose slots still hold it, busier or not."""
    env, workers, p = _slot_fleet()
    holder, spilled = workers
    assert p.observe("m", holder.url, group(0), 0)
    assert p.observe("m", spilled.url, group(0), 0)  # a spill, once
    assert p.observe("m", spilled.url, group(2), 0)
    assert p.observe("m", spilled.url, group(3), 0)  # its two slots moved on
    env.loads.record(holder.id, 2, at=NOW)  # busier, within the gate
    env.loads.record(spilled.id, 0, at=NOW)
    decision = p.decide(workers, RouteRequest("m", group(0) + " a question"), NOW)
    assert decision.worker is holder and decision.branch == "hit"
    assert p.decide(workers, RouteRequest("m", group(3) + " a question"), NOW).worker is spilled  # still held


def test_a_new_group_on_a_full_fleet_of_slot_engines_evicts_a_copy_not_a_groups_only_prompt() -> None:
    """Every slot of two 2-slot engines is taken, group 0 on both (a spill once).  A new group evicts the least
    recently used slot of the engine it goes to: where that slot holds a copy nothing is lost; elsewhere a group's
    only prompt is, and its next request is cold and evicts another in turn (the cascade that followed one spill on
    llama.cpp).  So the new group goes where the slot it takes holds a copy, whatever the rank says."""
    from smg_router.policies.placement import placement_key, rendezvous_ranked

    env, workers, p = _slot_fleet()
    a, b = workers
    for w, g in ((a, 0), (a, 1), (b, 2), (b, 0)):  # a: 0 then 1 (0 its least recent); b: 2 then 0 (2 its least)
        assert p.observe("m", w.url, group(g), 0)
    for w in workers:
        env.loads.record(w.id, 0, at=NOW)
    ranks_b_first = (
        i for i in range(4, 400) if rendezvous_ranked(workers, [True] * 2, placement_key(group(i), 1024), 1) == [1]
    )
    new = next(ranks_b_first)
    decision = p.decide(workers, RouteRequest("m", group(new) + " a question"), NOW)
    assert decision.worker is a and decision.branch == "miss"  # b ranks first, but its slot to take holds group 2
    assert p.observe("m", a.url, group(new), 0)
    for g, holder in ((0, b), (1, a), (2, b), (new, a)):  # every group still held somewhere
        assert p.decide(workers, RouteRequest("m", group(g) + " again"), NOW).worker is holder


def test_a_prompt_sent_before_an_engine_said_its_slots_is_no_copy_once_its_slots_took_others() -> None:
    """Prompts sent to an engine before it said its slots are kept until it does; once it has, only its last ones
    count, for copies as for room: a group that engine no longer holds is the other engine's only prompt."""
    from smg_router.policies.placement import placement_key, rendezvous_ranked

    env = Env(tree_chars_per_token=1.0)
    workers = [make_worker(i) for i in (2, 3)]
    p = _policy(env, workers)
    a, b = workers
    env.loads.record_kv(a.id, 8192, slots=2)
    for w, g in ((a, 0), (a, 1), (b, 0), (b, 2), (b, 3)):  # b's slots not known yet: all three kept
        assert p.observe("m", w.url, group(g), 0)
    env.loads.record_kv(b.id, 8192, slots=2)  # b holds 2 and 3 only
    ranks_b_first = (
        i for i in range(4, 400) if rendezvous_ranked(workers, [True] * 2, placement_key(group(i), 1024), 1) == [1]
    )
    new = next(ranks_b_first)
    decision = p.decide(workers, RouteRequest("m", group(new) + " a question"), NOW)
    assert decision.worker is b  # no room anywhere (group 0 is a's only prompt): by rank
    assert p.decide(workers, RouteRequest("m", group(0) + " again"), NOW).worker is a


def test_one_of_several_replicas_never_spills_a_hit_to_a_slot_engine() -> None:
    """A replica not told the others' routes sees free slots where the others' prompts are: it cannot tell a free
    slot, so a hit on a busy slot engine waits (at 4 replicas such spills kept 0.35 of llama.cpp's cached share)."""
    env, workers, p = _slot_fleet(index_complete=False)
    holder, other = workers
    prompt = "doc 000 " + "a" * 90
    assert p.observe("m", holder.url, prompt, 0)
    env.loads.record(holder.id, 3, at=NOW)  # over the gate
    env.loads.record(other.id, 0, at=NOW)  # idle, and no prompt this replica sent is in its slots
    decision = p.decide(workers, RouteRequest("m", prompt + " a question"), NOW)
    assert decision.worker is holder and decision.branch == "hit"


def test_the_prompts_sent_before_a_slot_engine_said_its_slots_count_once_it_has() -> None:
    """llama.cpp's /props is read beside the polls, so the first groups may go out before the router knows the
    engine keeps two prompts: those sent then still take a slot (the benchmark's 0.926 -> 0.81 when they did not:
    a third group onto a worker whose slots held two).  A worker that reported a capacity without slots (SGLang,
    vLLM) is no slot engine: nothing is kept for it."""
    from smg_router.policies.placement import placement_key, rendezvous_ranked

    env = Env(tree_chars_per_token=1.0)
    workers = [make_worker(i) for i in (2, 3)]
    p = _policy(env, workers)

    ranks = {i: rendezvous_ranked(workers, [True] * 2, placement_key(group(i), 1024), 2) for i in range(400)}
    mine = [i for i, ranked in ranks.items() if ranked[0] == 0]
    assert p.select(workers, RouteRequest("m", group(mine[0])), NOW) is workers[0]  # slots not known yet
    env.loads.record_kv(workers[0].id, 8192, slots=2)
    env.loads.record_kv(workers[1].id, 8192, slots=3)
    assert p.observe("m", workers[0].url, group(mine[1]), 0)
    for i in mine[2:4]:
        assert p.observe("m", workers[1].url, group(i), 0)  # as many held, a slot free
    got = p.select(workers, RouteRequest("m", group(mine[4])), NOW)
    assert got is workers[1], "a third group onto the worker whose two slots are taken"
    sglang = Env(tree_chars_per_token=1.0)  # engines that reported a capacity and no slots: nothing is kept
    q = sglang.factory.create("cache_aware", role="regular")
    q.sync(workers)
    for w in workers:
        sglang.loads.record_kv(w.id, 100_000)
    for i in range(8):
        q.select(workers, RouteRequest("m", group(i)), NOW)
    assert not q._held


def test_a_hit_goes_to_the_least_loaded_holder_and_says_what_it_will_prefill(env: Env) -> None:
    workers = [make_worker(i) for i in (2, 3, 4)]
    p = _policy(env, workers)
    prefix = "the manual of the machine. " * 60
    for w in workers[:2]:  # two holders (a spill made the second)
        assert p.observe("m", w.url, prefix + "first question", 0)
    env.loads.record(workers[0].id, 3, at=NOW)  # busier, within the gate
    env.loads.record(workers[1].id, 1, at=NOW)
    text = prefix + "second question"
    d = p.decide(workers, RouteRequest("m", text), NOW)
    assert d.worker is workers[1] and d.branch == "hit"
    assert d.prefill is not None and d.prefill <= len(text) - len(prefix)  # only the new question
    assert d.matched == len(text) - d.prefill >= len(prefix)
    env.loads.record(workers[1].id, 5, at=NOW)
    assert p.select(workers, RouteRequest("m", prefix + "third question"), NOW) is workers[0]  # now less loaded


def test_equally_loaded_holders_are_told_apart_by_rank_the_same_on_every_replica() -> None:
    """Of two holders as loaded, the one that ranks first for the prompt's placement key: no order of arrival,
    processed count or other local history decides, so every replica picks the same."""
    from smg_router.policies.placement import placement_key, rendezvous_score

    prefix = "the manual of the machine. " * 60
    chosen = set()
    for order in ((0, 1), (1, 0)):
        _, p, workers = _replica((2, 3, 4))
        for i in order:
            assert p.observe("m", workers[i].url, prefix + "first question", 0)
        workers[order[0]].processed = 50
        got = p.select(workers, RouteRequest("m", prefix + "next"), NOW)
        key = placement_key((prefix + "next")[:1024], 1024)
        assert got is max(workers[:2], key=lambda w: rendezvous_score(key, w.id))
        chosen.add(got.url)
    assert len(chosen) == 1


def test_a_choice_says_by_which_leading_chars_it_knows_the_prompt_and_whether_its_worker_held_them(env: Env) -> None:
    """``Decision.prefix`` / ``Decision.cold`` (read by ``coordination.Holds``): the leading chars placement hashes (a
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
    assert d.prefix == "hi" and d.cold and d.branch == "session" and d.prefill == 2
    d = p.route(workers, RouteRequest("m", "hi there", routing_key="session-1"), NOW)  # the same worker holds "hi"
    assert d.prefix == "hi there" and d.cold and d.matched == 2 and d.prefill == len("hi there") - 2


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


class _ExactIndex:
    """A second kind of cache index (as one fed by an engine's own KV events would be): exact prompts per worker."""

    def __init__(self) -> None:
        self.prompts: dict[str, set[str]] = {}

    def match(self, text: str, tokens: object = None, namespace: str = "") -> Any:
        from smg_router.tree import Match

        best, holders = 0, set()
        for tenant, held in self.prompts.items():
            depth = max((len(p) for p in held if text.startswith(p)), default=0)
            if depth > best:
                best, holders = depth, {tenant}
            elif depth and depth == best:
                holders.add(tenant)
        return Match(best, frozenset(holders))

    def insert(self, text: str, tenant: str, tokens: object = None, namespace: str = "") -> None:
        self.prompts.setdefault(tenant, set()).add(text)

    def tenant_size(self, tenant: str, *, shared: bool = False) -> int:
        return sum(len(p) for p in self.prompts.get(tenant, ()))


def test_a_fleet_may_mix_indexes_and_each_worker_is_matched_in_its_own(env: Env) -> None:
    """The index seam: a worker with an index of its own (``attach_index``) is matched and recorded there, the others
    in the tree; the deepest match over both decides, and a worker that leaves takes its index with it."""
    workers = [make_worker(i) for i in (2, 3, 4)]
    p = _policy(env, workers)
    own = _ExactIndex()
    p.attach_index(workers[0].url, own)
    doc = "the engine's own report: " + "z" * 600
    own.insert(doc, workers[0].url)  # what its engine says it caches, never sent by this router
    assert p.select(workers, RouteRequest("m", doc + " a question"), NOW) is workers[0]
    assert own.prompts[workers[0].url] == {doc, doc + " a question"}  # recorded in its own index
    assert workers[0].url not in p._trees["m"].tenants()
    other = "a prompt of the tree: " + "w" * 600
    placed = p.select(workers, RouteRequest("m", other), NOW)
    again = p.select(workers, RouteRequest("m", other + " more"), NOW)
    assert again is placed and env.sample("smg_cache_tree_hits_total", model="m", role="regular") == 2
    own.insert(other + " more and more", workers[0].url)  # deeper in the worker's own index: it wins
    env.loads.record(placed.id, 0, at=NOW)
    assert p.select(workers, RouteRequest("m", other + " more and more!"), NOW) is workers[0]
    p.sync(workers[1:])
    assert p.select(workers[1:], RouteRequest("m", doc + " a question"), NOW) is not workers[0]


def test_a_new_prompt_goes_where_the_fewest_prefills_are_ahead_of_it_among_those_with_room(env: Env) -> None:
    """Engines prefill before they decode: a miss goes to the worker with room prefilling the fewest requests this
    router sent it (however many it decodes), the first by rank of those; a hit likewise among its holders."""
    from smg_router.policies.placement import placement_key, rendezvous_ranked

    workers = [make_worker(i) for i in (2, 3, 4)]
    p = _policy(env, workers)
    text = "a unique prompt " * 40
    ranked = rendezvous_ranked(workers, [True] * 3, placement_key(text[:1024], 1024), 3)
    first, second = workers[ranked[0]], workers[ranked[1]]
    first.prefilling = 1  # busy prefilling another prompt
    env.loads.record(second.id, 3, at=NOW)  # decoding three, within the gate: no prefill ahead
    assert p.select(workers, RouteRequest("m", text), NOW) is second
    first.prefilling = 0
    for w in workers:
        assert p.observe("m", w.url, text, 0)  # every worker holds the first prompt
    second.prefilling = 2
    for w in workers:
        if w is not second:
            w.prefilling = 1
    busier = next(w for w in workers if w is not second)
    env.loads.record(busier.id, 2, at=NOW)
    calm = next(w for w in workers if w is not second and w is not busier)
    assert p.select(workers, RouteRequest("m", text + " next"), NOW) is calm  # fewest prefills, then least load


def test_a_replica_whose_index_misses_the_others_routes_places_by_rank_alone(monkeypatch) -> None:
    """One of several replicas without peers knows only what it sent: room, prompts held and prefills judged from that
    are judged differently by each replica, so it places a miss on the first-ranked worker within the gate, as every
    other replica does; told the others' routes (peers), or alone, it judges them."""
    from smg_router.policies.placement import placement_key, rendezvous_ranked
    from smg_router.settings import parse_settings

    assert parse_settings([]).policy.index_complete
    assert not parse_settings(["--router-replicas", "3"]).policy.index_complete
    assert parse_settings(["--router-replicas", "3", "--peer", "http://127.0.0.9:1"]).policy.index_complete
    assert parse_settings(["--router-replicas", "3", "--peers-dns", "peers:1"]).policy.index_complete
    monkeypatch.setenv("SMG_ROUTER_REPLICAS", "2")
    assert not parse_settings([]).policy.index_complete
    with pytest.raises(SystemExit):
        parse_settings(["--router-replicas", "0"])
    for complete in (True, False):
        env = Env(tree_chars_per_token=1.0, index_complete=complete)
        workers = [make_worker(i) for i in (2, 3, 4)]
        p = _policy(env, workers)
        text = "a new group " * 40
        first = workers[rendezvous_ranked(workers, [True] * 3, placement_key(text[:1024], 1024), 1)[0]]
        first.prefilling = 2
        got = p.select(workers, RouteRequest("m", text), NOW)
        assert (got is first) is not complete
