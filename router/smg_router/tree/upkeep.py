"""Upkeep of a set of radix trees in slices: reclaim removed tenants, cap each tenant, fit one byte budget.

``Upkeep.run`` is a plain generator, synchronous and free of any event loop: it does tree work in bounded
steps (``RadixTree.reclaim``, ``Eviction.step``, ``unit`` units each) and yields whenever ``slice_seconds``
of the caller's clock have gone by since the last yield. The caller gives the event loop a turn at each
yield (the router: ``await asyncio.sleep(0)``) so requests keep flowing while a big job is half done;
anything may happen to the trees between two slices, and every step re-checks what it works on.

A round, in order:

1. reclaim: the nodes of every detached tenant, and of every tree whose trees()-caller retired it;
2. caps: a tenant with a cap of its own (``tenant_cap``: its engine's KV capacity) is LRU-evicted, every round, as
   soon as it is past it, down to ``low_water_ratio`` of it (so a tree that follows a full engine is not trimmed
   by a few chars a round); a tenant whose engine reports no capacity is bounded by the budget alone;
3. budget: when the trees' estimated bytes (``RadixTree.estimated_bytes``) add up to more than
   ``budget_bytes``, every tenant of every tree is LRU-evicted down to the same fraction of its chars,
   ``budget_bytes * low_water_ratio / total``, like every engine evicting its own least recently used
   blocks; a round is repeated (at most ``_BUDGET_ROUNDS`` times) while the total stays over the budget,
   since a node shared by several tenants is freed only when the last of them lets it go.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from .eviction import Eviction
from .radix_tree import RadixTree

__all__ = ["Limits", "Upkeep", "share_budget"]

K = TypeVar("K")
_BUDGET_ROUNDS = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    budget_bytes: int
    """Estimated bytes all the trees together may hold."""
    low_water_ratio: float = 0.8
    """Over the budget, the trees are brought down to ``budget_bytes`` times this; a tenant past its own cap, to its
    cap times this."""


def share_budget(budget: int, held: Sequence[int]) -> list[int]:
    """The bytes each of several indexes sharing one budget may hold, from what each holds now (``held``): while
    they fit, each may grow into the room left free; past the budget, each is cut in proportion to what it holds."""
    total = sum(held)
    if total <= budget:
        return [n + budget - total for n in held]
    return [n * budget // total for n in held]


class Upkeep(Generic[K]):
    """Runs rounds of upkeep over the trees ``trees()`` names, in slices (see the module docstring)."""

    def __init__(
        self, limits: Limits, *, clock: Callable[[], float], slice_seconds: float = 0.002, unit: int = 128
    ) -> None:
        self.limits = limits
        self._clock = clock
        self._slice = slice_seconds
        self._unit = unit
        self._deadline = 0.0

    def run(
        self,
        trees: Callable[[], Sequence[tuple[K, RadixTree]]],
        evicted: Callable[[K, int], None],
        *,
        tenant_cap: Callable[[K, str], int | None] | None = None,
    ) -> Iterator[None]:
        """One round. ``trees()`` is asked again after every pause (trees come and go); ``evicted(key, n)``
        is told of every n chars LRU-evicted from the tree named ``key``; ``tenant_cap(key, tenant)``, a
        tenant's own cap in chars (None: none, the budget alone)."""
        self._deadline = self._clock() + self._slice
        yield from self._reclaim(trees)
        if tenant_cap is not None:
            yield from self._cap(trees, evicted, tenant_cap)
        yield from self._fit(trees, evicted)

    def _pause(self) -> Iterator[None]:
        if self._clock() >= self._deadline:
            yield
            self._deadline = self._clock() + self._slice

    def _reclaim(self, trees: Callable[[], Sequence[tuple[K, RadixTree]]]) -> Iterator[None]:
        while True:
            pending = [tree for _, tree in trees() if tree.reclaim_pending()]
            if not pending:
                return
            for tree in pending:
                while tree.reclaim(self._unit):
                    yield from self._pause()
                yield from self._pause()

    def _evict(self, job: Eviction, key: K, evicted: Callable[[K, int], None]) -> Iterator[None]:
        while True:
            before = job.evicted
            more = job.step(self._unit)
            if job.evicted != before:
                evicted(key, job.evicted - before)
            if not more:
                return
            yield from self._pause()

    def _cap(
        self,
        trees: Callable[[], Sequence[tuple[K, RadixTree]]],
        evicted: Callable[[K, int], None],
        tenant_cap: Callable[[K, str], int | None],
    ) -> Iterator[None]:
        for key, tree in trees():
            for tenant in list(tree.tenant_sizes()):
                own = tenant_cap(key, tenant)
                if own is not None and tree.tenant_size(tenant) > own:
                    yield from self._evict(tree.eviction(tenant, int(own * self.limits.low_water_ratio)), key, evicted)

    def _fit(
        self, trees: Callable[[], Sequence[tuple[K, RadixTree]]], evicted: Callable[[K, int], None]
    ) -> Iterator[None]:
        budget = self.limits.budget_bytes
        for _ in range(_BUDGET_ROUNDS):
            slots = list(trees())
            total = sum(tree.estimated_bytes() for _, tree in slots)
            if total <= budget:
                return
            ratio = budget * self.limits.low_water_ratio / total
            progress = 0
            for key, tree in slots:
                for tenant in list(tree.tenant_sizes()):
                    job = tree.eviction(tenant, int(tree.tenant_size(tenant) * ratio))
                    yield from self._evict(job, key, evicted)
                    progress += job.evicted
            yield from self._reclaim(trees)
            if not progress:
                return
