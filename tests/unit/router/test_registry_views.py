"""The registry's per-request views (workers of a role, of a role and model, models of a role) follow every change
of the fleet: a worker added, removed, or given another role or model through ``respec``."""

from __future__ import annotations

from dataclasses import replace

from smg_router.workers.registry import WorkerRegistry
from support.policy_env import make_worker


def test_the_views_follow_adds_removals_and_new_specs() -> None:
    registry = WorkerRegistry()
    a, b = make_worker(2, model="llama"), make_worker(3, model="qwen")
    registry.add(a)
    assert registry.with_role("regular") == (a,)
    assert registry.serving("regular", "qwen") == ()
    assert registry.models_of("regular") == {"llama"}

    registry.add(b)
    assert registry.with_role("regular") == (a, b)
    assert registry.serving("regular", "qwen") == (b,)
    assert registry.models_of("regular") == {"llama", "qwen"}

    registry.respec(b, replace(b.spec, model_id=None))  # its model forgotten: it may serve any
    assert registry.serving("regular", "llama") == (a, b)
    assert registry.models_of("regular") == {"llama", None}

    registry.respec(a, replace(a.spec, role="decode"))
    assert registry.with_role("regular") == (b,)
    assert registry.with_role("decode") == (a,)
    assert registry.serving("decode", "llama") == (a,)
    assert registry.models_of("decode") == {"llama"}

    registry.discard(b)
    assert registry.with_role("regular") == ()
    assert registry.serving("regular", "llama") == ()
    assert registry.models_of("regular") == frozenset()


def test_a_view_is_built_once_until_the_fleet_changes() -> None:
    registry = WorkerRegistry()
    registry.add(make_worker(2))
    first = registry.serving("regular", "m")
    assert registry.serving("regular", "m") is first
    registry.add(make_worker(3))
    assert registry.serving("regular", "m") is not first and len(registry.serving("regular", "m")) == 2
