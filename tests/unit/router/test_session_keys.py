"""Session keys (``policies.sticky``): one rule before every policy's own choice, with real metrics and loads."""

from __future__ import annotations

import pytest
from smg_router.policies.base import Policy
from smg_router.policy_names import POLICY_NAMES
from support.policy_env import Env, RouteRequest, make_worker

NOW = 1000.0


def _policy(env: Env, name: str, workers) -> Policy:  # type: ignore[no-untyped-def]
    p = env.factory.create(name, role="regular")
    p.sync(workers)
    for w in workers:
        env.loads.record(w.id, 0, at=NOW)
    return p


def _key(key: str, text: str = "some prompt", **kw: object) -> RouteRequest:
    return RouteRequest("m", text, routing_key=key, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_one_key_stays_on_one_worker_and_keys_spread_whatever_the_policy(env: Env, name: str) -> None:
    workers = [make_worker(i) for i in (2, 3, 4, 5)]
    p = _policy(env, name, workers)
    chosen = {p.route(workers, _key("session-1", f"turn {i}"), NOW).worker.url for i in range(100)}
    assert len(chosen) == 1
    homes = {p.route(workers, _key(f"other-{k}"), NOW).worker.url for k in range(20)}
    assert len(homes) >= 3
    assert env.sample("smg_routing_decisions_total", model="m", role="regular", branch="session") == 120


def test_every_policy_instance_and_replica_pins_a_key_to_the_same_worker() -> None:
    """Two routers (separate factories, metrics, loads) and two policies agree: rendezvous of the key."""
    a, b = Env(), Env()
    wa, wb = [make_worker(i) for i in (2, 3, 4, 5)], [make_worker(i) for i in (5, 4, 3, 2)]  # another order too
    pa, pb = _policy(a, "cache_aware", wa), _policy(b, "round_robin", wb)
    for k in range(30):
        assert pa.route(wa, _key(f"k{k}"), NOW).worker.url == pb.route(wb, _key(f"k{k}"), NOW).worker.url


def test_a_key_moves_only_when_its_worker_leaves(env: Env) -> None:
    workers = [make_worker(i) for i in (2, 3, 4, 5)]
    p = _policy(env, "round_robin", workers)
    homes = {k: p.route(workers, _key(k), NOW).worker for k in (f"k{i}" for i in range(40))}
    gone = homes["k0"]
    rest = [w for w in workers if w is not gone]
    for k, home in homes.items():
        moved = p.route(rest, _key(k), NOW).worker
        if home is gone:
            assert moved is not gone
        else:
            assert moved is home, f"{k} moved although its worker stayed"


def test_a_key_leaves_a_worker_over_the_load_gate_and_comes_back(env: Env) -> None:
    workers = [make_worker(i) for i in (2, 3, 4)]
    p = _policy(env, "least_load", workers)
    home = p.route(workers, _key("k"), NOW).worker
    env.loads.record(home.id, 3, at=NOW)  # within the gate (abs 4): the key stays
    assert p.route(workers, _key("k"), NOW).worker is home
    env.loads.record(home.id, 50, at=NOW)  # over it: 50 - 0 > 4 and 50 > 0 * 1.5
    away = p.route(workers, _key("k"), NOW).worker
    assert away is not home
    env.loads.record(home.id, 0, at=NOW)
    assert p.route(workers, _key("k"), NOW).worker is home


def test_a_retry_that_excludes_the_pinned_worker_goes_elsewhere_and_the_next_request_comes_back(env: Env) -> None:
    workers = [make_worker(i) for i in (2, 3, 4)]
    p = _policy(env, "cache_aware", workers)
    home = p.route(workers, _key("k"), NOW).worker
    assert p.route([w for w in workers if w is not home], _key("k"), NOW).worker is not home
    assert p.route(workers, _key("k"), NOW).worker is home


def test_cache_aware_inserts_the_text_for_the_worker_the_key_chose(env: Env) -> None:
    """The tree stays true: the pinned worker holds the prompt, so the same prompt without a key is a hit there."""
    workers = [make_worker(i) for i in (2, 3, 4, 5)]
    p = _policy(env, "cache_aware", workers)
    text = "a long shared system prompt " * 20
    placed = p.select(workers, RouteRequest("m", text + "?"), NOW)  # where the policy itself would put it
    key = next(f"k{i}" for i in range(100) if p.route(workers, _key(f"k{i}", "x"), NOW).worker is not placed)
    pinned = p.route(workers, _key(key, text + "!"), NOW).worker
    assert pinned is not placed
    env.loads.record(placed.id, 0, at=NOW)
    sizes = {url: chars for _, url, chars in p.tree_sizes()}
    assert sizes[pinned.url] >= len(text)
    hits = env.sample("smg_cache_tree_hits_total", model="m", role="regular")
    assert p.select(workers, RouteRequest("m", text + "!"), NOW) is pinned  # it alone holds the deepest match
    assert env.sample("smg_cache_tree_hits_total", model="m", role="regular") == hits + 1


def test_the_worker_holding_the_state_wins_over_the_gate(env: Env) -> None:
    workers = [make_worker(i) for i in (2, 3, 4)]
    p = _policy(env, "random", workers)
    holder = workers[1]
    env.loads.record(holder.id, 500, at=NOW)
    for i in range(10):
        assert p.route(workers, _key(f"resp_{i}", worker_hint=holder.id), NOW).worker is holder
    assert env.sample("smg_routing_decisions_total", model="m", role="regular", branch="stored") == 10
    # not a candidate (left, or tried): rendezvous of the key among the others
    assert p.route(workers[::2], _key("resp_0", worker_hint=holder.id), NOW).worker in workers[::2]


def test_without_a_key_the_policy_chooses(env: Env) -> None:
    workers = [make_worker(i) for i in (2, 3, 4)]
    p = _policy(env, "round_robin", workers)
    assert [p.route(workers, RouteRequest("m", ""), NOW).worker.url for _ in range(3)] == [w.url for w in workers]
    assert env.sample("smg_routing_decisions_total", model="m", role="regular", branch="session") == 0
