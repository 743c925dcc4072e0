"""Which model key a request routes by: client-chosen names never create trees or series of their own."""

from __future__ import annotations

import pytest
from smg_router.errors import BadRequest, ModelNotFound, NoWorkerAvailable
from smg_router.proxy import Proxy
from smg_router.settings import RetrySettings
from smg_router.upstream import Timeouts, Upstream
from smg_router.workers.registry import WorkerRegistry
from support.policy_env import Env, make_worker


def _proxy(env: Env, *workers) -> Proxy:  # type: ignore[no-untyped-def]
    from smg_router.policies.registry import PolicyRegistry

    registry = WorkerRegistry()
    for w in workers:
        registry.add(w)
    policies = PolicyRegistry(env.factory, env.settings)
    policies.sync(registry)
    return Proxy(
        registry=registry,
        policies=policies,
        upstream=Upstream(Timeouts(connect=1, total=1)),
        metrics=env.metrics,
        retry=RetrySettings(),
    )


def test_a_served_model_routes_by_its_name_and_an_unserved_one_is_404(env: Env) -> None:
    proxy = _proxy(env, make_worker(2, model="llama"), make_worker(3, model="qwen"))
    assert proxy.resolve_model("llama") == "llama"
    with pytest.raises(ModelNotFound, match="mistral"):
        proxy.resolve_model("mistral")
    with pytest.raises(BadRequest, match="llama, qwen"):
        proxy.resolve_model(None)


def test_names_a_worker_of_unknown_model_may_serve_share_one_key(env: Env) -> None:
    unknown = make_worker(2, model=None)  # type: ignore[arg-type]
    proxy = _proxy(env, unknown, make_worker(3, model="llama"))
    assert proxy.resolve_model("llama") == "llama"
    keys = {proxy.resolve_model(f"client-chosen-{i}") for i in range(100)}
    assert keys == {""}
    policy = proxy._attempts._policies.default  # type: ignore[attr-defined]
    assert policy.has_tree("") and policy.has_tree("llama")  # made at registration, not by requests


def test_no_workers_is_503(env: Env) -> None:
    with pytest.raises(NoWorkerAvailable):
        _proxy(env).resolve_model("anything")


def test_a_declared_model_with_no_worker_is_known_and_an_undeclared_one_is_not(env: Env) -> None:
    from smg_router.workers.declarations import Declaration

    proxy = _proxy(env)
    proxy.declarations.declare("org/cold", Declaration(owner="a", role="prefill"))
    assert proxy.resolve_model("org/cold") == "org/cold"
    assert proxy.resolve_model(None) == "org/cold"  # the one model this router knows
    with pytest.raises(ModelNotFound):
        proxy.resolve_model("warm")
    proxy.declarations.declare("org/cold", Declaration(owner="b", role="decode"))
    assert proxy.declarations.withdraw("org/cold", "a")
    assert proxy.resolve_model("org/cold") == "org/cold"  # b still declares it
    assert not proxy.declarations.withdraw("org/cold", "a")
    assert proxy.declarations.withdraw("org/cold", "b")
    with pytest.raises(NoWorkerAvailable) as nothing:  # no worker, no declaration: the router has nothing at all
        proxy.resolve_model("org/cold")
    assert nothing.value.response().headers["Retry-After"] == "5"
