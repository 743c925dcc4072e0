"""The factory, aliases, the simple policies and the policy registry's lifecycle sync."""

from __future__ import annotations

import pytest
from smg_router.policies.registry import PolicyRegistry
from smg_router.policy_names import canonical_name
from support.policy_env import Env, RouteRequest, make_worker

NOW = 50.0


@pytest.mark.parametrize("alias", ["cache_aware", "cacheaware", "cache-aware", "Cache-Aware", "CACHEAWARE"])
def test_aliases_name_cache_aware(alias: str) -> None:
    assert canonical_name(alias) == "cache_aware"


def test_unknown_policy_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        canonical_name("fastest")


@pytest.mark.parametrize("name", ["cache_aware", "cacheaware", "least_load", "power_of_two"])
def test_every_instance_reads_the_shared_load_view(env: Env, name: str) -> None:
    p = env.factory.create(name, role="decode")
    assert p.ctx.loads is env.loads and p.ctx.settings is env.settings and p.ctx.role == "decode"
    workers = [make_worker(2), make_worker(3)]
    p.sync(workers)
    env.loads.record(workers[0].id, 500, at=NOW)
    env.loads.record(workers[1].id, 0, at=NOW)
    assert p.select(workers, RouteRequest("m", "t"), NOW) is workers[1]


@pytest.mark.parametrize("name", ["random", "round_robin", "power_of_two", "least_load", "cache_aware"])
def test_every_policy_answers_a_decision_value_and_keeps_no_result_on_itself(env: Env, name: str) -> None:
    p = env.factory.create(name, role="regular")
    workers = [make_worker(2), make_worker(3)]
    p.sync(workers)
    before = dict(vars(p)) if hasattr(p, "__dict__") else {}
    d = p.route(workers, RouteRequest("m", "a prompt"), NOW)
    assert d.worker in workers
    assert d.branch == ("miss" if name == "cache_aware" else name)
    assert not [a for a in vars(p) if a.startswith("last_")]  # the decision is the answer, not an attribute
    assert set(vars(p)) == set(before)
    pinned = p.route(workers, RouteRequest("m", "a prompt", routing_key="k"), NOW)
    assert pinned.branch == "session"
    # a policy that keeps prompts says how it knows this one (its peers are told, its holds arranged); others do not
    assert (pinned.prefix, pinned.prefill) == (("a prompt", 8) if name == "cache_aware" else (None, None))


def test_round_robin_cycles(env: Env) -> None:
    p = env.factory.create("rr", role="regular")
    workers = [make_worker(i) for i in (2, 3, 4)]
    assert [p.select(workers, RouteRequest("m", ""), NOW).url for _ in range(6)] == [w.url for w in workers] * 2


def test_random_covers_all_workers(env: Env) -> None:
    p = env.factory.create("random", role="regular")
    workers = [make_worker(i) for i in (2, 3, 4)]
    assert {p.select(workers, RouteRequest("m", ""), NOW).url for _ in range(100)} == {w.url for w in workers}


def test_least_load_prefers_fewer_processed_on_ties(env: Env) -> None:
    p = env.factory.create("least_load", role="regular")
    workers = [make_worker(i) for i in (2, 3)]
    workers[0].processed = 3
    assert p.select(workers, RouteRequest("m", ""), NOW) is workers[1]


def test_registry_routes_roles_and_label_policies(env: Env) -> None:
    reg = PolicyRegistry(env.factory, env.settings)
    plain = make_worker(2, model="a")
    labelled = make_worker(3, model="b", labels={"policy": "cache-aware"})
    pre, dec = make_worker(4, role="prefill"), make_worker(5, role="decode")
    reg.default = env.factory.create("round_robin", role="regular")
    reg.sync([plain, labelled, pre, dec])
    assert reg.policy_for("regular", "b").name == "cache_aware"
    assert reg.policy_for("regular", "a") is reg.default
    assert reg.policy_for("prefill", "a") is reg.prefill and reg.prefill.ctx.role == "prefill"
    assert reg.policy_for("decode", None) is reg.decode
    # the label-made instance holds its model's tree, the PD slots theirs
    assert reg.by_model["b"].has_tree("b")
    assert reg.prefill.has_tree("m") and reg.decode.has_tree("m")
    # removing the labelled worker drops the per-model instance
    reg.sync([plain, pre, dec])
    assert "b" not in reg.by_model


def test_registry_sync_cleans_pd_trees_on_removal(env: Env) -> None:
    reg = PolicyRegistry(env.factory, env.settings)
    p1, p2 = make_worker(2, role="prefill"), make_worker(3, role="prefill")
    reg.sync([p1, p2])
    for w in (p1, p2):
        env.loads.record(w.id, 0, at=NOW)
    chosen = reg.prefill.select([p1, p2], RouteRequest("m", "y" * 100), NOW)
    other = p2 if chosen is p1 else p1
    reg.sync([other])
    assert {w for _, w, _ in reg.prefill.tree_sizes()} == set()
    assert reg.prefill.has_tree("m")
    reg.prefill.select([other], RouteRequest("m", "y" * 100), NOW)
    assert {w for _, w, _ in reg.prefill.tree_sizes()} == {other.url}
