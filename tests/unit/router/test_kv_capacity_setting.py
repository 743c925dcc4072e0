"""A worker's ``kv_capacity_tokens``: validated in its spec, and it caps the worker's tree share in
place of what its engine reports (an operator who sets it knows the engine's usable share)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from smg_router.policies.registry import PolicyRegistry
from smg_router.workers.breaker import CircuitBreaker
from smg_router.workers.worker import SpecError, Worker, WorkerSpec
from support.policy_env import Env, RouteRequest, make_worker

URL = "http://127.0.0.2:8000"
NOW = 1000.0


def test_the_field_is_optional_and_kept() -> None:
    assert WorkerSpec.from_json({"url": URL}).kv_capacity_tokens is None
    assert WorkerSpec.from_json({"url": URL, "kv_capacity_tokens": None}).kv_capacity_tokens is None
    assert WorkerSpec.from_json({"url": URL, "kv_capacity_tokens": 4096}).kv_capacity_tokens == 4096


@pytest.mark.parametrize("bad", [0, -1, 1.5, 4096.0, "4096", True, False, [], {}])
def test_anything_but_a_positive_integer_is_refused_naming_the_field(bad: Any) -> None:
    with pytest.raises(SpecError) as e:
        WorkerSpec.from_json({"url": URL, "kv_capacity_tokens": bad})
    assert e.value.field == "kv_capacity_tokens"


def test_a_patch_changes_or_clears_it_and_keeps_the_rest() -> None:
    base = WorkerSpec.from_json({"url": URL, "model_id": "m", "priority": 7, "kv_capacity_tokens": 4096})
    assert WorkerSpec.from_json({"priority": 8}, base=base).kv_capacity_tokens == 4096
    changed = WorkerSpec.from_json({"kv_capacity_tokens": 1000}, base=base)
    assert (changed.kv_capacity_tokens, changed.priority, changed.model_id) == (1000, 7, "m")
    assert WorkerSpec.from_json({"kv_capacity_tokens": None}, base=base).kv_capacity_tokens is None


def test_the_listing_shows_it_and_registers_the_same_spec_again() -> None:
    spec = WorkerSpec.from_json({"url": URL, "kv_capacity_tokens": 4096})
    shown = Worker(spec, CircuitBreaker(failure_threshold=3, cooldown=1.0)).to_json()
    assert shown["kv_capacity_tokens"] == 4096
    fields = {"url", "role", "model_id", "bootstrap_port", "labels", "priority", "owner", "kv_capacity_tokens"}
    assert WorkerSpec.from_json({k: shown[k] for k in fields}) == spec


def _with_capacity(n: int, tokens: int | None) -> Worker:
    w = make_worker(n)
    w.spec = replace(w.spec, kv_capacity_tokens=tokens)
    return w


def test_tenant_cap_prefers_the_setting_over_the_engine_report_and_follows_a_change() -> None:
    env = Env(tree_chars_per_token=2.0)
    set_, reported, neither = _with_capacity(2, 1000), _with_capacity(3, None), _with_capacity(4, None)
    workers = [set_, reported, neither]
    reg = PolicyRegistry(env.factory, env.settings)
    reg.sync(workers)
    p = reg.default
    for w in workers[:2]:
        env.loads.record(w.id, 0, at=NOW)
        env.loads.record_kv(w.id, 5000)  # the engines report their whole pool
    assert p.tenant_cap(set_.url) == 2000  # the setting wins, times tree_chars_per_token
    assert p.tenant_cap(reported.url) == 10000  # the engine's report, as before
    assert p.tenant_cap(neither.url) is None  # nothing known: no cap, as before
    # the caps follow a new report at once, and a worker forgotten has none
    env.loads.record_kv(reported.id, 5000)
    assert p.tenant_cap(reported.url) == 10000
    env.loads.record_kv(reported.id, 6000)
    assert p.tenant_cap(reported.url) == 12000
    env.loads.record_kv(neither.id, 40)
    assert p.tenant_cap(neither.url) == 80
    env.loads.forget(neither.id)
    assert p.tenant_cap(neither.url) is None
    # a PUT/PATCH changes the spec, and the lifecycle re-syncs the policies: the new value applies
    set_.spec = replace(set_.spec, kv_capacity_tokens=300)
    neither.spec = replace(neither.spec, kv_capacity_tokens=50)
    reg.sync(workers)
    assert (p.tenant_cap(set_.url), p.tenant_cap(neither.url)) == (600, 100)
    set_.spec = replace(set_.spec, kv_capacity_tokens=None)  # cleared: back to the engine's report
    reg.sync(workers)
    assert p.tenant_cap(set_.url) == 10000
    # tree_chars_per_token 0 turns the cap off, the setting's too
    off = Env(tree_chars_per_token=0)
    q = off.factory.create("cache_aware", role="regular")
    q.sync([_with_capacity(2, 1000)])
    assert q.tenant_cap(set_.url) is None


def test_the_upkeep_caps_a_tree_share_at_the_setting() -> None:
    """The engine reports 100k tokens, the setting says 3000: the share is held at 3000 chars."""
    env = Env(tree_chars_per_token=1.0)
    worker = _with_capacity(2, 3000)
    reg = PolicyRegistry(env.factory, env.settings)
    reg.sync([worker])
    env.loads.record(worker.id, 0, at=NOW)
    env.loads.record_kv(worker.id, 100_000)
    p = reg.default
    first, second = "first prefix " * 160, "second prefix " * 150  # ~2000 chars each
    p.select([worker], RouteRequest("m", first), NOW)
    p.select([worker], RouteRequest("m", second), NOW)
    for _ in reg.tree_upkeep():
        pass
    ((_, _, size),) = list(p.tree_sizes())
    assert 0 < size <= 3000
    assert env.sample("smg_cache_tree_evictions_total", model="m", role="regular") >= 1000
