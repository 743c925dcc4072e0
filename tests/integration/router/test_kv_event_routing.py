"""A router that reads its workers' KV events routes on what their engines say they cache: a prefix stored by
traffic that never went through it is found, one the engine evicted stops drawing requests at once, and garbage
on the stream is counted while the router keeps serving."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import aiohttp
import msgspec
from support.procs import MODEL, Router, Sim, http_json, metric_value, next_host, start_router, start_sim, wait_until
from support.zmq_publisher import EnginePublisher
from tokenizers import Tokenizer, models, pre_tokenizers

BLOCK = 16


def byte_tokenizer(folder: Path) -> Path:
    """A tokenizer whose ids are the prompt's UTF-8 bytes (ASCII: one id per char), as tokenizer.json."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    table = {c: i for i, c in enumerate(sorted(alphabet, key=lambda c: _byte_of(c)))}
    tok = Tokenizer(models.BPE(vocab=table, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    assert tok.encode("ab c", add_special_tokens=False).ids == list(b"ab c")
    return folder


def _byte_of(c: str) -> int:
    """GPT-2's byte-to-unicode table, inverted: printable bytes are themselves, the others shifted past 255."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if ord(c) in visible:
        return ord(c)
    rest = [b for b in range(256) if b not in visible]
    return rest[ord(c) - 256]


def stored(tokens: list[int], tag: str) -> bytes:
    """A vLLM batch (positional, as engines before the map format sent it) storing the full blocks of ``tokens``."""
    n = len(tokens) // BLOCK
    hashes = [hash((tag, i)) & 0x7FFFFFFFFFFFFFFF for i in range(n)]
    event = ["BlockStored", hashes, None, tokens[: n * BLOCK], BLOCK, None, "GPU", None]
    return msgspec.msgpack.encode([1.0, [event], 0])


def removed(tag: str) -> bytes:
    return msgspec.msgpack.encode([2.0, [["BlockRemoved", [hash((tag, 0)) & 0x7FFFFFFFFFFFFFFF], "GPU"]], 0])


def published_fleet(logs: Path) -> tuple[list[Sim], list[EnginePublisher], Router]:
    """Two sims whose KV events come from test publishers, and a router that reads them with a byte tokenizer."""
    sims = [start_sim(logs) for _ in range(2)]
    engines = [EnginePublisher(), EnginePublisher()]
    tokenizer = byte_tokenizer(logs / "tokenizer")
    args = ["--tokenizer", f"{MODEL}={tokenizer}", "--model-id", MODEL]
    for sim, engine in zip(sims, engines, strict=True):
        args += ["--kv-events", f"{sim.url}={engine.endpoint},{engine.replay_endpoint}"]
    return sims, engines, start_router(logs, workers=[s.url for s in sims], args=args)


async def test_the_router_routes_on_what_the_engines_say_they_cache(logs: Path) -> None:
    sims, engines, router = published_fleet(logs)
    try:
        router.wait_routable(2)
        await asyncio.gather(*(e.subscribed() for e in engines))
        doc = f"{uuid.uuid4()} a document someone else sent to this engine " * 8
        ids = list(doc.encode())
        by_url = {w["url"]: w["id"] for w in router.workers()}
        async with aiohttp.ClientSession() as s:

            async def routed(prompt: str) -> str:
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
                async with s.post(router.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    return resp.headers["x-smg-worker-id"]

            # found: the second engine says it holds the document, which the router never sent anywhere
            await engines[1].publish(stored(ids, "one"))
            await asyncio.to_thread(
                wait_until,
                lambda: metric_value(router.metrics(), "smg_kv_events_total", worker=sims[1].url, kind="stored") >= 1,
                what="the router to apply the stored event",
            )
            blocks = len(ids) // BLOCK
            assert metric_value(router.metrics(), "smg_kv_index_blocks", worker=sims[1].url) == blocks
            for i in range(3):
                assert await routed(doc + f" question {i}?") == by_url[sims[1].url]
            # evicted there, stored on the first: the very next request follows
            await engines[1].publish(removed("one"))
            await engines[0].publish(stored(ids, "zero"))
            await asyncio.to_thread(
                wait_until,
                lambda: (
                    metric_value(router.metrics(), "smg_kv_events_total", worker=sims[0].url, kind="stored") >= 1
                    and metric_value(router.metrics(), "smg_kv_events_total", worker=sims[1].url, kind="removed") >= 1
                ),
                what="the router to apply the removal and the new store",
            )
            assert await routed(doc + " question 4?") == by_url[sims[0].url]
            # garbage on a stream is counted and skipped; routing goes on
            for _ in range(50):
                await engines[0].publish(b"\xc1 not msgpack")
            await asyncio.to_thread(
                wait_until,
                lambda: metric_value(router.metrics(), "smg_kv_events_total", worker=sims[0].url, kind="invalid") >= 50,
                what="the invalid payloads counted",
            )
            assert await routed(doc + " question 5?") in by_url.values()
            events = {w["url"]: w["kv_events"] for w in router.workers()}
            assert events[sims[0].url]["endpoint"] == engines[0].endpoint
    finally:
        router.stop()
        for sim in sims:
            sim.stop()
        for engine in engines:
            await engine.close()


def cleared() -> bytes:
    return msgspec.msgpack.encode([3.0, [["AllBlocksCleared"]], 0])


async def test_a_stream_that_lost_batches_is_replayed_else_routed_on_the_tree_until_its_engine_is_known_again(
    logs: Path,
) -> None:
    sims, engines, router = published_fleet(logs)
    engine, url = engines[0], sims[0].url
    docs = [list(f"{uuid.uuid4()} document {i} of the lossy engine ".encode() * 4) for i in range(6)]
    blocks = [len(ids) // BLOCK for ids in docs]

    def seen(name: str, **labels: str) -> float:
        return metric_value(router.metrics(), name, worker=url, **labels)

    async def applied(stored_events: float, what: str) -> None:
        await asyncio.to_thread(
            wait_until, lambda: seen("smg_kv_events_total", kind="stored") >= stored_events, what=what
        )

    try:
        router.wait_routable(2)
        await asyncio.gather(*(e.subscribed() for e in engines))
        await engine.publish(stored(docs[0], "0"))
        await applied(1, "the first store")
        # a batch lost on the live stream is asked of the replay socket: the index equals the engine's
        await engine.publish(stored(docs[1], "1"), live=False)
        await engine.publish(stored(docs[2], "2"))
        await applied(3, "the lost batch replayed and the next one")
        assert seen("smg_kv_index_blocks") == blocks[0] + blocks[1] + blocks[2]
        assert seen("smg_kv_events_unsynced_total") == 0 and seen("smg_kv_events_synced") == 1
        # one the replay buffer no longer holds: the entry is emptied, the worker routed on the tree
        await engine.publish(stored(docs[3], "3"), live=False)
        engine.forget_before(engine.seq)
        await engine.publish(stored(docs[4], "4"))
        await asyncio.to_thread(
            wait_until, lambda: seen("smg_kv_events_unsynced_total") == 1, what="the loss to be reported"
        )
        assert seen("smg_kv_events_synced") == 0
        assert seen("smg_kv_index_blocks") == blocks[4]  # what it said since the loss, and nothing from before
        # the engine cleared its cache: its entry equals it again, and it is routed on its events
        await engine.publish(cleared())
        await asyncio.to_thread(
            wait_until, lambda: seen("smg_kv_events_synced") == 1, what="the worker known whole again"
        )
        assert seen("smg_kv_index_blocks") == 0
        # a restarted engine counts from 0 with an empty cache: followed from its first batch, nothing lost
        engine.restart()
        await engine.publish(stored(docs[5], "5"))
        await applied(5, "the restarted engine's first store")
        assert seen("smg_kv_index_blocks") == blocks[5]
        assert seen("smg_kv_events_synced") == 1 and seen("smg_kv_events_unsynced_total") == 1
        assert router.log().count("routed on the approximate index") == 1
    finally:
        router.stop()
        for sim in sims:
            sim.stop()
        for e in engines:
            await e.close()


async def test_sims_events_route_what_bypassed_the_router_and_stop_at_an_eviction(logs: Path) -> None:
    """Real publishers: smg-sim engines that cache and evict, and say so in vLLM's format.  A chat sent straight to
    one engine is found by the router through the engine's shipped tokenizer and chat template; once that engine
    evicts it, the request goes to the other engine that holds it."""
    from smg_sim.tokenizer_files import TOKENIZER_DIR

    def events_at(host: str) -> list[str]:
        return ["--kv-events-endpoint", f"tcp://{host}:*", "--kv-events-replay-endpoint", f"tcp://{host}:*"]

    hosts = [next_host(), next_host()]
    sims = [start_sim(logs, host=h, extra=[*events_at(h), "--kv-capacity", "3000"]) for h in hosts]
    # two replicas that never talk (no peers): what each knows of the manual comes from the engines
    router, other = (
        start_router(logs, args=["--tokenizer", f"{MODEL}={TOKENIZER_DIR}", "--router-replicas", "2"], admin_key="k")
        for _ in range(2)
    )
    try:
        for sim in sims:
            info = http_json("GET", sim.url + "/server_info")[1]["kv_events"]
            where = {"endpoint": info["endpoint"], "replay_endpoint": info["replay_endpoint"]}
            for r in (router, other):
                status, body = r.admin("POST", "/workers", {"url": sim.url, "model_id": MODEL, "kv_events": where})
                assert status == 201, body
        router.wait_routable(2)
        other.wait_routable(2)
        by_url = {w["url"]: w["id"] for w in router.workers()}
        doc = f"{uuid.uuid4()} the manual every question of this group shares. " * 12

        def stored_on(sim: Sim) -> float:
            return metric_value(router.metrics(), "smg_kv_events_total", worker=sim.url, kind="stored")

        async with aiohttp.ClientSession() as s:

            async def chat(url: str, question: str) -> str:
                body = {
                    "model": MODEL,
                    "messages": [{"role": "system", "content": doc}, {"role": "user", "content": question}],
                    "max_tokens": 1,
                }
                async with s.post(url + "/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    return resp.headers.get("x-smg-worker-id", "")

            async def straight_to(sim: Sim, question: str) -> None:
                """A request the router never sees, until the router has applied the engine's events of it."""
                before = stored_on(sim)
                await chat(sim.url, question)
                await asyncio.to_thread(
                    wait_until, lambda: stored_on(sim) > before, what=f"the router to hear {sim.url}'s events"
                )

            await straight_to(sims[1], "first?")
            for i in range(3):
                assert await chat(router.url, f"through the router {i}?") == by_url[sims[1].url]
            assert await chat(other.url, "through the other replica?") == by_url[sims[1].url]
            await straight_to(sims[0], "also here?")
            # the second engine fills its cache with other prompts: the manual is evicted there
            removed_before = metric_value(router.metrics(), "smg_kv_events_total", worker=sims[1].url, kind="removed")
            for i in range(4):
                body = {"model": MODEL, "prompt": f"{i} other text " * 90, "max_tokens": 1}
                async with s.post(sims[1].url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
            await asyncio.to_thread(
                wait_until,
                lambda: (
                    metric_value(router.metrics(), "smg_kv_events_total", worker=sims[1].url, kind="removed")
                    > removed_before
                ),
                what="the router to hear the eviction",
            )
            assert await chat(router.url, "after the eviction?") == by_url[sims[0].url]
            # the other replica, told nothing by this one, knows of the eviction from the engine alone
            await asyncio.to_thread(
                wait_until,
                lambda: (
                    metric_value(other.metrics(), "smg_kv_events_total", worker=sims[1].url, kind="removed")
                    > removed_before
                ),
                what="the other replica to hear the eviction",
            )
            assert await chat(other.url, "through the other replica again?") == by_url[sims[0].url]
    finally:
        other.stop()
        router.stop()
        for sim in sims:
            sim.stop()


async def test_a_replica_started_late_learns_the_engines_caches_from_their_replay_buffers_or_from_the_tree(
    logs: Path,
) -> None:
    """A replica that starts after the engines served traffic asks each replay socket for its batches from 0: where
    the buffer still holds them all it knows what the other replica knows, at once; where it holds only the last
    few, the worker is routed on the tree until its engine has stored its KV capacity anew."""
    from smg_sim.tokenizer_files import TOKENIZER_DIR

    def events_at(host: str) -> list[str]:
        return ["--kv-events-endpoint", f"tcp://{host}:*", "--kv-events-replay-endpoint", f"tcp://{host}:*"]

    hosts = [next_host(), next_host()]
    buffers = ["10000", "4"]  # the second engine's replay socket keeps its last 4 batches only
    sims = [
        start_sim(logs, host=h, extra=[*events_at(h), "--kv-capacity", "4000", "--kv-events-buffer-steps", b])
        for h, b in zip(hosts, buffers, strict=True)
    ]
    wheres = []
    for sim in sims:
        info = http_json("GET", sim.url + "/server_info")[1]["kv_events"]
        wheres.append({"endpoint": info["endpoint"], "replay_endpoint": info["replay_endpoint"]})
    tokenizer = ["--tokenizer", f"{MODEL}={TOKENIZER_DIR}", "--router-replicas", "2"]
    first = start_router(logs, args=tokenizer, admin_key="k")
    late: Router | None = None

    def register(router: Router) -> None:
        for sim, where in zip(sims, wheres, strict=True):
            status, body = router.admin("POST", "/workers", {"url": sim.url, "model_id": MODEL, "kv_events": where})
            assert status == 201, body
        router.wait_routable(2)

    def blocks(router: Router, sim: Sim) -> float:
        return metric_value(router.metrics(), "smg_kv_index_blocks", worker=sim.url)

    try:
        register(first)
        async with aiohttp.ClientSession() as s:

            async def complete(url: str, prompt: str) -> None:
                async with s.post(
                    url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}
                ) as r:
                    assert r.status == 200, await r.text()

            for i in range(12):  # ~12 batches on each engine: more than the second one's buffer holds
                for sim in sims:
                    await complete(sim.url, f"{uuid.uuid4()} prompt {i} " * 6)
            await asyncio.to_thread(
                wait_until,
                lambda: all(
                    metric_value(first.metrics(), "smg_kv_events_total", worker=sim.url, kind="stored") >= 12
                    for sim in sims
                ),
                what="the first replica to hear every store",
            )
            started = time.monotonic()
            late = start_router(logs, args=tokenizer, admin_key="k")
            register(late)
            await asyncio.to_thread(
                wait_until,
                lambda: blocks(late, sims[0]) == blocks(first, sims[0]) > 0,
                what="the late replica to know the first engine's cache",
            )
            print(
                f"\nlate replica: {blocks(late, sims[0]):.0f} blocks of the first engine known "
                f"{time.monotonic() - started:.2f} s after it started"
            )
            assert metric_value(late.metrics(), "smg_kv_events_synced", worker=sims[0].url) == 1
            assert metric_value(late.metrics(), "smg_kv_events_total", kind="invalid") == 0  # the replays read whole
            # the second engine's buffer no longer holds its first batches: routed on the tree until it re-learned
            await asyncio.to_thread(
                wait_until,
                lambda: metric_value(late.metrics(), "smg_kv_events_unsynced_total", worker=sims[1].url) == 1,
                what="the late replica to see it missed batches",
            )
            assert metric_value(late.metrics(), "smg_kv_events_synced", worker=sims[1].url) == 0
            assert 0 < blocks(late, sims[1]) < blocks(first, sims[1])
            # the engine stores its KV capacity (4000 tokens, as it reports) anew: the late replica's entry equals
            # its cache again
            await asyncio.to_thread(
                wait_until,
                lambda: metric_value(late.metrics(), "smg_worker_kv_capacity_tokens", worker=sims[1].url) == 4000,
                what="the late replica to poll the engine's KV capacity",
            )
            for i in range(12):
                await complete(sims[1].url, f"{uuid.uuid4()} more of it {i} " * 20)
            await asyncio.to_thread(
                wait_until,
                lambda: metric_value(late.metrics(), "smg_kv_events_synced", worker=sims[1].url) == 1,
                what="the late replica to route the second engine on its events again",
            )
            assert metric_value(first.metrics(), "smg_kv_events_unsynced_total", worker=sims[1].url) == 0
    finally:
        if late is not None:
            late.stop()
        first.stop()
        for sim in sims:
            sim.stop()
