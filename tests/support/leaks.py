"""The leaked-task check behind the suite's autouse fixture (tests/conftest.py).

A test leaks a task when a task it (or one of its fixtures) created is still pending once the test and
its fixtures have finished.  pytest-asyncio's runner would cancel such a task silently when it closes
the loop; this check names it instead, whatever its name.
"""

from __future__ import annotations

import asyncio

__all__ = ["describe", "leaked_tasks", "settle"]

# Loop iterations granted after teardown, so that a task already cancelled (or told to stop) by a
# fixture, but not yet run to its end, is not reported: it finishes within these.
SETTLE_ITERATIONS = 3


async def settle(iterations: int = SETTLE_ITERATIONS) -> None:
    """Let callbacks already scheduled run: cancellations delivered, done callbacks fired."""
    for _ in range(iterations):
        await asyncio.sleep(0)


def leaked_tasks(loop: asyncio.AbstractEventLoop, before: set[asyncio.Task[object]]) -> list[asyncio.Task[object]]:
    """Tasks of ``loop`` that are still pending and were not already pending in ``before``."""
    return sorted((t for t in asyncio.all_tasks(loop) if not t.done() and t not in before), key=describe)


def describe(task: asyncio.Task[object]) -> str:
    """Its name and the coroutine it runs, e.g. ``Task-7 (test_x.<locals>.forever)``."""
    coro = task.get_coro()
    where = getattr(coro, "__qualname__", None) or repr(coro)
    return f"{task.get_name()} ({where})"
