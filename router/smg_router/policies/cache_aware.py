"""cache_aware: send each request to the worker most likely to hold its prompt's prefix in KV cache.

The decision (``docs/routing.md`` states it too, with the mechanism behind each flag), over the routable workers of
the request's model:

Inputs
- the cache index of each worker (``policies.index``): the deepest prefix of the prompt a worker holds, and the
  workers that hold it (the holders; on an engine that keeps one prompt per slot, only while a slot does:
  ``policies.slots``);
- each worker's load: its engine's running + waiting requests as last polled, plus what this router sent it since
  (``LoadView.effective``); for a holder, less the streamed requests on this prompt's prefix there that have not
  started their answer (they join its prefill: the engine computes it once);
- what each worker prefills: the requests this router sent it that have not started their answer
  (``Worker.prefilling``): engines prefill before they decode, so a new prompt waits for the prefills ahead of it;
- the gate: a worker is over it when requests already wait there for a running slot (its load is more than the
  requests its engine runs at once, ``LoadView.running_slots``), another worker would make it wait less, and
  its load is more than ``balance_rel_threshold`` times the least (``placement.within_gate``).

Branches
1. hit: the match covers more than ``cache_threshold`` of the prompt (in a chat, at least its placement key: a
   system prompt every conversation shares says nothing of this one).  The request goes to the holder within the
   gate that prefills the fewest requests, then the least loaded, then the first by rendezvous rank.  If every
   holder is over the gate it is placed (2): branch ``spill``, fallback ``imbalance``; unless no other worker within
   the gate has room for it (2) on an engine that keeps one prompt per slot (a spill would evict a group's only
   prompt; one of several replicas not told each other's routes knows of no room): then the holders as above.  If
   no holder is routable it is placed: fallback ``stale_tenant``.
2. miss (``namespace`` in a cache namespace): placement.  Among the workers within the gate, those whose index has
   room for the prompt (its share under the engine's KV capacity, and by the engine's events none once it has
   evicted since its cache was last empty; an engine that keeps one prompt per slot: the slot it would take is free,
   holds a prompt alike, or holds a copy of a prompt another worker holds too, so no group is lost), or all of them
   when none has; of those the ones holding the fewest prompts of its size
   (groups spread evenly; not compared by the events of a full engine, which caches less the busier it is), then
   the ones that prefill the fewest requests, then the one that ranks first for the prompt's placement key by
   rendezvous hashing.  One of several replicas not told each other's
   routes (``index_complete`` False) judges only by what every replica sees alike: the engines' KV events when
   every worker has them (of those with room, the key's first two by rank, and of those the one holding fewer
   prompts; none with room: the rank alone), else the rank alone.  The key
   is the leading ``placement_prefix_chars`` of the prompt's head (a chat up to its first user message, which later
   turns repeat; a plain prompt's text), so every replica places a conversation or a document group on the same
   worker, and its later requests follow as hits.  A worker ruled out by the gate counts fallback ``imbalance``.

Output: a ``Decision`` (worker, branch, chars it holds, chars to prefill, placement prefix, fallback); the chosen
worker's index records the prompt.  The decision reads only the request, the fleet, the loads (polled, and what
this router sent since) and the indexes: two replicas that see the same state choose the same worker.

A request with a session key (``policies.sticky``, before any policy's choice) goes where its key is pinned;
``pinned`` then records its prompt for that worker, so the index still says what each engine caches.

Upkeep is off the request path: ``decide`` never evicts.  ``sync`` detaches a worker that left from its trees at
once and retires the tree of a model that left; the router's one upkeep task (``PolicyRegistry.tree_upkeep``) then
reclaims their nodes, caps each worker at its engine's KV capacity (``tenant_cap``), and keeps every tree of the
router under ``tree_memory_budget`` bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence

from smg_router.metrics import CounterSeries, Metrics
from smg_router.policies.base import NAMESPACE_MARK, Decision, Policy, PolicyContext, RouteRequest
from smg_router.policies.index import CacheIndex, EventIndex, deepest
from smg_router.policies.placement import placement_key, rendezvous_pick, rendezvous_score, within_gate
from smg_router.policies.slots import SlotPrompts, held_twice
from smg_router.tree import Match, RadixTree
from smg_router.workers.worker import Worker, worker_id_for

UNKNOWN_SLOTS = 16
"""Placement keys kept for a worker whose engine has not said yet whether it keeps one prompt per slot."""


class _Counts:
    """One model's decision series, resolved on its first decision and kept (model-labelled series are never
    removed): a ``labels()`` per metric per request cost more than the counting itself (`bench/request_path.py`)."""

    __slots__ = ("_branches", "_decisions", "_labels", "chosen", "fleet", "hits", "misses", "ratio")

    def __init__(self, metrics: Metrics, model: str, role: str) -> None:
        self.ratio = metrics.match_ratio.labels(model, role)
        self.hits = metrics.cache_hits.labels(model, role)
        self.misses = metrics.cache_misses.labels(model, role)
        self.fleet = metrics.matched_chars.labels(model, role, "fleet")
        self.chosen = metrics.matched_chars.labels(model, role, "chosen")
        self._decisions, self._labels = metrics.decisions, (model, role)
        self._branches: dict[str, CounterSeries] = {}

    def decided(self, branch: str) -> None:
        series = self._branches.get(branch)
        if series is None:
            series = self._branches[branch] = self._decisions.labels(*self._labels, branch)
        series.inc()


class CacheAwarePolicy(Policy):
    name = "cache_aware"
    uses_load = True

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._trees: dict[str, RadixTree] = {}
        """model -> the approximate index of its workers that have no index of their own."""
        self._own: dict[str, CacheIndex] = {}
        """worker url -> its own index (``attach_index``: one fed by its engine's KV events); absent: the tree."""
        self._retired: list[tuple[str, RadixTree]] = []
        """Trees of models that left, their tenants detached, until upkeep has reclaimed their nodes
        (dropping a big tree at once would free it all in one go, or leave cycles for a full collection)."""
        self._served: set[str] = set()
        """The urls of the workers this instance was last synced with."""
        self._kv_set: dict[str, int] = {}
        """worker url -> the ``kv_capacity_tokens`` of its spec, where set; refreshed by every ``sync`` (the
        lifecycle calls it on every add, PUT and PATCH), read by ``tenant_cap`` off the request path."""
        self._counts: dict[str, _Counts] = {}
        """model -> its decision series (``_Counts``)."""
        self._held: dict[str, SlotPrompts] = {}
        """worker url -> what its slots hold, for a worker whose engine keeps one prompt per slot (``LoadView.slots``:
        llama.cpp)."""

    # -- lifecycle ------------------------------------------------------------------------------
    def sync(self, workers: Sequence[Worker]) -> None:
        """Make the trees match the reachable workers: a tree per model, no tenant that left."""
        wanted: dict[str, set[str]] = {}
        self._kv_set = {w.url: w.spec.kv_capacity_tokens for w in workers if w.spec.kv_capacity_tokens is not None}
        self._served = {w.url for w in workers}
        self._held = {url: keys for url, keys in self._held.items() if url in self._served}
        self._own = {url: index for url, index in self._own.items() if url in self._served}
        events = self.ctx.events
        if events is not None:
            for w in workers:
                index = events.index_of(w.url)
                if index is None:
                    if isinstance(self._own.get(w.url), EventIndex):  # its events are not known whole now
                        del self._own[w.url]  # the tree learns it from what is sent it
                elif self._own.get(w.url) is not index:
                    self.attach_index(w.url, index)
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

    def attach_index(self, worker_url: str, index: CacheIndex) -> None:
        """From now on ``worker_url``'s prompts are matched in ``index`` (its engine's own), not in the tree; the
        tree forgets it.  Dropped when the worker leaves (``sync``)."""
        self._own[worker_url] = index
        for tree in self._trees.values():
            tree.detach_tenant(worker_url)

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
    def decide(self, workers: Sequence[Worker], req: RouteRequest, now: float) -> Decision:
        model, text = req.model, req.text
        tree = self._tree(model)
        loads = self.loads_of(workers, model, now)
        slots = self.slots_of(workers)
        key_text = self._key_text(text, req.head)
        key = placement_key(key_text, self.ctx.settings.placement_prefix_chars)
        decision: Decision | None = None

        def choose(match: Match) -> str:
            nonlocal decision
            decision = self._decide(workers, loads, slots, match, model, req, key_text, key)
            return decision.worker.url

        if not self._own:  # every worker's index is the tree: match and insert in one descent
            tree.match_and_insert(text, choose)
        else:
            url = choose(deepest(text, req.tokens, self._indexes(tree, workers), req.namespace))
            self._index_of(tree, url).insert(text, url, req.tokens, req.namespace)
        assert decision is not None  # match_and_insert always asks
        self._hold(decision.worker.url, key_text, len(text))
        return decision

    def pinned(self, worker: Worker, req: RouteRequest, branch: str) -> Decision:
        """A session key chose ``worker``: the engine will cache the prompt there, so the index says so."""
        index = self._index_of(self._tree(req.model), worker.url)
        held = index.match(req.text, req.tokens, req.namespace)
        index.insert(req.text, worker.url, req.tokens, req.namespace)
        key_text = self._key_text(req.text, req.head)
        self._hold(worker.url, key_text, len(req.text))
        matched = held.matched_chars if worker.url in held.tenants else 0
        return Decision(
            worker=worker,
            branch=branch,
            matched=matched,
            prefill=len(req.text) - matched,
            prefix=key_text,
            cold=matched < len(key_text),
        )

    def observe(self, model: str, worker_url: str, text: str, head: int) -> bool:
        """A peer router sent ``text`` to the worker: the engine caches it there, so this index says so too (a
        worker this instance does not serve is not taken: it left, or has not been registered here yet)."""
        if worker_url not in self._served:
            return False
        self._index_of(self._tree(model), worker_url).insert(text, worker_url)
        self._hold(worker_url, self._key_text(text, head), len(text))
        return True

    def _tree(self, model: str) -> RadixTree:
        tree = self._trees.get(model)
        if tree is None:  # the lifecycle makes it; a request for a model it has not seen yet counts
            tree = self._trees[model] = RadixTree()
            self.fallback(model, "no_tree")
        return tree

    def _index_of(self, tree: RadixTree, worker_url: str) -> CacheIndex:
        return self._own.get(worker_url, tree)

    def _indexes(self, tree: RadixTree, workers: Sequence[Worker]) -> list[CacheIndex]:
        """Each index of these workers once (the tree first)."""
        found: list[CacheIndex] = [tree]
        for w in workers:
            index = self._own.get(w.url)
            if index is not None and all(index is not i for i in found):
                found.append(index)
        return found

    def _key_text(self, text: str, head: int) -> str:
        """The leading chars placement hashes: of the head (a chat's up to its first user message; a plain prompt's
        whole text), at most placement_prefix_chars."""
        return text[: min(head or len(text), self.ctx.settings.placement_prefix_chars)]

    def _hold(self, worker_url: str, key_text: str, length: int) -> None:
        """A slot engine (``LoadView.slots``) was sent this prompt: it takes the slot of a prompt alike, else the
        least recently used one (``SlotPrompts``).  Kept too while the engine has reported neither slots nor a KV
        capacity (llama.cpp's ``/props`` is read after its first requests may have gone out); no longer once it
        reported a capacity without slots (SGLang, vLLM)."""
        loads, worker_id = self.ctx.loads, worker_id_for(worker_url)
        slots = loads.slots(worker_id)
        if slots is None and loads.kv_tokens(worker_id) is not None:
            return
        self._held.setdefault(worker_url, SlotPrompts()).sent(key_text, length, slots or UNKNOWN_SLOTS)

    def _decide(
        self,
        workers: Sequence[Worker],
        loads: list[int],
        slots: list[int | None],
        match: Match,
        model: str,
        req: RouteRequest,
        key_text: str,
        key: int,
    ) -> Decision:
        """The module docstring's branches, each counted."""
        s = self.ctx.settings
        text = req.text
        counts = self._counts.get(model)
        if counts is None:
            counts = self._counts[model] = _Counts(self.ctx.metrics, model, self.ctx.role)
        rate = match.matched_chars / len(text) if text else 0.0
        counts.ratio.observe(rate)
        (counts.hits if rate > s.cache_threshold else counts.misses).inc()
        counts.fleet.inc(match.matched_chars)
        ok = within_gate(loads, slots, s)
        covered = not req.head or match.matched_chars >= len(key_text)
        branch, fallback, chosen = "miss", None, -1
        if rate > s.cache_threshold and covered:
            holders = [i for i, w in enumerate(workers) if self._holds(w, match, key_text)]
            gated, gate = loads, ok
            if any(key_text in workers[i].joining for i in holders):  # requests that join its prefill
                gated = [x - w.joining.get(key_text, 0) for x, w in zip(loads, workers, strict=True)]
                gate = within_gate(gated, slots, s)
            usable = [i for i in holders if gate[i]] or self._waits(workers, ok, holders, key_text, len(text))
            if usable:
                branch = "hit"
                chosen = min(
                    usable, key=lambda i: (workers[i].prefilling, gated[i], -rendezvous_score(key, workers[i].id))
                )
            elif holders:
                branch, fallback = "spill", "imbalance"
            else:
                fallback = "stale_tenant"
        if chosen < 0:
            if fallback is None and not all(ok):
                fallback = "imbalance"  # the workers' backlog ruled some out of placement
            chosen = self._place(workers, ok, key, key_text, len(text), model)
            if branch == "miss" and text.startswith(NAMESPACE_MARK):
                branch = "namespace"
        if fallback is not None:
            self.fallback(model, fallback)
        counts.decided(branch)
        worker = workers[chosen]
        held = match.matched_chars if self._holds(worker, match, key_text) else 0
        if held:
            counts.chosen.inc(held)
        return Decision(
            worker=worker,
            branch=branch,
            matched=held,
            prefill=len(text) - held,
            prefix=key_text,
            cold=held < len(key_text),
            fallback=fallback,
        )

    def _holds(self, worker: Worker, match: Match, key_text: str) -> bool:
        """Whether the worker holds the matched prefix: its index says so and, on an engine that keeps one prompt
        per slot, one of its slots still does (they take the prompts of its last requests, ``SlotPrompts``)."""
        if worker.url not in match.tenants:
            return False
        held = self._held.get(worker.url)
        return self.ctx.loads.slots(worker.id) is None or held is None or held.holds(key_text, match.matched_chars)

    def _waits(
        self, workers: Sequence[Worker], ok: Sequence[bool], holders: list[int], key_text: str, size: int
    ) -> list[int]:
        """The holders, when every holder is over the gate and no other worker within it has room for the prompt
        on an engine that keeps one prompt per slot (``_slot_room``): a spill there evicts a group's only prompt,
        whose next request is cold too, while waiting costs one request.  Else none (the hit spills).  One of several
        replicas not told each other's routes knows no slot engine's room (the others fill its slots): none counts."""
        slots, complete = self.ctx.loads.slots, self.ctx.settings.index_complete
        copies = self._copies(workers)
        for i, w in enumerate(workers):
            if (
                ok[i]
                and i not in holders
                and (slots(w.id) is None or (complete and self._slot_room(w, key_text, size, copies)))
            ):
                return []
        return holders

    def _place(
        self, workers: Sequence[Worker], ok: Sequence[bool], key: int, key_text: str, size: int, model: str
    ) -> int:
        """Placement (module docstring, 2): of the workers within the gate, those with room for the prompt (all when
        none has), of those the ones holding the fewest prompts of its size (but by a full engine's events: a busy
        engine caches less), then those prefilling the fewest requests, then the first by rendezvous rank.
        When the index is not complete (one of several replicas): by what every replica sees alike only, the
        engines' events, when every worker has them (``_place_shared``), else by rank alone."""
        if not self.ctx.settings.index_complete:
            if all(w.url in self._own for w in workers):
                return self._place_shared(workers, ok, key, key_text, size)
            return rendezvous_pick(workers, ok, key)
        tree = self._trees[model]
        copies = self._copies(workers)
        best: tuple[bool, int, int, int] | None = None
        chosen = -1
        for i, w in enumerate(workers):
            if ok[i]:
                index = self._index_of(tree, w.url)
                room = self._has_room(index, w, size, key_text, copies)
                # what a full engine's events say it caches is its capacity less its running requests': not compared
                counted = room or not isinstance(index, EventIndex)
                rank = (
                    room,
                    -self._prompts_held(index, w, size) if counted else 0,
                    -w.prefilling,
                    rendezvous_score(key, w.id),
                )
                if best is None or rank > best:
                    best, chosen = rank, i
        return chosen  # the least loaded worker is always within the gate

    def _place_shared(self, workers: Sequence[Worker], ok: Sequence[bool], key: int, key_text: str, size: int) -> int:
        """Placement by the engines' events alone: of the workers within the gate with room for the prompt, the two
        its key ranks first by rendezvous, and of those the one holding fewer prompts (then the first); with none
        with room, the first by rank.  Two choices, not the fleet's least: every replica sees the same counts, and
        the engines tell of a prompt only once it is prefilled, so a burst of new prompts would all go to the one
        the events show emptiest; each prompt's own two spread them, and still go where fewer are."""
        within = [i for i, w in enumerate(workers) if ok[i]]
        copies = self._copies(workers)
        roomy = [
            i
            for i in within
            if self._has_room(self._own[workers[i].url], workers[i], size, key_text, copies, shared=True)
        ]
        if not roomy:  # every cache full: a prompt evicts one wherever it goes, and a busy engine caches less
            return rendezvous_pick(workers, ok, key)
        ranked = sorted(roomy, key=lambda i: rendezvous_score(key, workers[i].id), reverse=True)
        two = ranked[:2]
        held = [self._prompts_held(self._own[workers[i].url], workers[i], size, shared=True) for i in two]
        return two[held.index(min(held))]  # the first by rank on a tie

    def _prompts_held(self, index: CacheIndex, worker: Worker, size: int, shared: bool = False) -> int:
        """About how many prompts of ``size`` chars the worker's share of its index holds (a slot engine: the keys
        in its slots): a new group goes where fewer are, so groups, and their traffic, spread evenly."""
        if self.ctx.loads.slots(worker.id) is not None:
            return len(self._held.get(worker.url, ()))
        held = index.tenant_size(worker.url, shared=shared)
        return (held + size // 2) // max(1, size)  # rounded: a prompt a char short is one

    def _has_room(
        self,
        index: CacheIndex,
        worker: Worker,
        size: int,
        key_text: str,
        copies: Callable[[], set[str]],
        shared: bool = False,
    ) -> bool:
        """Whether ``size`` more chars fit in the worker's share of its index under its KV cap (no cap: room); for an
        engine that keeps one prompt per slot, instead, whether the prompt takes a slot and loses no group
        (``_slot_room``): such an engine caches the last prompt of each slot, however short, so chars would count
        room for more prompts than it keeps."""
        if self.ctx.loads.slots(worker.id) is not None:
            return self._slot_room(worker, key_text, size, copies)
        if isinstance(index, EventIndex) and index.full(worker.url):
            return False  # its engine evicted to make room: a prompt sent there evicts another
        cap = self.tenant_cap(worker.url)
        return cap is None or index.tenant_size(worker.url, shared=shared) + size <= cap

    def _slot_room(self, worker: Worker, key_text: str, size: int, copies: Callable[[], set[str]]) -> bool:
        """On an engine that keeps one prompt per slot: whether the prompt would take a slot and lose no group
        (``SlotPrompts.evicts``): a slot is free or holds one alike, or the slot it takes holds a prompt that
        another worker holds too (``copies``: left by a spill)."""
        slots = self.ctx.loads.slots(worker.id)
        held = self._held.get(worker.url)
        if slots is None or held is None:
            return True
        held.fit(slots)  # kept while its slots were not known yet
        taken = held.evicts(key_text, size, slots)
        return taken is None or taken in copies()

    def _copies(self, workers: Sequence[Worker]) -> Callable[[], set[str]]:
        """The prompts the slots of two or more of ``workers`` hold (``held_twice``), counted once a decision and
        only when asked: only a full slot engine asks.  Each record is first cut to its engine's slots, as
        ``_slot_room`` cuts the one it asks of (prompts sent before the slots were known would count as copies)."""

        def count() -> set[str]:
            engines = []
            for w in workers:
                held, slots = self._held.get(w.url), self.ctx.loads.slots(w.id)
                if held is not None and slots is not None:
                    held.fit(slots)
                    engines.append(held)
            return held_twice(engines)

        return functools.cache(count)

    # -- upkeep ---------------------------------------------------------------------------------
    def maintain(self) -> None:
        """Everything at once: reclaim, then cap every worker at its engine's KV capacity.  For tests and tools; the
        router runs the same work in slices (``PolicyRegistry.tree_upkeep``)."""
        for _, tree in self.tree_slots():
            while tree.reclaim(1 << 62):
                pass
        for model, tree in self._trees.items():
            for tenant in list(tree.tenant_sizes()):
                own = self.tenant_cap(tenant)
                if own is not None and tree.tenant_size(tenant) > own:
                    self.count_evicted(model, tree.evict_tenant(tenant, own))

    def tree_slots(self) -> Iterator[tuple[str, RadixTree]]:
        """(model, tree) for upkeep: every live tree, and the retired ones until their nodes are reclaimed."""
        self._retired = [(m, t) for m, t in self._retired if t.reclaim_pending()]
        yield from self._trees.items()
        yield from self._retired

    def tenant_cap(self, tenant: str) -> int | None:
        """Chars this worker's share of a tree may hold: its KV capacity in tokens times tree_chars_per_token.

        The capacity is the ``kv_capacity_tokens`` of the worker's spec when set (it wins: whoever set it knows
        better, e.g. an engine that reports its whole pool though a share is reserved, or one that reports none,
        as llama.cpp's server), else what its engine reports (``max_total_num_tokens``, as last polled).  None
        when neither is known or the cap is off (tree_chars_per_token 0)."""
        per_token = self.ctx.settings.tree_chars_per_token
        if per_token <= 0:
            return None
        tokens = self._kv_set.get(tenant)
        if tokens is None:
            tokens = self.ctx.loads.kv_tokens(worker_id_for(tenant))
        return None if tokens is None else max(1, int(tokens * per_token))

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
