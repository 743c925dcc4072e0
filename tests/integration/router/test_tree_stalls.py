"""Tree upkeep never stalls the event loop: evicting or removing a worker holding 10 M chars, < 20 ms gaps (of CPU).

A real RouterCore (its policy registry, lifecycle and the coroutine its ``smg-tree-eviction`` task runs,
``core.run_tree_upkeep``) on a real event loop. One worker gets 10 M chars of short unique prompts (20
chars each, the shape with the most nodes per char: 808k nodes, ~435 MiB estimated) through the policy API; then a
ticker task wakes every 1 ms and records the longest gap between two wake-ups while (1) a round of upkeep
evicts the tree down to a 16 MiB budget, and (2) separately, after building it again, the worker is
removed through the lifecycle and upkeep reclaims its nodes. Meanwhile a request task keeps routing
prompts (every 1 ms) among the routable workers and checks the removed worker is never chosen.

Before this change the same work ran in one go, holding the loop: on this very tree ``evict_tenant`` to
300k chars took 3.9 s and ``remove_tenant`` 0.6 s on this kind of machine (0.19 s and 0.05 s at ~0.9 M chars).
A full garbage collection is owed after building (the build allocates millions of tracked objects): the
test runs it before each measured window, so that the window measures the upkeep, not the build.

Takes ~32-40 s on a shared 2-core machine (most of it building the tree twice, ~12 s each), ~1 GB of memory.
"""

from __future__ import annotations

import asyncio
import gc
import random
import time

import pytest
from smg_router.core import RouterCore, run_tree_upkeep
from smg_router.settings import parse_settings
from smg_router.workers.worker import Worker, WorkerSpec, WorkerStatus

pytestmark = pytest.mark.timeout(180)

CHARS = 10_000_000
PROMPT = 20
BUDGET = 16 * 2**20
MAX_STALL = 0.020
ALPHABET = "abcdefghijklmnopqrstuvwxyz "


class Ticker:
    """Wakes every 1 ms; records each gap between two wake-ups (what any request would have waited).

    Two clocks: ``walls`` (perf_counter) and ``gaps``, the CPU time the loop's thread spent between two
    wake-ups (thread_time).  A stall is the loop busy with our code, which costs CPU; a shared machine also
    deschedules the whole process for tens of milliseconds at times, which costs wall time only (seen: p99
    36 ms of wall time while another job built Kubernetes).  The assertion is on ``gaps``; both are printed."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self.walls: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        last, last_cpu = time.perf_counter(), time.thread_time()
        while True:
            await asyncio.sleep(0.001)
            now, cpu = time.perf_counter(), time.thread_time()
            self.walls.append(now - last)
            self.gaps.append(cpu - last_cpu)
            last, last_cpu = now, cpu

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="test-ticker")

    async def stop(self) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    def summary(self) -> str:
        gaps, walls = sorted(self.gaps), sorted(self.walls)
        p99 = int(len(gaps) * 0.99)
        return (
            f"{len(gaps)} ticks, longest gap {gaps[-1] * 1000:.1f} ms CPU ({walls[-1] * 1000:.1f} ms wall), "
            f"p99 {gaps[p99] * 1000:.1f} ms CPU ({walls[p99] * 1000:.1f} ms wall), "
            f"{sum(g > 0.005 for g in gaps)} gaps > 5 ms CPU"
        )


class Requests:
    """Routes a fresh prompt every 1 ms among the routable workers, as the proxy would."""

    def __init__(self, core: RouterCore, gone: set[str]) -> None:
        self.core, self.gone = core, gone
        self.routed = 0
        self.slowest = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        rng = random.Random(7)
        policy = self.core.policies.policy_for("regular", "m")
        while True:
            await asyncio.sleep(0.001)
            workers = [w for w in self.core.registry if w.routable]
            t0 = time.perf_counter()
            chosen = policy.select(workers, _Req("m", "".join(rng.choices(ALPHABET, k=60))), time.monotonic())
            self.slowest = max(self.slowest, time.perf_counter() - t0)
            assert chosen.url not in self.gone, f"routed to removed worker {chosen.url}"
            self.routed += 1

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="test-requests")

    async def stop(self) -> None:
        assert self._task is not None
        self._task.cancel()
        (result,) = await asyncio.gather(self._task, return_exceptions=True)
        if not isinstance(result, asyncio.CancelledError):
            raise result


class _Req:
    __slots__ = ("head", "model", "text")

    def __init__(self, model: str, text: str) -> None:
        self.model, self.text, self.head = model, text, 0  # a plain prompt


async def _worker(core: RouterCore, n: int) -> Worker:
    worker, _ = await core.fleet.register(
        WorkerSpec.from_json({"url": f"http://127.0.0.{n}:8000", "model_id": "m"}), probe=False
    )
    core.fleet.lifecycle.set_status(worker, WorkerStatus.READY)
    return worker


def _build(core: RouterCore, worker: Worker) -> float:
    """10 M chars of unique 20-char prompts for ``worker`` through the policy (one select per prompt)."""
    policy = core.policies.policy_for("regular", "m")
    rng = random.Random(1)
    t0 = time.perf_counter()
    while sum(n for _, w, n in policy.tree_sizes() if w == worker.url) < CHARS:
        for _ in range(10_000):
            policy.select([worker], _Req("m", "".join(rng.choices(ALPHABET, k=PROMPT))), 0.0)
    return time.perf_counter() - t0


def _tree_bytes(core: RouterCore) -> int:
    return sum(n for *_, n in core.policies.tree_bytes())


async def _measured(core: RouterCore, what: str, work) -> Ticker:
    gc.collect()  # what the build owes (see the module docstring)
    collections: list[int] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "stop":
            collections.append(info["generation"])

    gc.callbacks.append(on_gc)
    ticker = Ticker()
    ticker.start()
    await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    try:
        await work()
    finally:
        took = time.perf_counter() - t0
        await asyncio.sleep(0.01)
        await ticker.stop()
        gc.callbacks.remove(on_gc)
    print(
        f"\n{what}: {took:.2f} s of upkeep; {ticker.summary()}; garbage collections by generation during it: "
        f"{[collections.count(g) for g in range(3)]}"
    )
    return ticker


async def test_evicting_and_removing_a_10m_char_worker_never_stalls_the_loop() -> None:
    core = RouterCore(parse_settings(["--tree-memory-budget", str(BUDGET), "--model-id", "m"]))
    big, other = await _worker(core, 2), await _worker(core, 3)
    policy = core.policies.policy_for("regular", "m")

    took = _build(core, big)
    sizes = {w: n for _, w, n in policy.tree_sizes()}
    print(
        f"\nbuilt {sizes[big.url]} chars for one worker in {took:.1f} s; estimated {_tree_bytes(core) / 2**20:.0f} MiB"
    )
    assert sizes[big.url] >= CHARS

    # 1. a round of upkeep finds the trees over the budget and evicts them down to 80% of it
    requests = Requests(core, gone=set())
    requests.start()
    ticker = await _measured(core, "evict 10 M chars down to a 16 MiB budget", lambda: run_tree_upkeep(core.policies))
    await requests.stop()
    left = {w: n for _, w, n in policy.tree_sizes()}
    print(
        f"left: {left[big.url]} chars, estimated {_tree_bytes(core) / 2**20:.1f} MiB; {requests.routed} requests "
        f"routed meanwhile, slowest decision {requests.slowest * 1e6:.0f} us"
    )
    assert _tree_bytes(core) <= BUDGET
    assert left[big.url] < CHARS // 10
    assert max(ticker.gaps) < MAX_STALL

    # 2. the same tree again; the worker leaves through the lifecycle; upkeep reclaims its nodes
    took = _build(core, big)
    built = _tree_bytes(core)
    print(f"built again in {took:.1f} s; estimated {built / 2**20:.0f} MiB")
    requests = Requests(core, gone={big.url})

    async def remove() -> None:
        t0 = time.perf_counter()
        await core.fleet.remove(big, drain_timeout=0)
        print(f"\nremoval (drain, registry, detach from every tree): {(time.perf_counter() - t0) * 1000:.1f} ms")
        requests.start()
        assert big.url not in {w for _, w, _ in policy.tree_sizes()}
        await run_tree_upkeep(core.policies)

    ticker = await _measured(core, "reclaim a removed worker's 10 M chars", remove)
    await requests.stop()
    print(
        f"{requests.routed} requests routed meanwhile, slowest decision {requests.slowest * 1e6:.0f} us; "
        f"left: estimated {_tree_bytes(core) / 2**20:.1f} MiB"
    )
    assert requests.routed > 0
    assert {w for _, w, _ in policy.tree_sizes()} == {other.url}
    # every char left is the live worker's (nothing of the removed one, nothing orphaned), and what is left is
    # what the requests routed meanwhile put there: a bound in bytes would depend on how many were routed
    chars_left = sum(tree.total_chars() for _, tree in policy.tree_slots())
    assert chars_left == sum(n for _, w, n in policy.tree_sizes() if w == other.url)
    assert _tree_bytes(core) < built / 100
    assert max(ticker.gaps) < MAX_STALL
