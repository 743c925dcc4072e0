"""The hold of a model with no routable worker (``--hold-when-empty``): scale from zero without a 503 storm.

Called by ``proxy`` before a request is routed (``WaitingRoom.hold``), and woken by the one lifecycle path
(``fleet.lifecycle``: a worker registered, updated, turned ready or undrained calls ``wake``); ``core`` wires the two.

The rule: a request for a known model (``proxy.resolve_model``) whose roles have no routable worker (regular; prefill
AND decode in PD mode) waits in its model's queue, at most ``--hold-when-empty`` seconds, and goes as soon as every
role it needs has one again, the queue in arrival order.  Past the hold, or when ``--hold-queue-size`` requests of the
model already wait, or at once with the hold off: a 503 with ``Retry-After`` naming the model and why.  A client that
goes away leaves the queue (its handler is cancelled).  The queue depth is ``smg_model_requests_waiting{model,role}``
(a PD request awaiting both roles counts in each, and leaves a role's count as soon as that role is routable), the
outcomes ``smg_model_holds_total{model,outcome}``.

What it does not promise: a worker that turned routable again may be gone by the time a released request is routed
(it then gets the path's own 503); and a worker taken out only by open breakers under ``--max-ejection-share 1``
comes back at its breaker's half-open trial, which is no lifecycle event: its held requests wait for another event or
their 503.  Woken by events only: no timer polls the fleet.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence

from smg_router.errors import NoWorkerAvailable
from smg_router.metrics import Metrics
from smg_router.settings import HoldSettings

Routable = Callable[[str, str], bool]
"""(role, model) → whether an attempt would find a routable worker of that role serving the model."""


class _Waiter:
    """One held request: the roles it needs, those it still awaits (counted in the gauge), its release."""

    __slots__ = ("future", "missing", "queued", "roles")

    def __init__(self, roles: Sequence[str], missing: list[str], future: asyncio.Future[None]) -> None:
        self.roles = roles
        self.missing = missing
        self.future = future
        self.queued = True


class WaitingRoom:
    """Every model's queue of held requests (see the module docstring)."""

    def __init__(self, *, settings: HoldSettings, metrics: Metrics, routable: Routable) -> None:
        self._seconds = settings.seconds
        self._size = settings.queue_size
        self._metrics = metrics
        self._routable = routable
        self._queues: dict[str, deque[_Waiter]] = {}

    def waiting(self, model: str) -> int:
        """Requests of ``model`` held now."""
        queue = self._queues.get(model)
        return 0 if queue is None else len(queue)

    async def hold(self, model: str, roles: Sequence[str]) -> None:
        """Return once every role of ``roles`` has a routable worker of ``model`` (at once when it has: one check a
        role); NoWorkerAvailable (a 503 with Retry-After) past the hold, with a full queue, or with the hold off."""
        missing = [role for role in roles if not self._routable(role, model)]
        if not missing:
            return
        awaited = " and ".join(missing)
        if self._seconds <= 0:
            raise NoWorkerAvailable(f"no healthy {awaited} worker for model '{model}'", code="no_available_workers")
        queue = self._queues.setdefault(model, deque())
        if len(queue) >= self._size:
            self._metrics.holds.labels(model, "full").inc()
            raise NoWorkerAvailable(
                f"no healthy {awaited} worker for model '{model}', and {self._size} requests already wait for one "
                "(--hold-queue-size)",
                code="hold_queue_full",
            )
        waiter = _Waiter(roles, missing, asyncio.get_running_loop().create_future())
        queue.append(waiter)
        for role in missing:
            self._metrics.requests_waiting.labels(model, role).inc()
        outcome = "cancelled"
        try:
            async with asyncio.timeout(self._seconds):
                await waiter.future
            outcome = "sent"
        except TimeoutError:
            if waiter.future.done() and not waiter.future.cancelled():  # released in the turn the bound came: it goes
                outcome = "sent"
                return
            outcome = "expired"
            awaited = " and ".join(waiter.missing)
            raise NoWorkerAvailable(
                f"no healthy {awaited} worker for model '{model}' within {self._seconds:g} s (--hold-when-empty)",
                code="hold_expired",
            ) from None
        finally:
            self._leave(model, waiter)
            self._metrics.holds.labels(model, outcome).inc()

    def wake(self) -> None:
        """The fleet changed: release, in arrival order, the held requests whose roles all have a routable worker
        now (and move those still held out of the counts of the roles that have one)."""
        if not self._queues:
            return
        for model, queue in list(self._queues.items()):
            ok: dict[str, bool] = {}
            released = []
            for waiter in queue:
                still = [r for r in waiter.roles if not ok.setdefault(r, self._routable(r, model))]
                for role in waiter.missing:
                    if role not in still:
                        self._metrics.requests_waiting.labels(model, role).dec()
                waiter.missing = still
                if not still:
                    released.append(waiter)
            for waiter in released:
                self._leave(model, waiter)
                if not waiter.future.done():
                    waiter.future.set_result(None)

    def _leave(self, model: str, waiter: _Waiter) -> None:
        """Out of the queue and the counts, once (released, expired or cancelled)."""
        if not waiter.queued:
            return
        waiter.queued = False
        queue = self._queues[model]
        queue.remove(waiter)
        if not queue:
            del self._queues[model]
        for role in waiter.missing:
            self._metrics.requests_waiting.labels(model, role).dec()
        waiter.missing = []
