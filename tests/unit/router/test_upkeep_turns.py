"""``core.run_tree_upkeep`` lets a task that sleeps run between every two slices of upkeep, not every second one.

A task woken by a timer (or a read, or a lock) wakes in two hops: the timer's callback resolves a future,
and the task's step is scheduled only then. With too few loop turns between two slices, that step lands
behind the next slice, and every request waits for two slices of upkeep instead of one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from itertools import pairwise

from smg_router.core import run_tree_upkeep

SLICE = 0.002


class _Slices:
    """Stands in for the policy registry: ``tree_upkeep`` yields after each slice of busy CPU."""

    def __init__(self, n: int, log: list[str]) -> None:
        self.n, self.log = n, log

    def tree_upkeep(self) -> Iterator[None]:
        for _ in range(self.n):
            end = time.perf_counter() + SLICE
            while time.perf_counter() < end:
                pass
            self.log.append("slice")
            yield


async def test_a_sleeping_task_runs_between_every_two_slices() -> None:
    log: list[str] = []

    async def ticker() -> None:
        while True:
            await asyncio.sleep(SLICE / 4)  # due again well within one slice
            log.append("tick")

    task = asyncio.get_running_loop().create_task(ticker())
    await asyncio.sleep(SLICE)
    await run_tree_upkeep(_Slices(50, log))  # type: ignore[arg-type]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)

    first, last = log.index("slice"), len(log) - 1 - log[::-1].index("slice")
    during = log[first : last + 1]
    back_to_back = sum(a == b == "slice" for a, b in pairwise(during))
    assert during.count("slice") == 50
    assert back_to_back == 0, f"{back_to_back} of 49 pairs of slices ran with no tick between them"
