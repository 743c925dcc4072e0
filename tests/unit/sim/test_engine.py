"""Unit tests of the simulated engine: prefix caching, batching limits, cancellation and PD decode.

They run on virtual time (see conftest.py): ``loop.time()`` is the engine's model time, so durations
are asserted exactly and no test races the wall clock.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from smg_sim.config import SimConfig
from smg_sim.engine import Engine, EngineRequest, StepOutput
from smg_sim.tokens import encode
from support.procs import wait_until_async


@contextlib.asynccontextmanager
async def running_engine(**overrides: object) -> AsyncIterator[Engine]:
    config = SimConfig(**{"decode_step_ms": 1.0, "decode_step_ms_per_req": 0.0, **overrides})
    engine = Engine(config)
    engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


async def run_to_end(engine: Engine, req: EngineRequest) -> tuple[str, StepOutput, float]:
    """Full text, final output and time to the first output."""
    clock = asyncio.get_running_loop()
    started = clock.time()
    first: float | None = None
    text = []
    async with engine.request(req) as handle:
        async for out in handle:
            if first is None:
                first = clock.time() - started
            text.append(out.text)
            if out.finish is not None:
                assert first is not None
                return "".join(text), out, first
    raise AssertionError("stream ended without a finish")


async def test_generates_max_new_tokens_characters_deterministically() -> None:
    async with running_engine(time_scale=0.0) as engine:
        text1, out1, _ = await run_to_end(engine, EngineRequest(encode("same prompt"), 12))
        text2, _, _ = await run_to_end(engine, EngineRequest(encode("same prompt"), 12))
    assert len(text1) == 12 and out1.completion_tokens == 12
    assert text1 == text2
    assert out1.finish is not None and out1.finish.type == "length"
    assert out1.prompt_tokens == len("same prompt")


async def test_cached_prefix_reduces_prefill_time() -> None:
    prompt = encode("x" * 10 + "shared system prompt " * 100)  # 2110 tokens
    async with running_engine(prefill_tps=10_000.0) as engine:  # 2110 uncached tokens: 0.211 s
        _, cold, cold_ttft = await run_to_end(engine, EngineRequest(prompt, 2))
        _, warm, warm_ttft = await run_to_end(engine, EngineRequest(prompt, 2))
        half = prompt[:1000] + encode("n" * 1000)
        _, partial, partial_ttft = await run_to_end(engine, EngineRequest(half, 2))
        stats = engine.stats()
    assert cold.cached_tokens == 0
    assert warm.cached_tokens == len(prompt) - 1  # the last token is always computed
    assert partial.cached_tokens == 1000
    # The first token comes with the end of prefill: uncached tokens / prefill_tps.
    assert cold_ttft == pytest.approx(2110 / 10_000)
    assert warm_ttft == pytest.approx(1 / 10_000)
    assert partial_ttft == pytest.approx(1000 / 10_000)  # half the prompt was cached
    assert stats.cached_tokens_total == warm.cached_tokens + partial.cached_tokens
    assert stats.prompt_tokens_total == 2 * len(prompt) + 2000
    assert 0 < stats.cache_hit_rate < 1


async def test_max_running_bounds_batch_and_queues_the_rest() -> None:
    async with running_engine(max_running=2, decode_step_ms=5.0) as engine:
        tasks = [asyncio.create_task(run_to_end(engine, EngineRequest(encode(f"prompt {i}"), 20))) for i in range(5)]
        await wait_until_async(lambda: engine.stats().num_running_reqs == 2, what="2 running")
        stats = engine.stats()
        assert stats.num_waiting_reqs == 3
        assert stats.num_used_tokens > 0
        assert stats.utilization == 1.0
        results = await asyncio.gather(*tasks)
        assert all(out.completion_tokens == 20 for _, out, _ in results)
        stats = engine.stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.num_used_tokens) == (0, 0, 0)
    assert stats.requests_total == 5
    assert stats.generation_tokens_total == 100


async def test_cancelling_a_consumer_releases_its_slot() -> None:
    async with running_engine(max_running=1, decode_step_ms=2.0) as engine:
        long_task = asyncio.create_task(run_to_end(engine, EngineRequest(encode("long"), 100_000)))
        await wait_until_async(lambda: engine.stats().num_running_reqs == 1, what="1 running")
        short_task = asyncio.create_task(run_to_end(engine, EngineRequest(encode("short"), 3)))
        await wait_until_async(lambda: engine.stats().num_waiting_reqs == 1, what="1 waiting")
        long_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await long_task
        _, out, _ = await asyncio.wait_for(short_task, 2.0)
        assert out.completion_tokens == 3
        assert engine.stats().num_running_reqs == 0


async def test_waiting_request_can_leave_the_queue() -> None:
    async with running_engine(max_running=1, decode_step_ms=2.0) as engine:
        blocker = asyncio.create_task(run_to_end(engine, EngineRequest(encode("blocker"), 100_000)))
        await wait_until_async(lambda: engine.stats().num_running_reqs == 1, what="1 running")
        waiter = asyncio.create_task(run_to_end(engine, EngineRequest(encode("waiter"), 5)))
        await wait_until_async(lambda: engine.stats().num_waiting_reqs == 1, what="1 waiting")
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert engine.stats().num_waiting_reqs == 0
        blocker.cancel()
        await asyncio.gather(blocker, return_exceptions=True)
        await wait_until_async(lambda: engine.stats().num_running_reqs == 0, what="0 running")


async def test_kv_memory_limits_admission() -> None:
    # Each request needs 40 prompt + 20 new = 60 of 100 tokens: only one fits at a time.
    async with running_engine(kv_capacity=100, max_running=8, decode_step_ms=2.0) as engine:
        tasks = [asyncio.create_task(run_to_end(engine, EngineRequest(encode(f"{i}" * 40), 20))) for i in range(3)]
        await wait_until_async(lambda: engine.stats().num_running_reqs == 1, what="1 running")
        assert engine.stats().num_waiting_reqs == 2
        await asyncio.gather(*tasks)


async def test_requests_sharing_a_cached_prefix_share_its_kv() -> None:
    """The cached prefix is pinned once for every request that uses it: two requests sharing 40 cached tokens
    (1 new + 20 output each) run together in 100 tokens, where two distinct ones wait for each other."""
    async with running_engine(kv_capacity=100, max_running=8, decode_step_ms=2.0) as engine:
        await run_to_end(engine, EngineRequest(encode("p" * 40), 1))
        tasks = [asyncio.create_task(run_to_end(engine, EngineRequest(encode("p" * 40 + c), 20))) for c in "ab"]
        await wait_until_async(lambda: engine.stats().num_running_reqs == 2, what="2 running")
        assert engine.cache.locked <= 42  # the shared 40 once, and each prompt's last token once prefilled
        (_, out_a, _), (_, out_b, _) = await asyncio.gather(*tasks)
    assert out_a.cached_tokens == out_b.cached_tokens == 40
    assert engine.cache.locked == 0


@pytest.mark.parametrize(("cache_on", "follower_cached"), [("prefill", 0), ("schedule", 1010)])
async def test_requests_admitted_together_share_a_new_prefix_only_when_it_is_cached_on_schedule(
    cache_on: str, follower_cached: int
) -> None:
    """A burst on a new prefix (1000 tokens, then " question " and a digit): SGLang caches a prompt once
    prefilled, so the burst's requests admitted in the same step each prefill it; vLLM caches a block when it
    schedules it, so the requests scheduled with it share it."""
    prefix = encode("q" * 1000)
    async with running_engine(prefill_tps=10_000.0, cache_on=cache_on) as engine:
        results = await asyncio.gather(
            *(run_to_end(engine, EngineRequest(prefix + encode(f" question {i}"), 2)) for i in range(4))
        )
        stats = engine.stats()
    assert results[0][1].cached_tokens == 0
    assert [out.cached_tokens for _, out, _ in results[1:]] == [follower_cached] * 3
    uncached = 4 * (len(prefix) + 11) - 3 * follower_cached
    assert stats.prompt_tokens_total - stats.cached_tokens_total == uncached
    assert max(ttft for _, _, ttft in results) == pytest.approx(uncached / 10_000)  # one prefill batch
    assert engine.cache.locked == 0


async def test_a_prompt_cached_on_schedule_is_in_the_cache_before_its_prefill_ends() -> None:
    prompt = encode("r" * 2000)
    async with running_engine(prefill_tps=1_000.0, cache_on="schedule") as engine:  # a 2 s prefill
        task = asyncio.create_task(run_to_end(engine, EngineRequest(prompt, 2)))
        await wait_until_async(lambda: engine.stats().num_running_reqs == 1, what="scheduled")
        assert engine.cache.match(prompt) == len(prompt)
        assert not task.done()
        await task


async def test_stop_string_ends_generation_early() -> None:
    async with running_engine(time_scale=0.0) as engine:
        full, _, _ = await run_to_end(engine, EngineRequest(encode("stop test"), 40))
        stop = full[10:13]
        text, out, _ = await run_to_end(engine, EngineRequest(encode("stop test"), 40, (stop,)))
    assert out.finish is not None and out.finish.type == "stop" and out.finish.matched == stop
    assert text == full[: full.index(stop)]


async def test_transferred_kv_skips_prefill() -> None:
    prompt = encode("p" * 4000)  # would take 1 s to prefill at 4000 tok/s
    async with running_engine() as engine:  # decode steps of 1 ms
        _, out, ttft = await run_to_end(engine, EngineRequest(prompt, 3, transferred_cached=123))
    assert ttft == pytest.approx(0.001)  # one decode step, no prefill
    assert out.cached_tokens == 123
    assert out.completion_tokens == 3


async def test_time_scale_speeds_up_decoding() -> None:
    async with running_engine(time_scale=0.1, decode_step_ms=20.0) as engine:
        clock = asyncio.get_running_loop()
        started = clock.time()
        await run_to_end(engine, EngineRequest(encode("a"), 21))  # 1 prefill token, 20 decode steps
        took = clock.time() - started
    assert took == pytest.approx(0.1 * (1 / 4000 + 20 * 0.020))  # a tenth of the model time


async def test_stop_ends_pending_requests_with_abort() -> None:
    engine = Engine(SimConfig(max_running=1, decode_step_ms=5.0))
    engine.start()
    task = asyncio.create_task(run_to_end(engine, EngineRequest(encode("x"), 100_000)))
    await wait_until_async(lambda: engine.stats().num_running_reqs == 1, what="1 running")
    await engine.stop()
    _, out, _ = await asyncio.wait_for(task, 1.0)
    assert out.finish is not None and out.finish.type == "abort"
