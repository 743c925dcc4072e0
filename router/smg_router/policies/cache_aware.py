"""cache_aware: route each request to the worker most likely to hold its prompt prefix in KV cache.

One approximate radix tree per model (tenants are worker URLs, keys are characters of the routing
text: the whole prompt as the engine sees it, after its cache namespace marker).  Per request, over the
routable workers:

1. Effective load of each worker = max(backend running + waiting + what this router sent since the poll,
   local in-flight) from the shared load snapshot (``LoadView``; local in-flight alone when the snapshot is
   stale, counted as ``no_load_data``).
2. The load gate: a worker is over it when ``load - min > balance_abs_threshold`` AND ``load > min *
   balance_rel_threshold`` (min over the routable workers).
3. Match: ``rate = matched_chars / len(text)``; ``rate > cache_threshold`` (strictly) counts a tree hit
   (``smg_cache_tree_hits_total``, else a miss).  The tree decides when it is a hit that also covers what
   placement looks at (in a chat, at least ``min(head, placement_prefix_chars)`` chars: a match of only
   the system prompt every conversation shares says nothing of this one): of the routable holders of the deepest
   matched node that are within the gate (streamed requests there with this prompt's leading chars that have not
   started their answer, ``Worker.joining``: held behind its first prefill, or sent together to a worker that holds
   it, are not counted against it: the engine prefills them together, one prefill, and it joins them), the one with
   the least
   left to prefill (``prefill_wait``: engines prefill before they decode, so a prompt waits for the prefills ahead
   of it), then the least loaded (branch ``hit``) --
   unless a worker is warming up (below) and is the rendezvous choice for the text (branch ``warmup``).  If every
   holder is over the gate, the request spills (branch ``spill``, fallback ``imbalance``); if no holder is routable,
   fallback ``stale_tenant``.  Everything else is placed (branch ``miss``; ``namespace`` in a cache namespace).
   A prompt without a head (completions, ``/generate``: 0) has a hit on the rate alone.
4. Spills and misses are placed by rendezvous hashing: the worker that ranks first for the leading
   ``placement_prefix_chars`` of the text's head (``RouteRequest.head``: a chat up to its first user message, which
   every later turn repeats, so a conversation keeps its key; the whole text of a plain prompt; a hash of those chars
   and the worker's id, itself a hash of its URL) among those within the load gate (the same gate as for hits: one rule
   for "too busy"; when it rules a worker out, fallback ``imbalance``).  Every router replica computes the same ranking
   from the same shared backlog, so replicas that never talk send a new prefix to the same worker, and only load moves
   it.  One exception, for misses (``placement_choices``; 0, the default, looks at every worker): the best-ranked worker
   whose share of the tree has room left for the prompt under its KV cap takes it (the first-ranked when none has), so a
   worker that already holds what its engine can cache is not handed one more group while another has room (over 30
   fleets of 4 workers the hash alone put 4-8 of 12 groups on one). An engine that keeps one prompt per slot (llama.cpp,
   its slots read from ``/props``: ``LoadView.slots``) has room while a slot is free for a new key (``_held``: the keys
   of the last prompts sent there, one per slot). Room is judged from this router's tree, which knows what the engines
   hold only when it holds what the whole fleet was sent: while its peers are in sync (``peers``: the other replicas
   tell it every route, ``observe`` inserts them, and it tells them its own), or while its polls show it sends at least
   ALONE_SHARE of the fleet's backlog (``LoadView.own_share``; a router alone sends about all of it, one of N replicas
   about 1/N); such a router also weighs what the prompt would wait for, since no replica has to agree with it: first
   (but for the slot engines without a free slot: a prompt there evicts a whole one) the workers with the
   least it sent left to prefill (``prefill_wait``; a worker prefilling nothing takes the prompt at
   once), of those the ones with room, then the best-ranked at most ALONE_SLACK requests busier than the least loaded (a
   new group or a unique prompt goes where it waits least; the group's next requests follow it as hits; before the
   prefill came first, unique prompts' TTFT p99 was twice round_robin's). A replica in sync with its peers
   knows what the fleet holds from every replica's routes but the prefills only from its own, so it asks first for room,
   then for the fewest prompts of this one's size held (``_prompts_held``: a new group goes where fewer are, so the
   groups and their traffic spread evenly, whatever the hash draw: 6 documents of 16k on 4 workers went 3/2/1/0 by rank
   with room, and the worker with three spilled), then the prefills. One of several replicas out of sync
   places every miss on the first-ranked worker, as the others do: a move judged from one replica's partial tree is a
   move the others do not make, and the group ends up cached twice (with rank only, 8 replicas cache exactly what one
   does; with peers 2-8 replicas cache about what one does). Measured on the
   routing benchmark, one replica: 0.76 (rank only) -> 0.82 (two choices) -> 0.86 (every worker) -> 0.87 (and
   the slack) of the tokens cached (oracle 0.88). A spill (its holders are over the gate: load decides it)
   is placed as a miss is, so a lone router sends it where it waits least, not behind another burst; replicas in sync
   with their peers spill by rank alone, so that every one spills a hot prefix to the same worker (by their own prefills
   they scattered it: 4 replicas kept 0.82 of the tokens cached instead of 0.87).
5. Insert the text for the chosen worker, in the same descent as the match.

A request with a session key (``policies.sticky``, before any policy's choice) goes where its key is pinned;
``pinned`` then inserts its text for that worker, so the tree still says what each engine caches.

Warm-up: a worker that joined a serving fleet (after the workers this instance first saw, while its model's
tree held something: not the fleet registered one by one at start), less than warmup_seconds ago, and holds
less of the tree than the mean share, takes the hits whose rendezvous choice it is when it is no busier than
the holders: it takes up the groups every replica would place on it, each moving once.
``smg_routing_matched_chars_total`` counts the deepest match (``of="fleet"``) and the chosen worker's part of
it (``of="chosen"``).

Defaults (``PolicySettings``): cache_threshold 0.3, balance_abs_threshold 4, balance_rel_threshold
1.5, placement_prefix_chars 1024.  A request for a model
with no tree gets one created on the spot and is counted as ``no_tree`` (the lifecycle should have made it).

Upkeep is off the request path: ``select`` never evicts.  ``sync`` detaches a worker that left from its
trees at once (O(1): no match sees it from then on) and retires the tree of a model that left; the
router's one upkeep task (``PolicyRegistry.tree_upkeep``, over every instance's ``tree_slots``) then
reclaims their nodes, caps each worker at max_tree_size (2**26) chars per tree (every eviction_interval,
120 s, and at max_tree_size * high_water_ratio in between) and at its engine's KV capacity
(``tenant_cap``: the worker's ``kv_capacity_tokens`` when its spec sets one, else the tokens its engine
reports, times tree_chars_per_token, checked every round, so the tree forgets a prefix about when the engine
does), and keeps all the trees of the router under
tree_memory_budget (256 MiB) estimated bytes, in slices of a few milliseconds.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from smg_router.metrics import CounterSeries, Metrics
from smg_router.policies.base import NAMESPACE_MARK, Decision, Policy, PolicyContext, RouteRequest, prefill_wait
from smg_router.policies.placement import (
    placement_key,
    rendezvous_pick,
    rendezvous_ranked,
    rendezvous_score,
    within_gate,
)
from smg_router.tree import Match, RadixTree
from smg_router.workers.worker import Worker, worker_id_for

ALONE_SHARE = 0.75
"""The share of the fleet's backlog from which a router judges room from its own tree (module docstring, 4)."""
ALONE_SLACK = 1
"""A router that sends most of the backlog places a miss on the best-ranked worker (with room, when any has)
at most this many requests busier than the least loaded of them (module docstring, 4)."""
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


def _least(among: list[int], key: Callable[[int], Any]) -> list[int]:
    """The workers of ``among`` (in its order) with the least ``key``; ``key`` is not asked when one is left."""
    if len(among) == 1:
        return among
    keys = [key(i) for i in among]
    best = min(keys)
    return [i for i, k in zip(among, keys, strict=True) if k == best]


class CacheAwarePolicy(Policy):
    name = "cache_aware"
    uses_load = True

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._trees: dict[str, RadixTree] = {}
        self._retired: list[tuple[str, RadixTree]] = []
        """Trees of models that left, their tenants detached, until upkeep has reclaimed their nodes
        (dropping a big tree at once would free it all in one go, or leave cycles for a full collection)."""
        self._joined: dict[str, tuple[int, float]] = {}
        """worker url -> (sync round, monotonic time) it appeared in; a worker that left and came back is new.
        Round 0 for a worker that appeared while its model's tree held nothing: it joined no serving fleet (the
        router and the operator register a fleet one worker per round before any traffic), so it never warms up."""
        self._syncs = 0
        self._warm_until = 0.0
        """Monotonic time the last newcomer's warm-up ends (a cheap test on the request path)."""
        self._kv_set: dict[str, int] = {}
        """worker url -> the ``kv_capacity_tokens`` of its spec, where set; refreshed by every ``sync`` (the
        lifecycle calls it on every add, PUT and PATCH), read by ``tenant_cap`` off the request path."""
        self._counts: dict[str, _Counts] = {}
        """model -> its decision series (``_Counts``)."""
        self._held: dict[str, OrderedDict[int, None]] = {}
        """worker url -> placement keys of the last prompts this router sent it, oldest first, at most one per slot,
        for a worker whose engine keeps one prompt per slot (``LoadView.slots``: llama.cpp): what its slots hold.
        Dropped by ``sync`` when the worker leaves."""

    # -- lifecycle ------------------------------------------------------------------------------
    def sync(self, workers: Sequence[Worker]) -> None:
        """Make the trees match the reachable workers: a tree per model, no tenant that left."""
        wanted: dict[str, set[str]] = {}
        self._syncs += 1
        now = time.monotonic()
        self._kv_set = {w.url: w.spec.kv_capacity_tokens for w in workers if w.spec.kv_capacity_tokens is not None}
        joined = {}
        for w in workers:
            if (seen := self._joined.get(w.url)) is None:
                tree = self._trees.get(w.model_id or "")
                seen = (self._syncs if tree is not None and tree.tenant_sizes() else 0, now)
            joined[w.url] = seen
        self._joined = joined
        self._held = {url: keys for url, keys in self._held.items() if url in joined}
        if self._joined:
            first = min(r for r, _ in self._joined.values())
            ends = [at for r, at in self._joined.values() if r > first]
            self._warm_until = max(ends) + self.ctx.settings.warmup_seconds if ends else 0.0
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
    def decide(self, workers: Sequence[Worker], req: RouteRequest, now: float) -> Decision:
        model, text = req.model, req.text
        tree = self._trees.get(model)
        if tree is None:
            tree = self._trees[model] = RadixTree()
            self.fallback(model, "no_tree")
        loads = self.loads_of(workers, model, now)
        decision: Decision | None = None

        def choose(match: Match) -> str:
            nonlocal decision
            i, branch, fallback = self._choose_by_match(workers, loads, match, tree, model, text, req.head)
            chosen = workers[i]
            held = match.matched_chars if chosen.url in match.tenants else 0
            prefix = self._key_text(text, req.head)
            decision = Decision(
                worker=chosen,
                branch=branch,
                matched=held,
                prefill=len(text) - held,
                prefix=prefix,
                cold=held < len(prefix),
                fallback=fallback,
            )
            return chosen.url

        tree.match_and_insert(text, choose)
        assert decision is not None  # match_and_insert always asks
        self._hold(decision.worker.url, text, req.head)
        self.ctx.peers.tell(self.ctx.role, model, decision.worker.url, text, req.head)
        return decision

    def pinned(self, worker: Worker, req: RouteRequest) -> None:
        """A session key chose ``worker``: the engine will cache the prompt there, so the tree says so."""
        tree = self._trees.get(req.model)
        if tree is None:
            tree = self._trees[req.model] = RadixTree()
            self.fallback(req.model, "no_tree")
        tree.insert(req.text, worker.url)
        self._hold(worker.url, req.text, req.head)
        self.ctx.peers.tell(self.ctx.role, req.model, worker.url, req.text, req.head)

    def observe(self, model: str, worker_url: str, text: str, head: int) -> bool:
        """A peer router sent ``text`` to the worker: the engine caches it there, so this tree says so too (a
        worker this instance does not serve is not taken: it left, or has not been registered here yet)."""
        if worker_url not in self._joined:
            return False
        tree = self._trees.get(model)
        if tree is None:
            tree = self._trees[model] = RadixTree()
        tree.insert(text, worker_url)
        self._hold(worker_url, text, head)
        return True

    def _key_text(self, text: str, head: int) -> str:
        """The leading chars placement hashes: of the head (a chat's up to its first user message; a plain prompt's
        whole text), at most placement_prefix_chars."""
        return text[: min(head or len(text), self.ctx.settings.placement_prefix_chars)]

    def _hold(self, worker_url: str, text: str, head: int) -> None:
        """A slot engine (``LoadView.slots``) was sent this prompt: its key is the most recent of the worker's held
        keys, the oldest past one per slot forgotten, as the engine's least recently used slot is reused.  Kept
        too while the engine has reported neither slots nor a KV capacity (llama.cpp's ``/props`` is read after
        its first requests may have gone out: forgetting them let a third group onto a worker whose two slots
        held two); no longer once it reported a capacity without slots (SGLang, vLLM)."""
        loads, worker_id = self.ctx.loads, worker_id_for(worker_url)
        slots = loads.slots(worker_id)
        if slots is None and loads.kv_tokens(worker_id) is not None:
            return
        key = placement_key(self._key_text(text, head), self.ctx.settings.placement_prefix_chars)
        held = self._held.setdefault(worker_url, OrderedDict())
        held[key] = None
        held.move_to_end(key)
        while len(held) > (slots or UNKNOWN_SLOTS):
            held.popitem(last=False)

    def _choose_by_match(
        self,
        workers: Sequence[Worker],
        loads: list[int],
        match: Match,
        tree: RadixTree,
        model: str,
        text: str,
        head: int,
    ) -> tuple[int, str, str | None]:
        """(the chosen worker's index, the decision branch, the fallback reason if any), each counted."""
        s = self.ctx.settings
        counts = self._counts.get(model)
        if counts is None:
            counts = self._counts[model] = _Counts(self.ctx.metrics, model, self.ctx.role)
        rate = match.matched_chars / len(text) if text else 0.0
        counts.ratio.observe(rate)
        (counts.hits if rate > s.cache_threshold else counts.misses).inc()
        counts.fleet.inc(match.matched_chars)
        key_text = self._key_text(text, head)
        ok = within_gate(loads, s)
        # in a conversation the tree decides only when it knows what placement looks at (the head's leading
        # chars): a match of less (a system prompt every conversation shares) says nothing of this one
        covered = not head or match.matched_chars >= min(head, s.placement_prefix_chars)
        fallback: str | None = None
        if rate > s.cache_threshold and covered:
            holders = [i for i, w in enumerate(workers) if w.url in match.tenants]
            gated, gate = loads, ok
            if any(key_text in workers[i].joining for i in holders):  # a burst there not prefilled yet: it joins it
                gated = [x - w.joining.get(key_text, 0) for x, w in zip(loads, workers, strict=True)]
                gate = within_gate(gated, s)
            usable = [i for i in holders if gate[i]]
            if usable:
                best = min(usable, key=lambda i: (prefill_wait(workers[i]), gated[i], workers[i].processed))
                warming = self._warming(workers, tree)
                if warming:
                    home = self._place(workers, ok, key_text)
                    if home in warming and home not in holders and loads[home] <= loads[best]:
                        counts.decided("warmup")
                        return home, "warmup", None
                counts.decided("hit")
                counts.chosen.inc(match.matched_chars)
                return best, "hit", None
            if holders:
                counts.decided("spill")
                self.fallback(model, "imbalance")
                if self.ctx.peers.in_sync():  # replicas agree where a hot prefix spills (module docstring, 4)
                    return self._place(workers, ok, key_text), "spill", "imbalance"
                return self._place_new(workers, loads, ok, key_text, tree, len(text)), "spill", "imbalance"
            fallback = "stale_tenant"
            self.fallback(model, fallback)
        if not all(ok):
            fallback = fallback or "imbalance"
            self.fallback(model, "imbalance")  # the workers' backlog ruled some out of placement
        chosen = self._place_new(workers, loads, ok, key_text, tree, len(text))
        if workers[chosen].url in match.tenants:  # a match below the threshold, or not covering the head
            counts.chosen.inc(match.matched_chars)
        branch = "namespace" if text.startswith(NAMESPACE_MARK) else "miss"
        counts.decided(branch)
        return chosen, branch, fallback

    def _place(self, workers: Sequence[Worker], ok: Sequence[bool], text: str) -> int:
        """Rendezvous hashing among the workers within the load gate (see the module docstring, 4)."""
        return rendezvous_pick(workers, ok, placement_key(text, self.ctx.settings.placement_prefix_chars))

    def _place_new(
        self,
        workers: Sequence[Worker],
        loads: Sequence[int],
        ok: Sequence[bool],
        key_text: str,
        tree: RadixTree,
        size: int,
    ) -> int:
        """A miss or a spill: among the first ``placement_choices`` ranked workers (0: all), those with the least this
        router sent left to prefill, of those the ones whose share of the tree has room left for the prompt under its
        KV cap (in sync with peers: room, then the fewest prompts held, then the prefills), then the best-ranked no more
        than ALONE_SLACK busier than the least loaded; by rank alone for one of several replicas out of sync (module
        docstring, 4)."""
        s = self.ctx.settings
        if s.placement_choices == 1:
            return self._place(workers, ok, key_text)
        key = placement_key(key_text, s.placement_prefix_chars)
        alone = self._sends_the_traffic()
        if not alone and not self.ctx.peers.in_sync():
            return rendezvous_pick(workers, ok, key)
        if s.placement_choices:
            among = rendezvous_ranked(workers, ok, key, s.placement_choices)
        else:
            among = [i for i, fits in enumerate(ok) if fits]
        if len(among) == 1:
            return among[0]
        # one criterion after the other, each asked only of the workers the ones before left tied (under load the
        # prefill order alone decides, and the room checks are not made); a criterion that ties them all by
        # construction is not asked (no slot engine among them, none prefilling, none past the slack): the same
        # choice, without a call per worker per criterion on every miss (`bench/request_path.py`).
        # One pass finds which those are.
        slots = self.ctx.loads.slots
        least, prefilling, slot_engines = loads[among[0]], False, False
        for i in among:
            w = workers[i]
            least = min(least, loads[i])
            prefilling = prefilling or w.prefilling > 0
            slot_engines = slot_engines or slots(w.id) is not None

        def full(i: int) -> bool:
            return not self._has_room(tree, workers[i], size, key)

        def slots_full(i: int) -> bool:
            return slots(workers[i].id) is not None and full(i)

        waits: tuple[Callable[[int], Any], ...] = ((lambda i: prefill_wait(workers[i])),) if prefilling else ()
        criteria: tuple[Callable[[int], Any], ...]
        if alone:  # a slot engine without a free slot would evict a whole prompt: room first there
            criteria = ((slots_full,) if slot_engines else ()) + waits + (full,)
        else:  # in sync: it knows what the fleet holds from every replica's routes, the prefills only from its own
            criteria = (full, lambda i: self._prompts_held(tree, workers[i], size), *waits)
        for criterion in criteria:
            if len(among) == 1:
                return among[0]
            among = _least(among, criterion)
        slack = least + ALONE_SLACK
        if len(among) > 1 and max(loads[i] for i in among) > slack:
            among = _least(among, lambda i: max(0, loads[i] - slack))
        return among[0] if len(among) == 1 else max(among, key=lambda i: rendezvous_score(key, workers[i].id))

    def _sends_the_traffic(self) -> bool:
        """Whether this router sends most of the fleet's backlog itself (``LoadView.own_share`` at least ALONE_SHARE,
        or not known yet)."""
        share = self.ctx.loads.own_share()
        return share is None or share >= ALONE_SHARE

    def _prompts_held(self, tree: RadixTree, worker: Worker, size: int) -> int:
        """About how many prompts of ``size`` chars the worker's share of the tree holds (its slots' keys for a slot
        engine): a new group goes where fewer are, so that the fleet's groups, and their traffic, spread evenly."""
        if self.ctx.loads.slots(worker.id) is not None:
            return len(self._held.get(worker.url, ()))
        return (tree.tenant_size(worker.url) + size // 2) // max(1, size)  # rounded: a prompt a char short is one

    def _has_room(self, tree: RadixTree, worker: Worker, size: int, key: int) -> bool:
        """Whether ``size`` more chars fit in the worker's share of the tree under its KV cap (no cap: room); for an
        engine that keeps one prompt per slot, instead, whether a slot is free for the prompt's key (or holds it):
        such an engine caches the last prompt of each slot, however short, so chars would count room for more
        prompts than it keeps (and a held prompt's old questions, which it no longer keeps, as taken)."""
        slots = self.ctx.loads.slots(worker.id)
        if slots is not None:
            held = self._held.get(worker.url)
            if held is None:
                return True
            while len(held) > slots:  # kept while its slots were not known yet
                held.popitem(last=False)
            return key in held or len(held) < slots
        cap = self.tenant_cap(worker.url)
        return cap is None or tree.tenant_size(worker.url) + size <= cap

    def _warming(self, workers: Sequence[Worker], tree: RadixTree) -> set[int]:
        """The newcomers still warming up: joined after the fleet's first workers (the router's own start is no
        warm-up: everyone is empty then), less than warmup_seconds ago, and holding less of this tree than the
        mean share of the workers."""
        now = time.monotonic()
        if now >= self._warm_until:
            return set()
        joined = [self._joined.get(w.url, (0, 0.0)) for w in workers]
        first = min(r for r, _ in joined)
        since = now - self.ctx.settings.warmup_seconds
        new = [i for i, (r, at) in enumerate(joined) if r > first and at > since]
        if not new:
            return set()
        mean = sum(tree.tenant_size(w.url) for w in workers) / len(workers)
        return {i for i in new if tree.tenant_size(workers[i].url) < mean}

    # -- upkeep ---------------------------------------------------------------------------------
    def maintain(self) -> None:
        """Everything at once: reclaim, then cap every worker at max_tree_size and at its engine's KV capacity.
        For tests and tools; the router runs the same work in slices (``PolicyRegistry.tree_upkeep``)."""
        for _, tree in self.tree_slots():
            while tree.reclaim(1 << 62):
                pass
        for model, tree in self._trees.items():
            self.count_evicted(model, sum(tree.evict(self.ctx.settings.max_tree_size).values()))
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
