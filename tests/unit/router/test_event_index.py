"""Cache-aware routing on what the engines say they cache (``policies.index.EventIndexes``): a prefix an engine
stored is found whoever sent it, and one it evicted stops drawing its requests at once."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import msgspec
import pytest
from smg_router.fleet.kv_feeds import event_namespace
from smg_router.kv_events import Stored, decode_batch
from smg_router.metrics import Metrics
from smg_router.policies.base import Decision
from smg_router.policies.factory import PolicyFactory
from smg_router.policies.index import EventIndexes
from smg_router.request import kv_namespace
from smg_router.settings import PolicySettings
from smg_router.tree.blocks import namespace_of
from smg_router.workers.breaker import CircuitBreaker
from smg_router.workers.worker import Worker, WorkerSpec, WorkerStatus
from support.policy_env import Loads, RouteRequest, make_worker

NOW = 1000.0
B = 16


def fleet(
    tokenized: frozenset[str] = frozenset({"m"}), *, complete: bool = True, clock: Callable[[], float] = lambda: NOW
):
    events = EventIndexes(budget_bytes=10**7, chars_per_token=1.0, tokenized=tokenized, clock=clock)
    factory = PolicyFactory(
        settings=PolicySettings(tree_chars_per_token=1.0, index_complete=complete),
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


def test_where_a_worker_publishes_its_events_is_validated_field_by_field() -> None:
    import pytest
    from smg_router.settings import parse_settings
    from smg_router.workers.worker import SpecError, WorkerSpec

    url = "http://127.0.0.2:8000"
    spec = WorkerSpec.from_json({"url": url, "kv_events": {"endpoint": "tcp://127.0.0.2:5557"}})
    assert spec.kv_events is not None and spec.kv_events.to_json() == {
        "endpoint": "tcp://127.0.0.2:5557",
        "replay_endpoint": None,
        "topic": "",
    }
    bad = [
        ("kv_events", "tcp://127.0.0.2:5557"),
        ("kv_events.endpoint", {"endpoint": "http://127.0.0.2:5557"}),
        ("kv_events.endpoint", {"endpoint": "tcp://127.0.0.2:99999"}),
        ("kv_events.endpoint", {"replay_endpoint": "tcp://127.0.0.2:5558"}),
        ("kv_events.replay_endpoint", {"endpoint": "tcp://h:1", "replay_endpoint": 5558}),
        ("kv_events.topic", {"endpoint": "tcp://h:1", "topic": 3}),
        ("kv_events.port", {"endpoint": "tcp://h:1", "port": 3}),
    ]
    for field, value in bad:
        with pytest.raises(SpecError) as e:
            WorkerSpec.from_json({"url": url, "kv_events": value})
        assert e.value.field == field, (field, value)
    s = parse_settings(["--worker-urls", url, "--kv-events", f"{url}/=tcp://127.0.0.2:5557, tcp://127.0.0.2:5558"])
    assert s.routing.kv_events == ((url, "tcp://127.0.0.2:5557", "tcp://127.0.0.2:5558"),)
    with pytest.raises(SystemExit):
        parse_settings(["--kv-events", f"{url}=127.0.0.2:5557"])


def test_a_burst_on_a_new_prefix_follows_its_first_request_before_the_engine_says_anything() -> None:
    _, policy, workers = fleet()
    doc = "a new document nobody sent yet " * 10
    first = policy.decide(workers[:2], request(doc + "q0"), NOW)
    assert first.branch == "miss"
    for i in range(1, 6):  # the engine is still prefilling: no event yet
        d = policy.decide(workers[:2], request(doc + f"q{i}"), NOW)
        assert (d.worker, d.branch) == (first.worker, "hit")


def test_replicas_place_a_new_prompt_alike_by_what_the_engines_said_whatever_they_sent_themselves() -> None:
    """One of several replicas places by what every replica sees alike: the engines' events (here the second worker
    already holds a group, so a new one goes elsewhere), never its own prefills or guesses."""
    placed = []
    for busy in (0, 1):
        events, policy, workers = fleet(complete=False)
        pair = workers[:2]
        stored(events, pair[1].url, list(("a group the engine holds " * 10).encode()))
        if busy:  # this replica alone sent the first worker a burst that is still prefilling
            pair[0].prefilling = 5
            policy.decide(pair, request("another replica's own burst " * 10), NOW)
        placed.append(policy.decide(pair, request("a new group " * 12), NOW).worker.url)
    assert placed[0] == placed[1] == workers[0].url


def test_a_burst_of_new_prompts_spreads_though_every_replica_sees_one_worker_emptiest() -> None:
    """The engines tell of a prompt once it is prefilled: until then every replica sees the same counts, so the
    fleet's emptiest worker would draw a whole burst.  Each prompt's own two choices spread it, alike on every
    replica, and still favour where fewer prompts are."""
    chosen: list[list[str]] = []
    for _ in range(2):  # two replicas fed the same events
        events = EventIndexes(budget_bytes=10**8, chars_per_token=1.0, tokenized=frozenset({"m"}))
        factory = PolicyFactory(
            settings=PolicySettings(tree_chars_per_token=1.0, index_complete=False),
            loads=Loads(slots=64),
            metrics=Metrics(),
            seed=1,
            events=events,
        )
        workers = [make_worker(i) for i in range(2, 10)]
        for w in workers:
            events.publishes(w.url, "m")
        for w in workers[1:]:  # every worker but the first holds groups already
            stored(events, w.url, list(f"{w.url} holds a group of its own ".encode() * 40))
        policy = factory.create("cache_aware", role="regular")
        policy.sync(workers)
        burst = [request(f"{i:03} a new prompt of a burst, unlike any other " * 3) for i in range(40)]
        chosen.append([policy.decide(workers, r, NOW).worker.url for r in burst])
    assert chosen[0] == chosen[1]  # every replica places each prompt alike
    counts = Counter(chosen[0])
    assert max(counts.values()) <= 20, counts  # not the whole burst on the emptiest worker
    assert counts[workers[0].url] == max(counts.values()), counts  # which still draws the most
    assert len(counts) >= 6, counts


def test_a_worker_whose_events_lost_batches_is_routed_on_the_tree_until_its_engine_cleared() -> None:
    clock = [NOW]
    events, policy, workers = fleet(clock=lambda: clock[0])
    lossy, whole = workers[0], workers[1]
    doc = "what the engine said before its stream lost batches " * 6
    stored(events, lossy.url, list(doc.encode()))
    events.lost(lossy.url)
    policy.sync(workers)  # what the feeds ask when a worker stops being known whole
    assert events.index_of(lossy.url) is None and not events.known_whole(lossy.url)
    assert policy.decide(workers[:2], request(doc + "?"), NOW).matched == 0  # its entry was emptied
    after = "stored after the loss, on the stream as it goes on " * 6
    stored(events, lossy.url, list(after.encode()))
    assert policy.decide(workers[:2], request(after + "?"), NOW).worker is lossy  # its new events are matched

    prompts = [f"prompt {i} of a new group, long enough to be placed " * 4 for i in range(12)]
    first = {p: policy.decide(workers[:2], request(p + "a"), NOW).worker for p in prompts}
    assert {lossy, whole} <= set(first.values())
    clock[0] += 100  # past the speculative entries' life: only what the engines said is left of the events
    later = {p: policy.decide(workers[:2], request(p + "b"), clock[0]) for p in prompts}
    for p, d in later.items():
        # the tree remembers what it sent the lossy worker; the whole one is matched on its engine's word alone
        assert (d.branch == "hit") == (first[p] is lossy), (p, first[p].url, d)

    assert events.emptied(lossy.url)  # its engine cleared its cache: its entry is whole again
    policy.sync(workers)
    assert events.known_whole(lossy.url) and events.index_of(lossy.url) is not None
    sent_lossy = [p for p in prompts if first[p] is lossy]
    assert all(policy.decide(workers[:2], request(p + "c"), clock[0]).branch == "miss" for p in sent_lossy)


def test_a_lossy_worker_is_known_whole_again_once_its_engine_stored_its_kv_capacity_anew() -> None:
    events, _, workers = fleet()
    url = workers[0].url
    events.lost(url)
    assert not events.learned(url, 600, capacity=1000)
    assert events.index_of(url) is None
    assert events.learned(url, 400, capacity=1000)  # every block it held at the loss is gone or stored again
    assert events.known_whole(url) and events.index_of(url) is not None
    assert not events.learned(url, 10**6, capacity=1000)  # a whole worker has nothing to learn

    events.lost(url)
    assert not events.learned(url, 10**9, capacity=None)  # an unknown capacity: only a clear or restart says
    assert not events.known_whole(url)
    assert events.emptied(url) and events.known_whole(url)
    assert not events.emptied(url)  # already whole: nothing changed


def test_blocks_are_matched_in_their_namespace_only_a_lora_adapter_or_a_cache_salt() -> None:
    events, policy, workers = fleet()
    salted, plain = workers[0], workers[1]
    doc = "a document cached under a salt on one engine and plainly on the other " * 4
    ids = list(doc.encode())
    salt = namespace_of(None, "tenant-a")
    blocks = len(ids) // B
    events.blocks("m").stored(
        salted.url,
        hashes=[("s", i) for i in range(blocks)],
        parent=None,
        tokens=ids[: blocks * B],
        block_size=B,
        namespace=salt,
    )
    stored(events, plain.url, ids)

    def ask(namespace: str) -> Decision:
        return policy.decide(workers[:2], RouteRequest("m", doc + "?", tokens=ids, namespace=namespace), NOW)

    assert (ask(salt).worker, ask(salt).branch) == (salted, "hit")
    assert (ask("").worker, ask("").branch) == (plain, "hit")
    assert ask(namespace_of(None, "tenant-b")).matched == 0  # another salt shares nothing
    assert ask(namespace_of("sql-adapter", None)).matched == 0  # nor does a LoRA adapter


@pytest.mark.parametrize(
    ("event", "body"),
    [
        # vLLM: the salt is the first block's extra key; a LoRA adapter by name
        (["BlockStored", [1], None, [5] * B, B, None, "GPU", None, [["s1"]]], {"cache_salt": "s1"}),
        (["BlockStored", [1], None, [5] * B, B, 3, "GPU", "sql", None], {"lora_name": "sql"}),
        (
            ["BlockStored", [1], None, [5] * B, B, 3, "GPU", "sql", [["sql", "s1"]]],
            {"lora_name": "sql", "cache_salt": "s1"},
        ),
        # SGLang: the salt in its trailing metadata (its requests' extra_key); an adapter by its lora_path
        (["BlockStored", [1], None, [5] * B, B, None, "GPU", {"cache_salt": "k"}], {"extra_key": "k"}),
        (
            {
                "type": "BlockStored",
                "block_hashes": [1],
                "parent_block_hash": None,
                "token_ids": [5] * B,
                "block_size": B,
                "lora_name": "a1",
                "cache_salt": "k",
            },
            {"lora_path": "a1", "extra_key": "k"},
        ),
        # none: a base-model block (lora id 0 is none, as some publishers say it)
        (["BlockStored", [1], None, [5] * B, B, 0, "GPU", None], {}),
    ],
)
def test_an_events_namespace_is_the_one_its_request_names(event: object, body: dict[str, str]) -> None:
    (stored_event,) = decode_batch(msgspec.msgpack.encode([1.0, [event], 0])).events
    assert isinstance(stored_event, Stored)
    assert event_namespace(stored_event) == kv_namespace(body)


@pytest.mark.parametrize("complete", [True, False])
def test_an_engine_that_evicted_is_full_though_it_caches_less_than_its_capacity(complete: bool) -> None:
    """A busy engine evicts cached blocks for its running requests, so it caches less than an idle one whose cache is
    full: by the blocks alone it looks like the one with room (and holding fewer prompts), and would draw every new
    prompt.  Once an engine has evicted, its cache is full: the new prompts spread by rank, as on full caches."""
    events = EventIndexes(budget_bytes=10**7, chars_per_token=1.0, tokenized=frozenset({"m"}))
    factory = PolicyFactory(
        settings=PolicySettings(tree_chars_per_token=1.0, index_complete=complete),
        loads=Loads(slots=16),
        metrics=Metrics(),
        seed=1,
        events=events,
    )
    busy, idle = (
        Worker(
            WorkerSpec(url=f"http://127.0.0.{n}:8000", model_id="m", kv_capacity_tokens=40 * B),
            CircuitBreaker(failure_threshold=3, cooldown=10),
        )
        for n in (2, 3)
    )
    for w in (busy, idle):
        w.status = WorkerStatus.READY
        events.publishes(w.url, "m")
    stored(events, idle.url, list(b"an idle engine's cache, full to its capacity " * 15)[: 40 * B])
    stored(events, busy.url, list(b"a busy engine's cache, with room for its runs " * 15)[: 40 * B])
    events.blocks("m").removed(busy.url, [("h", busy.url, i) for i in range(20)])  # evicted for its running requests
    policy = factory.create("cache_aware", role="regular")
    policy.sync([busy, idle])
    prompts = [f"{i:03} a new prompt sharing nothing with any other one " * 4 for i in range(40)]
    counts = Counter(policy.decide([busy, idle], request(p), NOW).worker.url for p in prompts)
    assert min(counts[busy.url], counts[idle.url]) >= 10, counts  # by the blocks alone: all 40 on the busy one
