"""Two router replicas that see the same fleet, loads and index contents choose the same worker for any request.

The cache-aware decision reads only the request and state every replica can share (the fleet, the polled loads,
the cache index): what one replica alone remembers (the order it heard of the prompts, how many requests it
processed, how long ago it started) must never change the choice.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from support.policy_env import Env, RouteRequest, make_worker

NOW = 1000.0
WORDS = ["alpha ", "beta ", "gamma ", "delta ", "system: be brief. ", "doc: " + "x" * 300, "q? "]

texts = st.lists(st.sampled_from(WORDS), min_size=1, max_size=8).map("".join)
BASES = ["system: be brief. doc: " + "x" * 300, "alpha beta gamma " * 20, "doc: " + "y" * 200]
prompts = st.one_of(texts, st.tuples(st.sampled_from(BASES), texts).map("".join))
"""Half the prompts extend one of the few texts the workers hold: hits, often on several holders."""


@st.composite
def fleets(draw: st.DrawFn) -> dict[str, object]:
    size = draw(st.integers(1, 6))
    hosts = draw(st.lists(st.integers(2, 250), min_size=size, max_size=size, unique=True))
    return {
        "hosts": hosts,
        "loads": draw(st.lists(st.one_of(st.integers(0, 3), st.integers(0, 40)), min_size=size, max_size=size)),
        "kv": draw(st.one_of(st.none(), st.integers(200, 5000))),
        "held": draw(
            st.lists(st.tuples(st.integers(0, size - 1), st.one_of(texts, st.sampled_from(BASES))), max_size=12)
        ),
        "slots": draw(st.lists(st.one_of(st.none(), st.integers(1, 16)), min_size=size, max_size=size)),
    }


def _replica(fleet: dict[str, object], order: list[int], processed: int) -> tuple[object, list[object]]:
    """One replica: its own policy, load view and Worker objects; the index filled in ``order``, and local history
    (processed counts) of its own."""
    env = Env(slots=None, tree_chars_per_token=1.0)
    hosts: list[int] = fleet["hosts"]  # type: ignore[assignment]
    workers = [make_worker(h) for h in hosts]
    policy = env.factory.create("cache_aware", role="regular")
    policy.sync(workers)
    loads: list[int] = fleet["loads"]  # type: ignore[assignment]
    for n, (w, load) in enumerate(zip(workers, loads, strict=True)):
        w.processed = processed * (len(workers) - n)  # one replica's own history: the later workers served less
        env.loads.record(w.id, load, at=NOW)
        if fleet["kv"] is not None:
            env.loads.record_kv(w.id, fleet["kv"])  # type: ignore[arg-type]
        slots = fleet["slots"][n]  # type: ignore[index]
        if slots is not None:  # an engine that reported its running slots, or showed them
            env.loads.record_running_slots(w.id, slots)
    held: list[tuple[int, str]] = fleet["held"]  # type: ignore[assignment]
    for k in order:
        i, text = held[k]
        assert policy.observe("m", workers[i].url, text, 0)  # type: ignore[attr-defined]
    return policy, workers


@settings(max_examples=300, deadline=None)
@given(fleet=fleets(), prompt=prompts, head=st.integers(0, 40), seed=st.randoms(use_true_random=False))
def test_two_replicas_with_the_same_state_choose_the_same_worker(
    fleet: dict[str, object], prompt: str, head: int, seed: object
) -> None:
    held: list[object] = fleet["held"]  # type: ignore[assignment]
    order = list(range(len(held)))
    shuffled = order[:]
    seed.shuffle(shuffled)  # type: ignore[attr-defined]
    a, wa = _replica(fleet, order, processed=0)
    b, wb = _replica(fleet, shuffled, processed=7)
    req = RouteRequest("m", prompt, head=min(head, len(prompt)))
    da = a.decide(wa, req, NOW)  # type: ignore[attr-defined]
    db = b.decide(wb, req, NOW)  # type: ignore[attr-defined]
    assert da.worker.url == db.worker.url
    assert (da.branch, da.matched, da.fallback) == (db.branch, db.matched, db.fallback)
