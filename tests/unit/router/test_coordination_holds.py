"""The first prefill of a new prefix (``coordination.Holds``): leads, holds, turns and claims, with one replica and
with several linked in memory."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from smg_router.attempt import AttemptGuard
from smg_router.metrics import Metrics
from smg_router.workers.registry import WorkerRegistry
from support.policy_env import make_worker


def _setup():  # type: ignore[no-untyped-def]
    registry, metrics = WorkerRegistry(), Metrics()
    worker = make_worker(2)
    registry.add(worker)
    return worker, registry, metrics


def _inflight_gauge(metrics: Metrics, worker) -> float | None:  # type: ignore[no-untyped-def]
    return metrics.registry.get_sample_value("smg_worker_inflight", {"worker": worker.url, "role": "regular"})


def _sample(metrics: Metrics, outcome: str) -> float:
    value = metrics.registry.get_sample_value(
        "smg_prefill_holds_total", {"model": "m", "role": "regular", "outcome": outcome}
    )
    return 0.0 if value is None else value


async def test_requests_on_a_prefix_in_its_first_prefill_wait_for_it_on_that_worker_only() -> None:
    """``Holds``: the first streamed attempt that brings a prefix to a worker leads; attempts after it with the same
    prefix on the same worker wait until it starts its answer; another prefix, another worker, or a prefix the worker
    already held (not cold) do not; a request that is not streamed never leads."""
    import asyncio

    from smg_router.coordination import Holds

    worker, registry, metrics = _setup()
    other = make_worker(3)
    registry.add(other)
    holds = Holds(seconds=5.0, metrics=metrics)

    def guard(on=worker):  # type: ignore[no-untyped-def]
        return AttemptGuard(on, registry=registry, metrics=metrics)

    whole = guard()
    holds.arrange(whole, "doc A", cold=True, streamed=False)  # not streamed: its prefill end is not seen
    assert holds.leading() == 0
    leader = guard()
    holds.arrange(leader, "doc A", cold=True, streamed=True)
    assert holds.leading() == 1
    behind, elsewhere, unrelated = guard(), guard(other), guard()
    holds.arrange(behind, "doc A", cold=False, streamed=True)
    holds.arrange(elsewhere, "doc A", cold=False, streamed=True)
    holds.arrange(unrelated, "doc B", cold=False, streamed=True)
    assert behind.behind is not None and elsewhere.behind is None and unrelated.behind is None
    waiting = asyncio.ensure_future(holds.wait(behind, "m", "regular"))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    leader.started()  # its first chunk: the engine holds the prefix now
    await asyncio.wait_for(waiting, 1)
    assert holds.leading() == 0 and _sample(metrics, "released") == 1
    later = guard()
    holds.arrange(later, "doc A", cold=False, streamed=True)
    assert later.behind is None  # the burst is over: nobody waits any more
    await holds.wait(later, "m", "regular")
    assert _sample(metrics, "released") == 1  # only a request that was behind one counts


async def test_a_hold_ends_with_its_leader_or_after_the_bound() -> None:
    from smg_router.coordination import Holds

    worker, registry, metrics = _setup()
    holds = Holds(seconds=0.05, metrics=metrics)
    leader, behind = (AttemptGuard(worker, registry=registry, metrics=metrics) for _ in range(2))
    holds.arrange(leader, "doc", cold=True, streamed=True)
    holds.arrange(behind, "doc", cold=False, streamed=True)
    await holds.wait(behind, "m", "regular")  # the leader neither starts nor ends: the bound lets it go
    assert _sample(metrics, "timed_out") == 1 and holds.leading() == 1
    leader.close()  # a leader that fails or ends without a chunk releases too
    assert holds.leading() == 0
    off = Holds(seconds=0.0, metrics=metrics)
    first = AttemptGuard(worker, registry=registry, metrics=metrics)
    off.arrange(first, "doc", cold=True, streamed=True)
    assert off.leading() == 0  # 0: nobody leads, nobody waits


async def test_a_worker_counts_the_requests_waiting_behind_each_prefill_until_they_go() -> None:
    """``Worker.held``: what the load gate discounts for a request that would join them (``CacheAwarePolicy``);
    counted while an attempt waits, uncounted however the wait ends: released, timed out, cancelled (the client
    left), or the attempt closed without waiting."""
    import asyncio

    from smg_router.coordination import Holds

    worker, registry, metrics = _setup()
    holds = Holds(seconds=5.0, metrics=metrics)

    def guard() -> AttemptGuard:
        return AttemptGuard(worker, registry=registry, metrics=metrics)

    leader = guard()
    holds.arrange(leader, "doc", cold=True, streamed=True)
    assert worker.held == {}  # the leader is sent at once
    first, second, gone, closed = guard(), guard(), guard(), guard()
    for g in (first, second, gone, closed):
        holds.arrange(g, "doc", cold=False, streamed=True)
    assert worker.held == {"doc": 4}
    waits = [asyncio.ensure_future(holds.wait(g, "m", "regular")) for g in (first, second, gone)]
    await asyncio.sleep(0.01)
    waits[2].cancel()  # its client went away while it waited
    await asyncio.gather(waits[2], return_exceptions=True)
    closed.close()  # ended before it waited
    assert worker.held == {"doc": 2}
    leader.started()
    await asyncio.wait_for(asyncio.gather(*waits[:2]), 1)
    assert worker.held == {}
    first.close()
    assert worker.held == {}  # counted out once

    short = Holds(seconds=0.02, metrics=metrics)
    lead, late = guard(), guard()
    short.arrange(lead, "doc B", cold=True, streamed=True)
    short.arrange(late, "doc B", cold=False, streamed=True)
    assert worker.held == {"doc B": 1}
    await short.wait(late, "m", "regular")  # the bound let it go: sent, no longer waiting
    assert worker.held == {} and _sample(metrics, "timed_out") == 1


class _Told:
    """The peers as ``Holds`` sees them (``coordination.Peers``): what it told them of its leads."""

    def __init__(self, id: str = "m") -> None:
        self.id = id
        self.prefills: list[tuple[str, str, bool]] = []
        self.claims: dict[tuple[str, str], Callable[[list[str]], None]] = {}
        """Whom to tell the peers' answers to a claim: the test calls it (the peers answering)."""

    def tell(self, role: str, model: str, worker_url: str, text: str, head: int) -> None:
        raise AssertionError("Holds tells no routes")

    def tell_prefill(self, worker_url: str, prefix: str, *, done: bool, hurry: bool = False) -> None:
        self.prefills.append((worker_url, prefix, done))

    def claim(self, worker_url: str, prefix: str, answered: Callable[[list[str]], None]) -> None:
        self.tell_prefill(worker_url, prefix, done=False)
        self.claims[worker_url, prefix] = answered

    def in_sync(self) -> bool:
        return True


async def test_the_peers_are_told_of_a_lead_and_its_end_and_their_leads_hold_this_routers_requests() -> None:
    """With peers a lead is told when it starts and when it ends; a lead a peer tells of holds this router's requests
    on that worker with those leading chars until the peer tells its end, or for the bound when no end comes; a lead
    of this router's own is not taken over by a peer's, nor ended by one."""
    import asyncio

    from smg_router.coordination import Holds

    worker, registry, metrics = _setup()
    other = make_worker(3)
    registry.add(other)
    peers = _Told()
    holds = Holds(seconds=5.0, metrics=metrics, peers=peers)

    def guard(on=worker):  # type: ignore[no-untyped-def]
        return AttemptGuard(on, registry=registry, metrics=metrics)

    leader = guard()
    holds.arrange(leader, "doc A", cold=True, streamed=True)
    assert peers.prefills == [(worker.url, "doc A", False)]
    assert not holds.observe(worker.url, "doc A", done=False)  # a peer's lead for the same: this router's stays
    assert not holds.observe(worker.url, "doc A", done=True)  # ... and a peer cannot end it
    assert holds.leading() == 1
    leader.started()
    assert peers.prefills[-1] == (worker.url, "doc A", True) and holds.leading() == 0

    assert holds.observe(other.url, "doc B", done=False)  # a peer's request leads doc B's prefill on the other worker
    behind, here = guard(other), guard()
    holds.arrange(behind, "doc B", cold=False, streamed=True)  # a hit for this router: its tree has the peer's route
    holds.arrange(here, "doc B", cold=False, streamed=True)  # not on that worker: not held
    assert behind.behind is not None and here.behind is None and other.held == {"doc B": 1}
    waiting = asyncio.ensure_future(holds.wait(behind, "m", "regular"))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    assert holds.observe(other.url, "doc B", done=True)  # the peer's first chunk
    await asyncio.wait_for(waiting, 1)
    assert _sample(metrics, "released") == 1 and holds.leading() == 0 and other.held == {}
    assert len(peers.prefills) == 2  # a peer's lead is not told on

    short = Holds(seconds=0.05, metrics=metrics, peers=peers)
    assert short.observe(other.url, "doc C", done=False)
    await asyncio.sleep(0.1)  # no end told: the lead is dropped after the bound
    assert short.leading() == 0
    assert not Holds(seconds=0.0, metrics=metrics).observe(other.url, "doc C", done=False)  # holds off


async def test_a_peers_leads_are_dropped_once_it_falls_silent(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that went away (no batch, not even its heartbeat, for PEER_SILENCE) will not tell the ends of its
    leads: they are dropped then, long before the bound; a peer that keeps talking keeps its lead."""
    import asyncio

    import smg_router.coordination.holds as holds_module

    monkeypatch.setattr(holds_module, "PEER_SILENCE", 0.1)
    worker, _, metrics = _setup()
    holds = holds_module.Holds(seconds=30.0, metrics=metrics)
    holds.heard("gone")
    holds.heard("alive")
    assert holds.observe(worker.url, "doc A", done=False, peer="gone")
    assert holds.observe(worker.url, "doc B", done=False, peer="alive")
    for _ in range(6):
        await asyncio.sleep(0.05)
        holds.heard("alive")  # its heartbeat
    assert holds.leading() == 1  # doc A dropped with its silent peer, doc B stands
    assert holds.observe(worker.url, "doc B", done=True, peer="alive") and holds.leading() == 0


def _claims(metrics: Metrics, outcome: str) -> float:
    return metrics.registry.get_sample_value("smg_prefill_claims_total", {"outcome": outcome}) or 0.0


async def test_a_lead_of_a_replica_in_sync_waits_for_its_peers_answers_and_yields_to_a_lead_of_the_same() -> None:
    """A burst a Service spreads over the replicas: a lead of a replica in sync with its peers claims first.  It goes
    once every peer answered and none leads the same prefix on the same worker (led); it yields when one answers
    that it does, or when a peer with a lower id tells of such a lead meanwhile (two claims crossed), and goes when
    that prefill ends; without every answer it goes after the bound (unanswered).  A lead of the replica whose id is
    the lowest heard does not claim, nor one of a replica without peers in sync, nor one whose worker is to prefill
    fewer chars than ``claim_min_chars``."""
    from smg_router.coordination import NO_PEERS, Holds

    worker, registry, metrics = _setup()
    url = worker.url
    peers = _Told(id="m")
    holds = Holds(seconds=5.0, metrics=metrics, peers=peers, claim_seconds=5.0)
    holds.heard("a")
    holds.heard("z")

    def guard(prefill: int = 1024) -> AttemptGuard:
        return AttemptGuard(worker, registry=registry, metrics=metrics, prefill_chars=prefill)

    async def waits(g: AttemptGuard) -> asyncio.Future[None]:
        going = asyncio.ensure_future(holds.wait(g, "m", "regular"))
        await asyncio.sleep(0.02)
        assert not going.done()
        return going

    lead, behind = guard(), guard()
    holds.arrange(lead, "doc A", cold=True, streamed=True)
    holds.arrange(behind, "doc A", cold=False, streamed=True)
    assert peers.prefills == [(url, "doc A", False)] and lead.behind is not None and behind.behind is not None
    assert holds.leads(url, "doc A")  # what a peer's claim on the same is answered
    going = await waits(lead)
    peers.claims[url, "doc A"]([])  # every peer answered: none leads it
    await asyncio.wait_for(going, 1)
    assert _claims(metrics, "led") == 1 and _sample(metrics, "released") == 0  # a claim is no hold

    second = guard()
    holds.arrange(second, "doc B", cold=True, streamed=True)
    peers.claims[url, "doc B"](["z"])  # a peer leads it already (sent: whatever its id)
    assert _claims(metrics, "yielded") == 1 and not holds.leads(url, "doc B")
    going = await waits(second)
    assert holds.observe(url, "doc B", done=True, peer="z")  # that prefill ended: the prefix is cached
    await asyncio.wait_for(going, 1)

    third = guard()
    holds.arrange(third, "doc C", cold=True, streamed=True)
    assert not holds.observe(url, "doc C", done=False, peer="z")  # a higher id's claim crossed it: that one yields
    assert holds.observe(url, "doc C", done=False, peer="a")  # a lower id's: this one yields
    assert _claims(metrics, "yielded") == 2
    peers.claims[url, "doc C"]([])  # answers that come after change nothing
    going = await waits(third)
    assert holds.observe(url, "doc C", done=True, peer="a")
    await asyncio.wait_for(going, 1)
    assert _claims(metrics, "led") == 1

    fifth = guard()
    holds.arrange(fifth, "doc F", cold=True, streamed=True)
    assert holds.observe(url, "doc F", done=True, peer="z")  # a peer's prefill of it ended before the answers came
    await asyncio.wait_for(holds.wait(fifth, "m", "regular"), 1)  # the prefix is cached: it goes at once
    peers.claims[url, "doc F"](["z"])  # the answer that said so, late: nothing to yield to any more
    assert _claims(metrics, "yielded") == 3 and not holds._yielded

    short = Holds(seconds=5.0, metrics=metrics, peers=peers, claim_seconds=0.05)
    short.heard("a")
    fourth = guard()
    short.arrange(fourth, "doc D", cold=True, streamed=True)
    await asyncio.wait_for(short.wait(fourth, "m", "regular"), 1)  # no answer: the bound lets it go
    assert _claims(metrics, "unanswered") == 1

    lowest = Holds(seconds=5.0, metrics=metrics, peers=_Told(id="0"), claim_seconds=5.0)
    lowest.heard("a")
    alone = Holds(seconds=5.0, metrics=metrics, peers=NO_PEERS, claim_seconds=5.0)
    for h in (lowest, alone):
        g = guard()
        h.arrange(g, "doc E", cold=True, streamed=True)
        assert g.behind is None and h.leading() == 1  # it leads at once
    short_prompt = guard(prefill=1023)
    holds.arrange(short_prompt, "doc G", cold=True, streamed=True)
    assert short_prompt.behind is None and (url, "doc G") not in peers.claims  # told, not claimed
    assert peers.prefills[-1] == (url, "doc G", False)


async def test_requests_on_the_same_prompt_take_turns_on_a_slot_engine() -> None:
    """On an engine that keeps one prompt per slot, a second request with the same leading chars would take another
    slot and prefill the prompt again there: requests with the same leading chars take turns, streamed or not, in
    order, each until the one before it closes (not only until its first chunk); one whose client leaves gives its
    turn on; one that waits past the bound runs beside; the turns are told to the peers as one lead, and requests
    held behind a peer's turns take turns among themselves once it ends.  Another prefix, or an engine that is not a
    slot engine, does not wait."""
    from smg_router.coordination import Holds
    from smg_router.workers.load import LoadView

    worker, registry, metrics = _setup()
    other = make_worker(3)
    registry.add(other)
    loads = LoadView(max_age=10.0)
    loads.record_kv(worker.id, 8192, slots=2)
    peers = _Told()
    holds = Holds(seconds=5.0, metrics=metrics, peers=peers, loads=loads)

    def guard(on=worker):  # type: ignore[no-untyped-def]
        return AttemptGuard(on, registry=registry, metrics=metrics)

    first, second, third, gone = guard(), guard(), guard(), guard()
    holds.arrange(first, "doc A", cold=True, streamed=False)
    for g in (second, gone, third):
        holds.arrange(g, "doc A", cold=False, streamed=True)
    elsewhere, unrelated = guard(other), guard()
    holds.arrange(elsewhere, "doc A", cold=False, streamed=True)
    holds.arrange(unrelated, "doc B", cold=False, streamed=True)
    assert first.behind is None and elsewhere.behind is None and unrelated.behind is None
    assert all(g.behind is not None for g in (second, gone, third))
    assert peers.prefills == [(worker.url, "doc A", False), (worker.url, "doc B", False)]
    waits = [asyncio.ensure_future(holds.wait(g, "m", "regular")) for g in (second, gone, third)]
    await asyncio.sleep(0.02)
    first.started()  # its first chunk: the slot is still busy until it ends
    await asyncio.sleep(0.02)
    assert not any(w.done() for w in waits)
    waits[1].cancel()  # a client that leaves while it waits
    await asyncio.gather(waits[1], return_exceptions=True)
    first.close()
    await asyncio.wait_for(waits[0], 1)  # the second one's turn
    await asyncio.sleep(0.02)
    assert not waits[2].done()  # the third waits for the second, not for the one that left
    second.close()
    await asyncio.wait_for(waits[2], 1)
    assert _sample(metrics, "released") == 2
    third.close()
    unrelated.close()
    assert peers.prefills[-2:] == [(worker.url, "doc A", True), (worker.url, "doc B", True)]  # every turn ended
    assert not holds._slots and not holds._turns

    assert holds.observe(worker.url, "doc D", done=False, peer="z")  # a peer's turn on doc D runs there
    p, q = guard(), guard()
    for g in (p, q):
        holds.arrange(g, "doc D", cold=False, streamed=True)
    waits = [asyncio.ensure_future(holds.wait(g, "m", "regular")) for g in (p, q)]
    await asyncio.sleep(0.02)
    assert holds.observe(worker.url, "doc D", done=True, peer="z")  # the peer's turns ended
    await asyncio.wait_for(waits[0], 1)  # then this replica's take turns: one runs
    await asyncio.sleep(0.02)
    assert not waits[1].done()
    p.close()
    await asyncio.wait_for(waits[1], 1)
    q.close()
    assert not holds._slots

    short = Holds(seconds=0.05, metrics=metrics, loads=loads)
    a, b = guard(), guard()
    short.arrange(a, "doc C", cold=True, streamed=True)
    short.arrange(b, "doc C", cold=False, streamed=True)
    await short.wait(b, "m", "regular")  # a never ends: the bound lets b go, beside it
    assert _sample(metrics, "timed_out") == 1
    a.close()
    b.close()
    assert not short._slots


class _Link:
    """The peers of one ``Holds`` as the other ``Holds`` see them, a one-way delay apart: its starts and ends reach
    their ``observe``, and a claim is answered once each answered whether it leads the same (``Holds.receive``)."""

    def __init__(self, id: str, delay: float = 0.01) -> None:
        self.id = id
        self.delay = delay
        self.others: list[Any] = []
        self.prefills: list[tuple[str, str, bool]] = []

    def tell(self, role: str, model: str, worker_url: str, text: str, head: int) -> None:
        raise AssertionError("Holds tells no routes")

    def tell_prefill(self, worker_url: str, prefix: str, *, done: bool, hurry: bool = False) -> None:
        self.prefills.append((worker_url, prefix, done))
        for other in self.others:
            asyncio.get_running_loop().call_later(self.delay, self._arrive, other, worker_url, prefix, done)

    def _arrive(self, other: Any, worker_url: str, prefix: str, done: bool) -> bool:
        _, leads = other.receive(self.id, [(worker_url, prefix, done)], serves=lambda url: True)
        return bool(leads)

    def claim(self, worker_url: str, prefix: str, answered: Callable[[list[str]], None]) -> None:
        self.prefills.append((worker_url, prefix, False))
        loop = asyncio.get_running_loop()
        waiting, leaders = set(map(id, self.others)), []

        def answer(other: Any, leads: bool) -> None:
            waiting.discard(id(other))
            if leads:
                leaders.append(other._peers.id)
            if not waiting:
                answered(leaders)

        def arrive(other: Any) -> None:
            loop.call_later(self.delay, answer, other, self._arrive(other, worker_url, prefix, False))

        for other in self.others:
            loop.call_later(self.delay, arrive, other)

    def in_sync(self) -> bool:
        return True


def _mesh(count: int, loads: Any, metrics: Metrics) -> list[Any]:
    """``count`` replicas' ``Holds`` (ids a, b, c, ...), each linked to every other, in sync."""
    from smg_router.coordination import Holds

    links = [_Link(chr(ord("a") + n)) for n in range(count)]
    holds = [Holds(seconds=5.0, metrics=metrics, peers=link, claim_seconds=1.0, loads=loads) for link in links]
    for link in links:
        link.others = [h for h in holds if h._peers is not link]
    for h in holds:
        for link in links:
            h.heard(link.id)
    return holds


async def test_replicas_in_sync_take_turns_on_a_slot_engines_prompt_between_them() -> None:
    """Two replicas whose requests on one prompt of a slot engine come within their round trip: each would run its
    own beside the other's (the engine gives the second another slot, prefills the prompt again and evicts what that
    slot held).  A first turn claims: the two that cross run one after the other (the lower id first, the other
    yields); a replica told of a peer's turn on the prompt waits for it; one that claims while the peer runs one (it
    answers so) yields to it; a claim whose client leaves stands no more."""
    from smg_router.coordination import Holds
    from smg_router.workers.load import LoadView

    worker, registry, metrics = _setup()
    url = worker.url
    loads = LoadView(max_age=10.0)
    loads.record_kv(worker.id, 8192, slots=2)
    a, b = _mesh(2, loads, metrics)
    running: set[str] = set()
    order: list[str] = []

    async def request(holds: Holds, name: str, prefix: str = "doc A", hold: float = 0.1) -> None:
        with AttemptGuard(worker, registry=registry, metrics=metrics) as g:
            holds.arrange(g, prefix, cold=False, streamed=False)
            await holds.wait(g, "m", "regular")
            assert not running, (name, running)  # never two on the prompt at once, whichever replica
            running.add(name)
            order.append(name)
            await asyncio.sleep(hold)
            running.discard(name)

    await asyncio.wait_for(asyncio.gather(request(b, "b1"), request(a, "a1")), 3)  # at once: they cross
    assert order == ["a1", "b1"]
    assert (_claims(metrics, "led"), _claims(metrics, "yielded")) == (2, 1)  # b claimed again once a1 ended
    await asyncio.sleep(0.05)
    assert not a._slots and not b._slots and not a._claims and not b._claims and not a._yielded and not b._yielded

    order.clear()
    first = asyncio.ensure_future(request(b, "b1", hold=0.2))
    await asyncio.sleep(0.03)  # b claimed and runs it; a was told
    await asyncio.wait_for(asyncio.gather(first, request(a, "a1")), 3)
    assert order == ["b1", "a1"]
    assert _sample(metrics, "timed_out") == 0 and _sample(metrics, "released") == 1  # held behind b's told turn
    assert (_claims(metrics, "led"), _claims(metrics, "yielded")) == (4, 1)  # a1's turn, after b's, claimed too
    assert not b.leads(url, "doc A")

    busy = asyncio.ensure_future(request(a, "a1", prefix="doc B", hold=0.3))
    gone = asyncio.ensure_future(request(b, "b1", prefix="doc B"))  # crosses it, yields
    await asyncio.sleep(0.05)
    assert (worker.id, "doc B") in b._yielded
    gone.cancel()  # its client left while it waited for a's turn
    await asyncio.gather(gone, return_exceptions=True)
    assert not b._yielded and not b._claims and not b._slots
    await asyncio.wait_for(busy, 3)


async def test_replicas_that_yielded_to_one_turn_claim_again_when_it_ends() -> None:
    """Three replicas whose first turns on one prompt cross: a (the lowest id) runs, b and c yield to it.  a's end
    releases both at once: each claims again (the crossing goes to the lower id), so they run one after the other,
    never side by side (the engine would give the second another slot)."""
    from smg_router.workers.load import LoadView

    worker, registry, metrics = _setup()
    loads = LoadView(max_age=10.0)
    loads.record_kv(worker.id, 8192, slots=2)
    a, b, c = _mesh(3, loads, metrics)
    running: set[str] = set()
    order: list[str] = []

    async def request(holds: Any, name: str, hold: float) -> None:
        with AttemptGuard(worker, registry=registry, metrics=metrics) as g:
            holds.arrange(g, "doc A", cold=False, streamed=False)
            await holds.wait(g, "m", "regular")
            assert not running, (name, running)
            running.add(name)
            order.append(name)
            await asyncio.sleep(hold)
            running.discard(name)

    first = asyncio.ensure_future(request(b, "b1", 0.3))
    await asyncio.sleep(0.005)  # b's claim is on its way: a and c claim before they are told of it
    others = [asyncio.ensure_future(request(h, n, 0.1)) for h, n in ((c, "c1"), (a, "a1"))]
    await asyncio.wait_for(asyncio.gather(first, *others), 5)
    assert order == ["a1", "b1", "c1"]  # the crossing to the lowest id; b and c, released by its end, cross again
    assert _sample(metrics, "timed_out") == 0
    await asyncio.sleep(0.05)
    assert not any(h._claims or h._yielded or h._slots or h._in_claim for h in (a, b, c))


def _slot_engine_holds(*heard: str) -> tuple[Any, ...]:
    """One worker, a slot engine (2 slots), and the ``Holds`` of replica "b" in sync with the peers ``heard``, whose
    claims the test answers (``_Told``): (worker, registry, metrics, loads, peers, holds)."""
    from smg_router.coordination import Holds
    from smg_router.workers.load import LoadView

    worker, registry, metrics = _setup()
    loads = LoadView(max_age=10.0)
    loads.record_kv(worker.id, 8192, slots=2)
    peers = _Told(id="b")
    holds = Holds(seconds=5.0, metrics=metrics, peers=peers, claim_seconds=5.0, loads=loads)
    for peer in heard:
        holds.heard(peer)
    return worker, registry, metrics, loads, peers, holds


async def test_a_turn_released_from_its_yield_leads_nothing_until_it_claims_again() -> None:
    """A first turn that yielded to a peer's, released by that turn's end: until its request claims again (its task
    goes on a loop pass later), the router answers a third replica's claim that it leads nothing (it answered that it
    led: two such replicas each yielded to the other and both waited for the hold's bound, 10 s).  A yielded claim
    whose peer's end never comes goes after the hold's bound (``timed_out``)."""
    from smg_router.coordination import Holds

    worker, registry, metrics, loads, peers, holds = _slot_engine_holds("a", "c")
    url = worker.url
    with AttemptGuard(worker, registry=registry, metrics=metrics) as g:
        holds.arrange(g, "doc A", cold=False, streamed=False)
        assert holds.leads(url, "doc A")  # claiming
        going = asyncio.ensure_future(holds.wait(g, "m", "regular"))
        await asyncio.sleep(0.01)
        peers.claims[url, "doc A"](["a"])  # a runs it: yield
        assert not holds.leads(url, "doc A")
        assert holds.observe(url, "doc A", done=True, peer="a")  # a's turn ended: released
        holds.observe(url, "doc A", done=False, peer="c")  # c's claim, before this request claims again
        assert not holds.leads(url, "doc A")
        await asyncio.sleep(0.01)
        assert not going.done() and holds.leads(url, "doc A")  # it claimed again
        peers.claims[url, "doc A"]([])
        await asyncio.wait_for(going, 1)
        assert holds.leads(url, "doc A")  # its request runs
    assert not holds.leads(url, "doc A")

    short = Holds(seconds=0.05, metrics=metrics, peers=_Told(id="b"), claim_seconds=5.0, loads=loads)
    short.heard("a")
    with AttemptGuard(worker, registry=registry, metrics=metrics) as g:
        short.arrange(g, "doc B", cold=False, streamed=False)
        going = asyncio.ensure_future(short.wait(g, "m", "regular"))
        await asyncio.sleep(0.01)
        short._peers.claims[url, "doc B"](["a"])  # type: ignore[attr-defined]
        await asyncio.wait_for(going, 1)  # a's end never came: it goes after the hold's bound
        assert _claims(metrics, "timed_out") == 1 and not short._yielded and not short._claims
        assert short.leads(url, "doc B")  # it runs


async def test_a_turn_whose_claim_went_leads_before_its_request_resumes() -> None:
    """A first turn's claim answered with no leader goes: from that moment the router answers a peer's claim on the
    prompt that it leads, though its request's task resumes a loop pass later.  It answered that it led nothing in
    that gap (the claim was gone, the turn still counted as in its claim): the peer's turn ran beside it and the engine
    gave the second another slot (4 replicas on 4 llama.cpp engines: 2-4 misses a run, found in per-claim
    logs).  Released from a yield instead, it still leads nothing until it claims again (the test above)."""
    worker, registry, metrics, _, peers, holds = _slot_engine_holds("a")
    url = worker.url
    with AttemptGuard(worker, registry=registry, metrics=metrics) as g:
        holds.arrange(g, "doc A", cold=False, streamed=False)
        going = asyncio.ensure_future(holds.wait(g, "m", "regular"))
        await asyncio.sleep(0.01)
        peers.claims[url, "doc A"]([])  # nobody leads it: the turn goes
        holds.observe(url, "doc A", done=False, peer="a")  # a's claim arrives before the request resumed
        assert holds.leads(url, "doc A")  # so a yields to it
        await asyncio.wait_for(going, 1)
        assert holds.leads(url, "doc A")  # its request runs
        assert _claims(metrics, "led") == 1
    assert not holds.leads(url, "doc A")
    assert not holds._slots and not holds._claims and not holds._in_claim


async def test_a_claim_made_again_tells_its_start_once_the_answers_to_the_one_before_came() -> None:
    """A first turn yields to a lower id's crossing claim and is released by that turn's end while the answers to its
    own claim are still on their way.  Those answers name the prompt, not the claim: claimed again, it tells its start
    only once they came (an old "a leads" taken for the new claim's would make it wait for an end already told), then
    goes on the new answers.  When the old answers are late past the claim's bound, it goes (``unanswered``) and
    tells its start then, unclaimed; the old answers, when they come, ask nothing."""
    from smg_router.coordination import Holds

    worker, registry, metrics, loads, peers, holds = _slot_engine_holds("a")
    url = worker.url
    with AttemptGuard(worker, registry=registry, metrics=metrics) as g:
        holds.arrange(g, "doc A", cold=False, streamed=False)
        first = peers.claims[url, "doc A"]
        going = asyncio.ensure_future(holds.wait(g, "m", "regular"))
        await asyncio.sleep(0.01)
        assert holds.observe(url, "doc A", done=False, peer="a")  # a's claim crossed it: it yields
        assert holds.observe(url, "doc A", done=True, peer="a")  # a's turn ended: released, it claims again
        await asyncio.sleep(0.01)
        assert peers.prefills == [(url, "doc A", False)] and peers.claims[url, "doc A"] is first  # not told yet
        assert holds.leads(url, "doc A") and not going.done()
        first(["a"])  # the answers to the first claim: a led then
        assert peers.prefills == [(url, "doc A", False)] * 2 and peers.claims[url, "doc A"] is not first
        assert holds.leads(url, "doc A") and not holds._yielded
        peers.claims[url, "doc A"]([])  # the answers to this claim: nobody leads it
        await asyncio.wait_for(going, 1)
        assert _claims(metrics, "led") == 1 and holds.leads(url, "doc A")  # its request runs
    assert not holds._slots and not holds._claims and not holds._asked

    late = _Told(id="b")
    short = Holds(seconds=5.0, metrics=metrics, peers=late, claim_seconds=0.05, loads=loads)
    short.heard("a")
    with AttemptGuard(worker, registry=registry, metrics=metrics) as g:
        short.arrange(g, "doc B", cold=False, streamed=False)
        first = late.claims[url, "doc B"]
        going = asyncio.ensure_future(short.wait(g, "m", "regular"))
        await asyncio.sleep(0.01)
        short.observe(url, "doc B", done=False, peer="a")
        short.observe(url, "doc B", done=True, peer="a")
        await asyncio.wait_for(going, 1)  # the first claim's answers never came within the bound: it goes
        assert _claims(metrics, "unanswered") == 1
        assert late.prefills == [(url, "doc B", False)] * 2 and late.claims[url, "doc B"] is first  # told unclaimed
        first(["a"])
        assert late.claims[url, "doc B"] is first and not short._asked and short.leads(url, "doc B")
    assert late.prefills[-1] == (url, "doc B", True)
