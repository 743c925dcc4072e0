"""The router against real engines: its tree hits are real KV-cache hits, and it reads llama.cpp's real load.

Two llama.cpp servers (2 slots each, no host-RAM prompt cache: a server holds exactly the prompts in
its slots) serve a tiny generated model whose tokenizer makes one ASCII character one token, so a
1500-character prefix is 1500 cached tokens.  The engine's own answer proves the hit:
``usage.prompt_tokens_details.cached_tokens`` and ``timings.cache_n`` (tokens reused from the slot) and
``timings.prompt_n`` (tokens it had to compute).
"""

from __future__ import annotations

import json
import random
import string
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from smg_router.policies.placement import placement_key, rendezvous_score
from smg_router.settings import PolicySettings
from support.llamacpp import MODEL_ID, LlamaServer
from support.procs import Router, free_ports, http_json, metric_value, start_router, wait_until
from support.tcp_proxy import CuttableProxy

PREFIX_CHARS = 1500
TIMEOUT = 120.0  # one request on a loaded 2-core machine; normally well under a second


def random_text(n: int, rng: random.Random) -> str:
    """``n`` random ASCII characters (``n`` tokens for the tiny model); two such texts share no prefix."""
    return "".join(rng.choices(string.ascii_letters + string.digits + " ,.", k=n))


@dataclass
class Completion:
    worker_id: str | None
    body: dict[str, Any]
    seconds: float

    @property
    def cached(self) -> int:
        return self.body["usage"]["prompt_tokens_details"]["cached_tokens"]

    @property
    def computed(self) -> int:
        """Prompt tokens the engine had to compute (not taken from its KV cache)."""
        return self.body["timings"]["prompt_n"]


def complete(base_url: str, prompt: str, *, max_tokens: int = 2, **extra: Any) -> Completion:
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    req = urllib.request.Request(
        base_url + "/v1/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    started = time.monotonic()
    with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
        assert resp.status == 200
        answer = json.loads(resp.read())
        worker_id = resp.headers.get("x-smg-worker-id")
    return Completion(worker_id, answer, time.monotonic() - started)


def engine_metrics(engine: LlamaServer) -> str:
    with urllib.request.urlopen(engine.url + "/metrics", timeout=10) as resp:
        return resp.read().decode()


def next_event(stream: Any) -> bytes:
    """The next non-empty line of a server-sent event stream (``b""`` at its end)."""
    while raw := stream.readline():
        if line := raw.strip():
            return line
    return b""


def worker_of(router: Router, engine: LlamaServer) -> dict[str, Any]:
    return next(w for w in router.workers() if w["url"] == engine.url)


def engines_by_id(router: Router, engines: list[LlamaServer]) -> dict[str, LlamaServer]:
    return {worker_of(router, e)["id"]: e for e in engines}


def prefixes_ranked_onto(router: Router, per_worker: int, seed: str) -> dict[str, list[str]]:
    """Worker id -> ``per_worker`` random prefixes whose placement keys (with `` first`` after them) rank that
    worker first by rendezvous hashing: sent alternately, each worker's go to it (fewest held, ties by rank)."""
    ids = [w["id"] for w in router.workers()]
    rng = random.Random(seed)
    by_worker: dict[str, list[str]] = {i: [] for i in ids}
    while min(len(v) for v in by_worker.values()) < per_worker:
        p = random_text(PREFIX_CHARS, rng)
        key = placement_key(p + " first", PolicySettings().placement_prefix_chars)
        top = max(ids, key=lambda i: rendezvous_score(key, i))
        if len(by_worker[top]) < per_worker:
            by_worker[top].append(p)
    return by_worker


def open_stream(base_url: str, prompt: str, max_tokens: int) -> Any:
    """A streamed completion that generates ``max_tokens`` tokens whatever it samples; the open response."""
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(
        base_url + "/v1/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    return urllib.request.urlopen(req, timeout=TIMEOUT)


def test_engines_are_real_llamacpp_with_a_char_tokenizer(engines: list[LlamaServer]) -> None:
    status, body = http_json("POST", engines[0].url + "/tokenize", {"content": "Hello, SMG!"})
    assert status == 200
    assert body["tokens"] == [ord(c) for c in "Hello, SMG!"]
    status, models = http_json("GET", engines[0].url + "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [MODEL_ID]
    assert "llamacpp:requests_processing" in engine_metrics(engines[0])
    assert http_json("GET", engines[0].url + "/v1/loads")[0] != 200  # so the router must read /metrics


def test_shared_prefix_sticks_to_one_engine_and_reuses_its_kv_cache(router: Router, engines: list[LlamaServer]) -> None:
    rng = random.Random("shared-prefix")
    prefix = random_text(PREFIX_CHARS, rng)
    hits_before = metric_value(router.metrics(), "smg_cache_tree_hits_total", model=MODEL_ID)

    answers = [complete(router.url, f"{prefix} Question {i}: and then?") for i in range(4)]

    assert len({a.worker_id for a in answers}) == 1, [a.worker_id for a in answers]
    holder_id = answers[0].worker_id
    holder = next(e for e in engines if worker_of(router, e)["id"] == holder_id)
    other = next(e for e in engines if e is not holder)
    cold, *warm = answers
    assert cold.cached == 0 and cold.computed >= PREFIX_CHARS  # a fresh engine computes the whole prompt
    for a in warm:  # the router's tree hit is the engine's KV-cache hit
        assert a.cached >= PREFIX_CHARS, a.body["usage"]
        assert a.body["timings"]["cache_n"] >= PREFIX_CHARS
        assert a.computed < 30, a.body["timings"]
    warm_text = ", ".join(f"{a.seconds:.3f} s ({a.body['timings']['prompt_ms']:.1f} ms)" for a in warm)
    print(
        f"\ncold prompt: {cold.seconds:.3f} s ({cold.body['timings']['prompt_ms']:.1f} ms in the engine); "
        f"warm: {warm_text}"
    )

    assert metric_value(router.metrics(), "smg_cache_tree_hits_total", model=MODEL_ID) - hits_before >= 3
    assert metric_value(engine_metrics(holder), "llamacpp:prompt_tokens_cached_total") >= 3 * PREFIX_CHARS
    assert metric_value(engine_metrics(other), "llamacpp:prompt_tokens_total") == 0  # never saw a prompt
    assert worker_of(router, holder)["load"]["processed"] == 4
    assert worker_of(router, other)["load"]["processed"] == 0


def test_distinct_prefixes_spread_over_both_engines_and_each_returns_to_its_cache(
    router: Router, engines: list[LlamaServer]
) -> None:
    # New prefixes go where a slot is free and the fewest prompts are held, ties by rendezvous rank of their
    # leading chars over the worker ids: pick 4 whose ranking puts 2 on each engine (its 2 slots), as computed
    # here from the ids alone, sent alternately, and check that the router places them so.
    by_engine = prefixes_ranked_onto(router, 2, "distinct-prefixes")
    prefixes = [p for pair in zip(*by_engine.values(), strict=True) for p in pair]
    expected = {p: i for i, ps in by_engine.items() for p in ps}
    text = router.metrics()
    misses_before = metric_value(text, "smg_cache_tree_misses_total", model=MODEL_ID)
    hits_before = metric_value(text, "smg_cache_tree_hits_total", model=MODEL_ID)

    first = [complete(router.url, p + " first") for p in prefixes]

    assert [a.worker_id for a in first] == [expected[p] for p in prefixes]
    placement = Counter(a.worker_id for a in first)
    assert sorted(placement.values()) == [2, 2], placement  # 2 prefixes per engine: exactly its 2 slots
    assert {w["id"] for w in router.workers()} == set(placement)
    assert all(a.cached == 0 for a in first), [a.cached for a in first]
    assert metric_value(router.metrics(), "smg_cache_tree_misses_total", model=MODEL_ID) - misses_before == 4

    second = [complete(router.url, p + " second") for p in prefixes]

    assert [a.worker_id for a in second] == [a.worker_id for a in first]
    for a in second:  # each engine still holds both of its prefixes in its slots
        assert a.cached >= PREFIX_CHARS, a.body["usage"]
        assert a.computed < 30, a.body["timings"]
    assert metric_value(router.metrics(), "smg_cache_tree_hits_total", model=MODEL_ID) - hits_before == 4
    for e in engines:
        assert metric_value(engine_metrics(e), "llamacpp:prompt_tokens_cached_total") >= 2 * PREFIX_CHARS


def test_load_monitor_reads_llamacpp_metrics_while_a_long_request_runs(
    router: Router, engines: list[LlamaServer]
) -> None:
    busy, idle = engines

    def busy_seen() -> dict[str, Any] | None:
        """The busy worker's entry once the router has polled both: busy at >= 1, idle at 0."""
        gauge = metric_value(router.metrics(), "smg_worker_backend_load", worker=busy.url)
        loads = {w["url"]: w for w in router.workers()}
        b, i = loads[busy.url]["load"], loads[idle.url]["load"]
        # the two polls of a round land one after the other: wait for both, not just the busy one
        return loads[busy.url] if gauge >= 1 and (b["backend"] or 0) >= 1 and i["backend"] == 0 else None

    # A long streamed generation sent straight to one engine (so the router's own in-flight count stays 0),
    # kept running until the router has seen it, then cancelled by closing the stream.
    with open_stream(busy.url, random_text(500, random.Random("long-request")), max_tokens=3000) as stream:
        assert next_event(stream).startswith(b"data: ")  # the engine is generating
        assert metric_value(engine_metrics(busy), "llamacpp:requests_processing") == 1
        seen = wait_until(busy_seen, timeout=30, interval=0.05, what="the router to read both engines' /metrics")
        assert seen["load"]["inflight"] == 0  # the number came from llama.cpp, not from the router
        assert next_event(stream).startswith(b"data: ")  # still generating: the router saw a live request

    # llama.cpp cancels a stream whose client went away; the router sees the engine idle again
    wait_until(
        lambda: worker_of(router, busy)["load"]["backend"] == 0,
        timeout=30,
        what="the busy engine's load back to 0 after the stream closed",
    )
    assert metric_value(engine_metrics(busy), "llamacpp:tokens_predicted_total") < 3000


def test_the_router_reads_each_engines_kv_capacity_from_its_props(router: Router, engines: list[LlamaServer]) -> None:
    """llama.cpp reports no KV capacity in /metrics: the router asks /props (a slot's context times the slots:
    2 x 4096 here), so the tree's cap per worker follows the engine without a kv_capacity_tokens setting."""
    for e in engines:
        props = json.loads(urllib.request.urlopen(e.url + "/props", timeout=TIMEOUT).read())
        assert props["total_slots"] * props["default_generation_settings"]["n_ctx"] == 8192

    def capacities() -> dict[str, float] | None:
        text = router.metrics()
        got = {e.url: metric_value(text, "smg_worker_kv_capacity_tokens", worker=e.url) for e in engines}
        return got if all(got.values()) else None

    assert wait_until(capacities, timeout=30, interval=0.1, what="both capacities") == {e.url: 8192 for e in engines}


@pytest.mark.parametrize("turns", [True, False])
def test_requests_on_one_prompt_take_turns_for_its_slot(logs: Path, engines: list[LlamaServer], turns: bool) -> None:
    """One engine whose two slots hold prompts A and B.  Two requests on A at once: llama.cpp gives the second the
    other idle slot, which prefills A again there and evicts B.  With turns (``coordination.Holds`` on a slot engine)
    the second waits for the first to end and finds A in its slot, and B stays cached; without (the premise,
    ``--prefill-hold-seconds 0``) it does not."""
    engine = engines[0]
    off = [] if turns else ["--prefill-hold-seconds", "0"]
    router = start_router(logs, workers=[engine.url], args=["--policy", "cache_aware", *off])
    try:
        router.wait_routable(1, timeout=30)
        wait_until(
            lambda: metric_value(router.metrics(), "smg_worker_kv_capacity_tokens", worker=engine.url),
            timeout=30,
            interval=0.1,
            what="the engine's slots read from /props",
        )
        rng = random.Random("turns")
        a, b = random_text(PREFIX_CHARS, rng), random_text(PREFIX_CHARS, rng)
        complete(router.url, f"{a} Question 0?")
        complete(router.url, f"{b} Question 0?")  # the slots now hold A and B
        answers: list[Completion] = []
        go = threading.Barrier(2)

        def ask(i: int) -> None:
            go.wait()
            answers.append(complete(router.url, f"{a} Question {i}?", max_tokens=48))

        threads = [threading.Thread(target=ask, args=(i,)) for i in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=TIMEOUT)
        again = complete(router.url, f"{b} Question 1?")
        found = sorted(x.cached for x in answers)
        if turns:
            assert found[0] >= PREFIX_CHARS, found  # both found A in its slot
            assert again.cached >= PREFIX_CHARS, again.body["usage"]  # and B stayed in its own
        else:
            assert found[0] < PREFIX_CHARS or again.cached < PREFIX_CHARS, (found, again.cached)
    finally:
        router.stop()


@pytest.mark.parametrize("claim", [True, False])
def test_two_replicas_requests_on_one_prompt_take_turns_for_its_slot(
    logs: Path, engines: list[LlamaServer], claim: bool
) -> None:
    """As above, the two requests on A at once, but one on each of two router replicas whose link is slow (0.2 s
    each way): neither can be told of the other's turn before both went out.  With claims (``--prefill-claim-seconds``
    wider than the link's delay) the replica with the higher id yields its first turn and goes once the other's
    ended: both find A in its slot and B stays in its own.  Without (the premise) both run at once."""
    engine = engines[0]
    ports = free_ports(2)
    links = [CuttableProxy(("127.0.0.1", port), delay=0.2) for port in reversed(ports)]  # A -> B, B -> A
    window = ["--prefill-claim-seconds", "0.8" if claim else "0"]
    routers = [
        start_router(
            logs,
            workers=[engine.url],
            port=port,
            args=["--policy", "cache_aware", *window, "--peer", f"http://127.0.0.1:{link.port}"],
        )
        for port, link in zip(ports, links, strict=True)
    ]
    try:
        for r in routers:
            r.wait_routable(1, timeout=30)
            wait_until(lambda r=r: metric_value(r.metrics(), "smg_peers_in_sync") == 1, timeout=30, what="in sync")
            wait_until(
                lambda r=r: metric_value(r.metrics(), "smg_worker_kv_capacity_tokens", worker=engine.url),
                timeout=30,
                interval=0.1,
                what="the engine's slots read from /props",
            )
        rng = random.Random("replica turns")
        a, b = random_text(PREFIX_CHARS, rng), random_text(PREFIX_CHARS, rng)
        complete(routers[0].url, f"{a} Question 0?")
        complete(routers[0].url, f"{b} Question 0?")  # the slots now hold A and B
        time.sleep(0.5)  # both turns' ends reached the other replica
        answers: list[Completion] = []
        go = threading.Barrier(2)

        def ask(router: Router, i: int) -> None:
            go.wait()
            answers.append(complete(router.url, f"{a} Question {i}?", max_tokens=48))

        threads = [threading.Thread(target=ask, args=(r, i)) for i, r in enumerate(routers, start=1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=TIMEOUT)
        again = complete(routers[0].url, f"{b} Question 1?")
        found = sorted(x.cached for x in answers)
        texts = [r.metrics() for r in routers]
        yielded = sum(metric_value(t, "smg_prefill_claims_total", outcome="yielded") for t in texts)
        if claim:
            assert found[0] >= PREFIX_CHARS, found  # both found A in its slot
            assert again.cached >= PREFIX_CHARS, again.body["usage"]  # and B stayed in its own
            assert yielded == 1
        else:
            assert found[0] < PREFIX_CHARS or again.cached < PREFIX_CHARS, (found, again.cached)
            assert yielded == 0
    finally:
        for r in routers:
            r.stop()
        for link in links:
            link.close()


def test_a_slot_engines_slots_are_read_at_the_routers_first_load_round(logs: Path, engines: list[LlamaServer]) -> None:
    """The first load round starts at once, while the static workers are still pending their first health check:
    their ``/props`` is asked then (a slot engine's first requests need its slots), not a round later (a minute
    here)."""
    router = start_router(
        logs, workers=[e.url for e in engines], args=["--load-monitor-interval", "60", "--health-check-interval", "60"]
    )
    try:
        router.wait_routable(len(engines), timeout=30)
        text = wait_until(
            lambda: (
                (t := router.metrics())
                and all(metric_value(t, "smg_worker_kv_capacity_tokens", worker=e.url) for e in engines)
                and t
            ),
            timeout=20,
            interval=0.1,
            what="both engines' slots, from the first round",
        )
        assert all(metric_value(text, "smg_worker_kv_capacity_tokens", worker=e.url) == 8192 for e in engines)
    finally:
        router.stop()


def test_a_hit_whose_engine_runs_every_slot_with_none_waiting_waits_for_it_rather_than_prefill_it_elsewhere(
    router: Router, engines: list[LlamaServer]
) -> None:
    """Engine X's two slots hold A and B, engine Y's one slot holds C and its other is free.  Both of X's slots run
    requests (on B and A), none waits.  A request on A waits for X, where its slot frees at the next finish, and
    is served from it.  A gate that counted a worker whose slots are all busy as over it sent it to Y's free slot,
    which computed A again (and on a full fleet evicts a group a later request needs): that cut llama.cpp's
    cached share by half."""
    wait_until(
        lambda: all(metric_value(router.metrics(), "smg_worker_kv_capacity_tokens", worker=e.url) for e in engines),
        timeout=30,
        interval=0.1,
        what="both engines' slots read from /props",
    )
    by_worker = prefixes_ranked_onto(router, 2, "busy slots")
    (x, (a, b)), (y, (c, _)) = by_worker.items()
    first = [complete(router.url, p + " first") for p in (a, c, b)]
    assert [f.worker_id for f in first] == [x, y, x]

    long_b = open_stream(router.url, b + " first, then at length", max_tokens=3000)
    try:
        assert long_b.headers["x-smg-worker-id"] == x
        assert next_event(long_b).startswith(b"data: ")
        with open_stream(router.url, a + " first, then at some length", max_tokens=400) as long_a:
            assert long_a.headers["x-smg-worker-id"] == x
            assert next_event(long_a).startswith(b"data: ")  # X now runs both of its slots
            assert metric_value(engine_metrics(engines_by_id(router, engines)[x]), "llamacpp:requests_processing") == 2

            again = complete(router.url, a + " first, again")

        assert again.worker_id == x
        assert again.cached >= PREFIX_CHARS, again.body["usage"]  # A's slot, freed at its request's end
    finally:
        long_b.close()
    later = complete(router.url, c + " first, later")
    assert later.worker_id == y
    assert later.cached >= PREFIX_CHARS, later.body["usage"]  # Y's slot still holds C
