"""The cache-aware mechanisms, shown on the cached tokens real ``smg-sim`` engines report (never on
times): router replicas that never talk agree on where a new prefix goes; a cache namespace never matches
another; the tree forgets what the engine evicted."""

from __future__ import annotations

import random
import string
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.procs import MODEL, Router, Sim, http_json, metric_value, start_router, start_sim, wait_until

PREFIX = 1500


def words(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(n))


def complete(router: Router, prompt: str, **extra: object) -> tuple[int, int]:
    """(cached tokens, prompt tokens) of one completion through ``router``, as the engine reports them."""
    status, body = http_json(
        "POST", router.url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1, **extra}
    )
    assert status == 200, body
    usage = body["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]


def served_by(router: Router, prompt: str, **extra: object) -> tuple[str, int]:
    """(worker URL from the router's own count, cached tokens): which worker served it, by the processed delta."""
    before = {w["url"]: w["load"]["processed"] for w in router.workers()}
    cached, _ = complete(router, prompt, **extra)
    after = {w["url"]: w["load"]["processed"] for w in router.workers()}
    (url,) = [u for u in after if after[u] != before.get(u, 0)]
    return url, cached


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[list[Sim]]:
    sims = [start_sim(tmp_path) for _ in range(4)]
    yield sims
    for s in sims:
        s.stop()


def test_replicas_send_a_new_prefix_to_the_same_worker_whatever_each_saw(tmp_path: Path, fleet: list[Sim]) -> None:
    """Router A sees each group's first request in one order, router B its second in the opposite order
    (its tree knows none of them): B sends each to the worker that already holds it, as the engines' cached
    tokens show."""
    urls = [s.url for s in fleet]
    two = ["--router-replicas", "2"]  # as the chart tells its replicas: neither knows what the other sends
    a = start_router(tmp_path, workers=urls, args=two)
    b = start_router(tmp_path, workers=urls, args=two)
    try:
        a.wait_routable(4)
        b.wait_routable(4)
        rng = random.Random(11)
        groups = [f"{uuid.uuid4()} " + words(rng, PREFIX) for _ in range(8)]
        first = [served_by(a, g + " first question") for g in groups]
        assert all(cached < 100 for _, cached in first), first  # nothing cached (but a few chars two uuids share)
        assert len({url for url, _ in first}) >= 2  # spread over the fleet, not one worker
        second = {g: served_by(b, g + " second question") for g in reversed(groups)}
        for g, (url, _) in zip(groups, first, strict=True):
            b_url, cached = second[g]
            assert b_url == url, "replica B placed a group elsewhere than replica A"
            assert cached >= PREFIX, f"the engine served {cached} of the {PREFIX}-char prefix from cache"
        assert metric_value(b.metrics(), "smg_routing_decisions_total", model=MODEL, branch="miss") == len(groups)
    finally:
        a.stop()
        b.stop()


def test_a_cache_namespace_never_matches_another(tmp_path: Path, fleet: list[Sim]) -> None:
    r = start_router(tmp_path, workers=[s.url for s in fleet])
    try:
        r.wait_routable(4)
        prompt = f"{uuid.uuid4()} " + words(random.Random(12), PREFIX)
        for salt in ("tenant-a", "tenant-b", "tenant-c"):
            complete(r, prompt, cache_salt=salt)
        complete(r, prompt, lora_path="adapter-1")
        text = r.metrics()
        assert metric_value(text, "smg_cache_tree_hits_total", model=MODEL) == 0
        assert metric_value(text, "smg_routing_decisions_total", model=MODEL, branch="namespace") == 4
        assert metric_value(text, "smg_routing_decisions_total", model=MODEL, branch="miss") == 0
        complete(r, prompt + " again", cache_salt="tenant-b")  # its own namespace: a hit
        assert metric_value(r.metrics(), "smg_routing_decisions_total", model=MODEL, branch="hit") == 1
    finally:
        r.stop()


def test_the_tree_forgets_what_the_engine_evicted(tmp_path: Path) -> None:
    """One engine with KV for 3000 tokens (1 char each): after a second 2000-char prompt it has evicted the
    first, and so has the router's tree (its share capped at the reported capacity x --tree-chars-per-token),
    so the first prompt again is a miss, as the engine's cached tokens confirm."""
    sim = start_sim(tmp_path, extra=["--kv-capacity", "3000"])
    r = start_router(
        tmp_path, workers=[sim.url], args=["--tree-chars-per-token", "1", "--load-monitor-interval", "0.2"]
    )
    try:
        r.wait_routable(1)
        rng = random.Random(13)
        one, two = (f"{uuid.uuid4()} " + words(rng, 2000) for _ in range(2))
        complete(r, one)
        cached, _ = complete(r, one + " again")
        assert cached >= 2000  # held by the engine, and a hit in the tree
        assert metric_value(r.metrics(), "smg_routing_decisions_total", model=MODEL, branch="hit") == 1
        complete(r, two)

        def tree_size() -> float:
            return metric_value(r.metrics(), "smg_cache_tree_size_chars", model=MODEL, worker=sim.url)

        wait_until(lambda: 0 < tree_size() <= 3000, timeout=15, what="the tree capped at the engine's capacity")
        assert metric_value(r.metrics(), "smg_cache_tree_evictions_total", model=MODEL) >= 1000
        cached, _ = complete(r, one + " once more")
        assert cached < 1000, "the engine still held the first prompt: the test's premise is wrong"
        text = r.metrics()
        assert metric_value(text, "smg_routing_decisions_total", model=MODEL, branch="hit") == 1, "a stale hit"
    finally:
        r.stop()
        sim.stop()
