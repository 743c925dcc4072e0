"""cache_aware: route each request to the worker most likely to hold its prompt prefix in KV cache.

One approximate radix tree per model (tenants are worker URLs, keys are characters of the routing
text: the whole prompt as the engine sees it).  Per request, over the routable workers:

1. Effective load of each worker = max(backend running + waiting, local in-flight) from the shared
   load snapshot (local in-flight alone when the snapshot is stale; counted as ``no_load_data``).
2. Imbalanced when ``max - min > balance_abs_threshold`` AND ``max > min * balance_rel_threshold``:
   take the least-loaded worker (ties: fewer processed, then registry order), still insert the text
   for it, count fallback ``imbalance``.
3. Otherwise match: ``rate = matched_chars / len(text)``.  ``rate > cache_threshold`` (strictly) is a
   hit: the least-loaded routable holder of the deepest matched node.  If no holder is routable, count
   ``stale_tenant`` and take the least-loaded worker.  Otherwise a miss: the least-loaded worker.
4. Insert the text for the chosen worker, in the same descent as the match.

Defaults (``PolicySettings``): cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold
1.5.  A request for a model with no tree gets one created on the spot and is counted as ``no_tree`` (the
lifecycle should have made it).

Upkeep is off the request path: ``select`` never evicts.  ``sync`` detaches a worker that left from its
trees at once (O(1): no match sees it from then on) and retires the tree of a model that left; the
router's one upkeep task (``PolicyRegistry.tree_upkeep``, over every instance's ``tree_slots``) then
reclaims their nodes, caps each worker at max_tree_size (2**26) chars per tree (every eviction_interval,
120 s, and at max_tree_size * high_water_ratio in between) and keeps all the trees of the router under
tree_memory_budget (256 MiB) estimated bytes, in slices of a few milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from smg_router.policies.base import Policy, PolicyContext, RouteRequest, least_loaded
from smg_router.tree import Match, RadixTree
from smg_router.workers.worker import Worker


class CacheAwarePolicy(Policy):
    name = "cache_aware"
    uses_load = True

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._trees: dict[str, RadixTree] = {}
        self._retired: list[tuple[str, RadixTree]] = []
        """Trees of models that left, their tenants detached, until upkeep has reclaimed their nodes
        (dropping a big tree at once would free it all in one go, or leave cycles for a full collection)."""

    # -- lifecycle ------------------------------------------------------------------------------
    def sync(self, workers: Sequence[Worker]) -> None:
        """Make the trees match the reachable workers: a tree per model, no tenant that left."""
        wanted: dict[str, set[str]] = {}
        for w in workers:
            wanted.setdefault(w.model_id or "", set()).add(w.url)  # "": the workers of a model not known yet
        for model in wanted:
            self._trees.setdefault(model, RadixTree())
        for model, tree in list(self._trees.items()):
            keep = wanted.get(model, set())
            for tenant in tree.tenants() - keep:
                tree.detach_tenant(tenant)
            if model not in wanted:
                self._retired.append((model, self._trees.pop(model)))

    def retire(self) -> None:
        """This instance is dropped (its slot went away): detach every tenant of every tree."""
        for model, tree in self._trees.items():
            for tenant in tree.tenants():
                tree.detach_tenant(tenant)
            self._retired.append((model, tree))
        self._trees = {}

    def has_tree(self, model: str) -> bool:
        return model in self._trees

    # -- request path ---------------------------------------------------------------------------
    def select(self, workers: Sequence[Worker], req: RouteRequest, now: float) -> Worker:
        model, text, s = req.model, req.text, self.ctx.settings
        tree = self._trees.get(model)
        if tree is None:
            tree = self._trees[model] = RadixTree()
            self.fallback(model, "no_tree")
        loads = self.loads_of(workers, model, now)
        lo, hi = min(loads), max(loads)
        if hi - lo > s.balance_abs_threshold and hi > lo * s.balance_rel_threshold:
            chosen = workers[least_loaded(workers, loads)]
            tree.insert(text, chosen.url)
            self.fallback(model, "imbalance")
        else:
            chosen = workers[0]

            def choose(match: Match) -> str:
                nonlocal chosen
                chosen = workers[self._choose_by_match(workers, loads, match, model, len(text))]
                return chosen.url

            tree.match_and_insert(text, choose)
        return chosen

    def _choose_by_match(
        self, workers: Sequence[Worker], loads: list[int], match: Match, model: str, length: int
    ) -> int:
        m, role = self.ctx.metrics, self.ctx.role
        rate = match.matched_chars / length if length else 0.0
        m.match_ratio.labels(model, role).observe(rate)
        if rate > self.ctx.settings.cache_threshold:
            m.cache_hits.labels(model, role).inc()
            holders = [i for i, w in enumerate(workers) if w.url in match.tenants]
            if holders:
                return least_loaded(workers, loads, holders)
            self.fallback(model, "stale_tenant")
        else:
            m.cache_misses.labels(model, role).inc()
        return least_loaded(workers, loads)

    # -- upkeep ---------------------------------------------------------------------------------
    def maintain(self) -> None:
        """Everything at once: reclaim, then cap every worker at max_tree_size.  For tests and tools; the
        router runs the same work in slices (``PolicyRegistry.tree_upkeep``)."""
        for _, tree in self.tree_slots():
            while tree.reclaim(1 << 62):
                pass
        for model, tree in self._trees.items():
            self.count_evicted(model, sum(tree.evict(self.ctx.settings.max_tree_size).values()))

    def tree_slots(self) -> Iterator[tuple[str, RadixTree]]:
        """(model, tree) for upkeep: every live tree, and the retired ones until their nodes are reclaimed."""
        self._retired = [(m, t) for m, t in self._retired if t.reclaim_pending()]
        yield from self._trees.items()
        yield from self._retired

    def count_evicted(self, model: str, chars: int) -> None:
        if chars:
            self.ctx.metrics.evictions.labels(model, self.ctx.role).inc(chars)

    def tree_bytes(self) -> Iterator[tuple[str, int]]:
        """(model, estimated bytes) of every tree this instance holds, retired ones included."""
        for model, tree in self.tree_slots():
            yield model, tree.estimated_bytes()

    def tree_sizes(self) -> Iterable[tuple[str, str, int]]:
        for model, tree in self._trees.items():
            for tenant, chars in tree.tenant_sizes().items():
                yield model, tenant, chars
