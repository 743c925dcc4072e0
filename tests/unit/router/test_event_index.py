"""Cache-aware routing on what the engines say they cache (``policies.index.EventIndexes``): a prefix an engine
stored is found whoever sent it, and one it evicted stops drawing its requests at once."""

from __future__ import annotations

from smg_router.metrics import Metrics
from smg_router.policies.factory import PolicyFactory
from smg_router.policies.index import EventIndexes
from smg_router.settings import PolicySettings
from support.policy_env import Loads, RouteRequest, make_worker

NOW = 1000.0
B = 16


def fleet(tokenized: frozenset[str] = frozenset({"m"})):
    events = EventIndexes(budget_bytes=10**7, chars_per_token=1.0, tokenized=tokenized)
    factory = PolicyFactory(
        settings=PolicySettings(tree_chars_per_token=1.0),
        loads=Loads(slots=16),
        metrics=Metrics(),
        seed=1,
        events=events,
    )
    workers = [make_worker(i) for i in (2, 3, 4)]
    for w in workers[:2]:
        events.publishes(w.url, "m")  # the third one publishes nothing: the tree's
    policy = factory.create("cache_aware", role="regular")
    policy.sync(workers)
    return events, policy, workers


def stored(events: EventIndexes, worker_url: str, tokens: list[int]) -> None:
    blocks = len(tokens) // B
    events.blocks("m").stored(
        worker_url,
        hashes=[("h", worker_url, i) for i in range(blocks)],
        parent=None,
        tokens=tokens[: blocks * B],
        block_size=B,
    )


def request(text: str) -> RouteRequest:
    return RouteRequest("m", text, tokens=list(text.encode()))


def test_a_prefix_an_engine_stored_is_a_hit_though_the_router_never_sent_it_there() -> None:
    events, policy, workers = fleet()
    doc = "a long shared document " * 20
    owner = workers[1]
    stored(events, owner.url, list(doc.encode()))  # traffic that bypassed the router
    d = policy.decide(workers, request(doc + "question one?"), NOW)
    assert (d.worker, d.branch) == (owner, "hit")
    assert d.matched >= len(doc) - B and d.prefill == len(doc + "question one?") - d.matched


def test_a_prefix_the_engine_evicted_stops_drawing_its_requests_at_once() -> None:
    events, policy, workers = fleet()
    doc = "another document, long enough for blocks " * 10
    owner = workers[0]
    stored(events, owner.url, list(doc.encode()))
    assert policy.decide(workers, request(doc + "q1"), NOW).worker is owner
    events.blocks("m").removed(owner.url, [("h", owner.url, 0)])  # its first block: nothing of the prompt is left
    d = policy.decide(workers, request(doc + "q2"), NOW)
    assert d.branch == "miss" and d.matched == 0


def test_two_replicas_fed_the_same_events_choose_alike_and_a_request_without_tokens_matches_no_event() -> None:
    doc = "the same events on every replica " * 10
    chosen = []
    for _ in range(2):
        events, policy, workers = fleet()
        stored(events, workers[1].url, list(doc.encode()))
        chosen.append(policy.decide(workers, request(doc + "?"), NOW).worker.url)
        no_tokens = policy.decide(workers, RouteRequest("m", doc + "!"), NOW)
        assert no_tokens.branch == "miss"  # the events key tokens: a prompt without them cannot be found there
    assert chosen[0] == chosen[1] == workers[1].url


def test_without_a_tokenizer_for_the_model_its_workers_stay_on_the_tree() -> None:
    events, policy, workers = fleet(tokenized=frozenset())
    doc = "text the router itself sent " * 10
    stored(events, workers[1].url, list(doc.encode()))
    first = policy.decide(workers, request(doc + "a"), NOW)
    assert first.branch == "miss"  # the events are not read: the worker's index is the tree
    again = policy.decide(workers, request(doc + "b"), NOW)
    assert (again.worker, again.branch) == (first.worker, "hit")  # the tree remembers what was sent
