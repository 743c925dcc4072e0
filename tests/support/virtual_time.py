"""Virtual time for asyncio tests without I/O: the clock jumps to the next timer when nothing else can run.

A test of a timing model (``smg-sim``'s engine sleeps for its simulated prefill and decode steps) then
measures exact model time with ``loop.time()`` instead of racing a wall clock on a shared 2-core
machine.  Select it for a folder with the ``pytest_asyncio_loop_factories`` hook in that folder's
conftest.  Not for tests doing socket I/O: the jump does not wait for pending reads.
"""

from __future__ import annotations

import asyncio

__all__ = ["VirtualTimeEventLoop"]


class VirtualTimeEventLoop(asyncio.SelectorEventLoop):
    """A selector loop whose ``time()`` starts at 0 and moves only when every task waits on a timer."""

    def __init__(self) -> None:
        super().__init__()
        self._virtual_now = 0.0

    def time(self) -> float:
        return self._virtual_now

    def _run_once(self) -> None:
        # CPython's BaseEventLoop runs one iteration here: callbacks in `_ready` first, else it selects
        # until the earliest timer in `_scheduled`.  Moving the clock to that timer first makes the
        # select return at once and the timer due: sleeping costs no wall time.
        if not self._ready:  # type: ignore[attr-defined]  # private to BaseEventLoop, stable since 3.4
            timers = [h.when() for h in self._scheduled if not h.cancelled()]  # type: ignore[attr-defined]  # same
            if timers:
                self._virtual_now = max(self._virtual_now, min(timers))
        super()._run_once()  # type: ignore[misc]  # private to BaseEventLoop, not in typeshed
