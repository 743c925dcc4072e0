"""The first prefill of a new prefix, per replica: leads, holds, turns and claims (``Holds``; the state table of one
(worker, prefix) is in docs/architecture.md, "Cache-aware decisions with several replicas").

Called by the request path (``attempt.Attempts`` arranges each attempt, the caller awaits ``wait`` before it sends)
and by the admin handler of ``POST /peers/routes`` (``receive``); it tells the peers through ``base.Peers``.

A burst on one new prefix: requests that arrive together with the same leading chars are all routed to the worker
that takes the first, which has not cached them yet; sent at once, each would prefill the whole prefix again (an
engine caches a prompt once its prefill is done).  So the first streamed request sent to a worker that did not hold
its prefix (``Decision.cold``) leads, and the requests routed after it to the same worker with the same leading chars
(``Decision.prefix``) wait, up to ``--prefill-hold-seconds``, until its answer starts (its first streamed chunk: the
engine has prefilled it) or it ends, then go out and find the prefix cached.  A request that is not streamed never
leads: the router sees its prefill end only with its whole answer.  With peers a replica tells the others when one of
its requests leads a prefill and when that prefill ends (``Peers.tell_prefill``), and holds its own requests behind
the leads it is told of (``observe``) as behind its own: a burst that a Service spreads over the replicas is
prefilled once, not once a replica.  A lead told by a peer whose end never comes is dropped after
``--prefill-hold-seconds``, or sooner once that peer fell silent (PEER_SILENCE).

A burst that a Service spreads over the replicas reaches each of them within a millisecond, before any lead can be
told: each replica would lead a prefill of its own.  So a replica in sync with its peers claims a lead first: its
leading request waits until every peer answered the start (``Peers.claim``: one round trip), at most
``--prefill-claim-seconds``.  It yields, waits for that other prefill, then goes and finds the prefix cached, if a
peer answers that it leads the same prefix on the same worker, or if a peer with a lower router id tells of such a
lead meanwhile (two claims that cross: the lower id leads, the other yields; ``smg_prefill_claims_total``).  The
replica whose id is the lowest of the peers heard lately never yields, so its leads do not wait.  A peer's answer
names the worker and the leading chars, not the claim: a replica tells the start of a claim there only once every
answer to its last claim there came (``_ask``), else an old "leads" would be taken for the new claim's.

An engine that keeps one prompt's KV per slot (llama.cpp: ``LoadView.slots``) gives a request whose prompt's slot is
busy another slot, which prefills the whole prompt again and evicts the prompt that slot held.  So on such an engine
the requests with the same leading chars take turns (``_Slot``), streamed or not: one runs, the others wait, at most
``--prefill-hold-seconds``, until it ends, then the first of them goes and finds its prompt in its slot.  With peers
the turns are told as leads (their ends when they end), and a replica's requests wait behind a peer's as behind a
prefill, then take their turns among themselves.  Two replicas' requests on one prompt within a round trip would still
run side by side, so a replica in sync claims its first turn on a prompt as a lead is claimed (the lowest id too): it
yields to a peer that runs or claims a turn there, and once that turn's end releases it, claims again, since every
replica that yielded to the same turn is released by the same end (``_rivals``); a turn still in its claim is no lead
in the answers (``_Slot.pending``), and one whose claim went is a lead from that moment (``_in_claim``, ``_settle``),
not from when its request's task resumes.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

from smg_router.coordination.base import NO_PEERS, Peers
from smg_router.coordination.messages import Lead, Prefill
from smg_router.metrics import Metrics
from smg_router.workers.load import LoadView
from smg_router.workers.worker import Worker, worker_id_for


class Held(Protocol):
    """What the holds need of one attempt (``attempt.AttemptGuard``): its worker, the chars it is to prefill, a place
    to wait (``hold``/``unhold``) and the hooks its start and its end call."""

    worker: Worker
    on_started: Callable[[], None] | None
    on_closed: Callable[[], None] | None
    behind: asyncio.Future[None] | None

    @property
    def prefill_chars(self) -> int: ...

    @property
    def held_under(self) -> str | None: ...

    def hold(self, ahead: asyncio.Future[None], prefix: str) -> None: ...

    def unhold(self) -> None: ...


PEER_SILENCE = 3.5
"""Seconds without a batch from a peer router (its heartbeat comes every second: ``transport.HEARTBEAT``) after which
the leads it told of are dropped: it went away, and the ends of its prefills with it."""


class _Told:
    """A lead a peer told of: which peer, until when it stands at most, the timer that checks it."""

    __slots__ = ("deadline", "peer", "timer")

    def __init__(self, peer: str, deadline: float) -> None:
        self.peer = peer
        self.deadline = deadline
        self.timer: asyncio.TimerHandle | None = None


class _Slot:
    """The requests with the same leading chars on one slot engine: how many run (one, but for a wait past its
    bound), the turns of those waiting, in order."""

    __slots__ = ("pending", "running", "turns")

    def __init__(self) -> None:
        self.running = 0
        self.pending = 0
        """Of ``running``, the turns still in their claim (claiming, yielded, or released and about to claim
        again): counted so that this router's others on the prompt wait behind them, not sent yet."""
        self.turns: deque[asyncio.Future[None]] = deque()


class Holds:
    """The bursts in prefill: per worker, the leading chars of each streamed request that brings them to the worker
    and has not started its answer yet (module docstring)."""

    def __init__(
        self,
        *,
        seconds: float,
        metrics: Metrics,
        peers: Peers = NO_PEERS,
        claim_seconds: float = 0.0,
        claim_min_chars: int = 1024,
        loads: LoadView | None = None,
    ) -> None:
        self.seconds = seconds
        """The longest a request waits for the prefill it is behind; 0: nobody waits."""
        self.claim_seconds = claim_seconds
        """How long a lead of this router waits at most for its peers' answers to its claim; 0: it does not claim."""
        self.claim_min_chars = claim_min_chars
        """A lead claims only when its worker is to prefill at least this many chars: a shorter prefill done twice
        costs the engine less than a claim's round trip costs the routers."""
        self._metrics = metrics
        self._peers = peers
        self._loads = loads
        """Which workers are slot engines (``LoadView.slots``); None: none is."""
        self._slots: dict[tuple[str, str], _Slot] = {}
        """(worker id, leading chars) -> the turns there, on a slot engine."""
        self._turns: dict[asyncio.Future[None], _Slot] = {}
        """A turn waited for -> its slot (``wait``)."""
        self._leading: dict[str, dict[str, asyncio.Future[None]]] = {}
        """worker id -> leading chars -> released when the request that brought them there starts its answer."""
        self._told: dict[asyncio.Future[None], _Told] = {}
        """The leads a peer told of (``observe``), until their end is told or they are dropped."""
        self._heard: dict[str, float] = {}
        """Peer router id -> when a batch of it last came (``heard``; its heartbeat comes every second)."""
        self._claims: dict[tuple[str, str], asyncio.Future[None]] = {}
        """(worker id, leading chars) -> the gate of a lead of this router in its claim (``claim_seconds``)."""
        self._yielded: dict[tuple[str, str], asyncio.Future[None]] = {}
        """(worker id, leading chars) -> the gate of a lead of this router that yielded to a peer's, until that
        prefill ends (its ``_Told`` is in ``_told``)."""
        self._rivals: set[asyncio.Future[None]] = set()
        """Gates of claims that a peer's lead or turn stopped (it yielded, or that one's end came first): whoever else
        waited for the same end goes with it, so a turn's claim is made again (``wait``)."""
        self._asked: dict[tuple[str, str], asyncio.Future[None]] = {}
        """(worker id, leading chars) -> the gate of the claim this router told its peers there last, until they all
        answered it (``_ask``), whether or not that claim still stands."""
        self._in_claim: dict[asyncio.Future[None], _Slot] = {}
        """The gate of a turn in its claim -> its slot, whose ``pending`` counts it until the claim goes (``_claimed``:
        from then on the router answers that it leads, though the request's task resumes a loop pass later) or its
        request stops waiting (``_settle``)."""

    def arrange(self, guard: Held, prefix: str | None, *, cold: bool, streamed: bool) -> None:
        """Put a just opened attempt behind the burst it belongs to, or make it lead one."""
        if prefix is None or self.seconds <= 0:
            return
        worker = guard.worker
        leading = self._leading.get(worker.id)
        if leading is not None and (ahead := leading.get(prefix)) is not None:
            guard.hold(ahead, prefix)
        elif self._loads is not None and self._loads.slots(worker.id) is not None:
            self._take_turn(guard, prefix)
        elif cold and streamed:
            worker_id, url = worker.id, worker.url
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._leading.setdefault(worker_id, {})[prefix] = done
            guard.on_started = lambda: self._release(worker_id, prefix, done, url)
            if self._claiming() and guard.prefill_chars >= self.claim_min_chars and not self._lowest():
                self._claim(guard, prefix)
            else:
                self._peers.tell_prefill(url, prefix, done=False)

    def _claiming(self) -> bool:
        """Whether this router's leads and first turns wait for its peers' answers (it is in sync with them)."""
        return self.claim_seconds > 0 and self._peers.in_sync()

    def _claim(self, guard: Held, prefix: str, slot: _Slot | None = None) -> None:
        """Hold ``guard`` (a lead, or a first turn of ``slot``) until every peer answered its start, at most
        ``claim_seconds``: it yields if one of them leads the same (``_answered``, ``observe``).  Its start waits
        for the answers to this router's claim before it on the same, if they have not all come (``_ask``)."""
        loop = asyncio.get_running_loop()
        key = (guard.worker.id, prefix)
        gate: asyncio.Future[None] = loop.create_future()
        if slot is not None:
            self._in_claim[gate] = slot
        self._claims[key] = gate
        guard.hold(gate, prefix)
        loop.call_later(self.claim_seconds, self._unanswered, key, gate, guard.worker.url)
        if key not in self._asked:
            self._ask(key, gate, guard.worker.url)

    def _ask(self, key: tuple[str, str], gate: asyncio.Future[None], url: str) -> None:
        """Tell the peers the start of the claim ``gate``.  The peers' answers name no claim, only its (worker,
        leading chars): an answer to an earlier claim on the same, still on its way, would be taken for this one's
        (a peer that led then, and whose end came since, would be yielded to for an end that never comes).  So one
        claim on the same is asked at a time: a later one is asked once the answers to this one came, if it still
        stands."""
        self._asked[key] = gate

        def answered(leaders: list[str]) -> None:
            if self._asked.get(key) is gate:
                del self._asked[key]
            self._answered(key, gate, leaders)
            if (later := self._claims.get(key)) is not None and key not in self._asked:
                self._ask(key, later, url)

        self._peers.claim(url, key[1], answered)

    def _take_turn(self, guard: Held, prefix: str) -> None:
        """On a slot engine: run at once when no request with these leading chars runs or waits there, else wait
        for a turn.  A first turn of a router in sync with its peers claims it first: a peer's request on the same
        prompt within a round trip would take another slot (the claim's tie between two routers goes to the lower
        id, and the lowest claims too: a turn that a peer runs already is never run beside it)."""
        key = (guard.worker.id, prefix)
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = _Slot()
        if slot.running == 0 and not slot.turns:
            if self._claiming():
                slot.running += 1  # the claim has the turn: this router's others on the prompt wait behind it
                slot.pending += 1
                self._run(guard, prefix, slot, counted=True)
                self._claim(guard, prefix, slot)
            else:
                self._run(guard, prefix, slot)
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        slot.turns.append(turn)
        self._turns[turn] = slot
        guard.hold(turn, prefix)

    def _run(self, guard: Held, prefix: str, slot: _Slot, *, counted: bool = False) -> None:
        """``guard`` runs on its slot engine until it closes (``counted``: its turn came, and counted it)."""
        worker_id, url = guard.worker.id, guard.worker.url
        if not counted:
            if slot.running == 0:  # at once: a peer's request on the same prompt would take another slot meanwhile
                self._peers.tell_prefill(url, prefix, done=False, hurry=True)
            slot.running += 1
        guard.on_closed = lambda: self._next_turn(worker_id, url, prefix, slot)

    def _next_turn(self, worker_id: str, url: str, prefix: str, slot: _Slot) -> None:
        """A request that ran on a slot engine closed (or left as its turn came): the first one still waiting has
        its turn, counted running from now."""
        slot.running -= 1
        while slot.turns:
            turn = slot.turns.popleft()
            self._turns.pop(turn, None)
            if not turn.done():
                slot.running += 1
                turn.set_result(None)
                return
        if slot.running == 0:  # at once: a peer's requests on the prompt may wait for it
            self._peers.tell_prefill(url, prefix, done=True, hurry=True)
            if self._slots.get((worker_id, prefix)) is slot:
                del self._slots[worker_id, prefix]

    def _lowest(self) -> bool:
        """Whether this router's id is below every id heard lately: a lead of its own never yields."""
        now = asyncio.get_running_loop().time()
        own = self._peers.id
        return all(own < peer for peer, at in self._heard.items() if now - at < PEER_SILENCE)

    def _answered(self, key: tuple[str, str], gate: asyncio.Future[None], leaders: list[str]) -> None:
        """Every peer answered a claim: it yields to one that leads the same, else its lead goes."""
        if leaders and self._claims.get(key) is gate:
            self._yield(key, gate, min(leaders))
        else:
            self._claimed(key, gate, "led")

    def _claimed(self, key: tuple[str, str], gate: asyncio.Future[None], outcome: str) -> None:
        """A claim's lead goes (``outcome``: led, every peer answered; unanswered, its bound passed first), unless it
        yielded or went already."""
        if self._claims.get(key) is gate:
            del self._claims[key]
        if gate not in self._told and not gate.done():
            gate.set_result(None)
            if gate not in self._rivals:  # it goes: a turn's claim leads from now (a rival's claims again)
                self._settle(gate)
            self._metrics.prefill_claims.labels(outcome).inc()

    def _unanswered(self, key: tuple[str, str], gate: asyncio.Future[None], url: str) -> None:
        """A claim's bound passed: it goes unless it went already (``_claimed``).  One whose start still waited for
        the answers to an earlier claim on the same (``_ask``) tells it now, unclaimed: the peers hold behind it."""
        unasked = self._claims.get(key) is gate and self._asked.get(key) is not gate
        self._claimed(key, gate, "unanswered")
        if unasked:
            self._peers.tell_prefill(url, key[1], done=False, hurry=True)

    def _yield(self, key: tuple[str, str], gate: asyncio.Future[None], peer: str) -> None:
        """This router's claim on ``key`` yields to the peer ``peer``'s lead: it goes when that prefill ends."""
        del self._claims[key]
        self._yielded[key] = gate
        self._rivals.add(gate)
        self._metrics.prefill_claims.labels("yielded").inc()
        self._tell(gate, *key, peer)

    def _settle(self, gate: asyncio.Future[None]) -> None:
        """A turn's claim is over (it goes, or its request stopped waiting): its slot counts it in its claim no more."""
        if (slot := self._in_claim.pop(gate, None)) is not None:
            slot.pending -= 1

    def _drop_claim(self, key: tuple[str, str], gate: asyncio.Future[None]) -> None:
        """A claim whose request stopped waiting for it (its client left, or it yielded past the hold's bound): it
        stands no more, so a later one on the same is answered and claimed afresh."""
        if self._claims.get(key) is gate:
            del self._claims[key]
        if self._yielded.get(key) is gate:
            self._release(*key, gate)
        self._rivals.discard(gate)

    def heard(self, peer: str) -> None:
        """A batch came from the peer router ``peer`` (its id): its leads stand (``observe``)."""
        now = self._heard[peer] = asyncio.get_running_loop().time()
        if len(self._heard) > 64:  # ids of peers that restarted long ago
            self._heard = {p: at for p, at in self._heard.items() if now - at < 2 * PEER_SILENCE}

    def receive(
        self, sender: str, prefills: Iterable[Prefill], *, serves: Callable[[str], bool]
    ) -> tuple[int, list[Lead]]:
        """A peer's batch (``POST /peers/routes``): its sender heard (every batch, the heartbeat too: its leads
        stand), then each of its prefills observed on a worker this router ``serves`` (the others are not held
        behind).  How many changed anything, and the starts told that this router leads itself (the answer: the
        peer's claim on one of them yields)."""
        self.heard(sender)
        applied = 0
        leads: list[Lead] = []
        for url, prefix, done in prefills:
            if serves(url):
                applied += self.observe(url, prefix, done=done, peer=sender)
                if not done and self.leads(url, prefix):
                    leads.append((url, prefix))
        return applied, leads

    def observe(self, worker_url: str, prefix: str, *, done: bool, peer: str = "") -> bool:
        """The peer router ``peer``'s request leads the first prefill of ``prefix`` on the worker (``done`` False:
        this router's requests with those leading chars wait for it there), or that prefill ended (``done`` True:
        they go).  A lead is dropped after ``seconds``, or once nothing came from its peer for PEER_SILENCE (the
        peer is gone, and the end with it).  A lead of this router's own for the same is left alone, unless it is in
        its claim: it yields to a lower id's lead, and goes at once on any end (the worker holds the prefix then).
        Whether it changed anything."""
        if self.seconds <= 0:
            return False
        worker_id = worker_id_for(worker_url)
        key = (worker_id, prefix)
        ahead = self._leading.get(worker_id, {}).get(prefix)
        if done:  # whichever peer's it is, the worker holds the prefix now
            if (gate := self._yielded.get(key)) is not None:
                self._release(worker_id, prefix, gate)
            elif (gate := self._claims.get(key)) is not None:  # ended before this claim was answered: it goes
                self._rivals.add(gate)
                self._claimed(key, gate, "yielded")
            if ahead is None or ahead not in self._told:
                return gate is not None
            self._release(worker_id, prefix, ahead)
            return True
        if (gate := self._claims.get(key)) is not None:
            if not peer < self._peers.id:
                return False  # the peer yields to this claim
            self._yield(key, gate, peer)  # two claims crossed: the lower id leads
            return True
        if ahead is not None:
            return False
        lead: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._leading.setdefault(worker_id, {})[prefix] = lead
        self._tell(lead, worker_id, prefix, peer)
        return True

    def _tell(self, lead: asyncio.Future[None], worker_id: str, prefix: str, peer: str) -> None:
        """``lead`` stands for a peer's lead: it is released by its end, its bound or its peer's silence."""
        loop = asyncio.get_running_loop()
        self._heard.setdefault(peer, loop.time())
        told = self._told[lead] = _Told(peer, loop.time() + self.seconds)
        told.timer = loop.call_later(min(self.seconds, PEER_SILENCE), self._check, worker_id, prefix, lead)

    def _check(self, worker_id: str, prefix: str, lead: asyncio.Future[None]) -> None:
        """A peer's lead, a while after it came: dropped past its bound or once its peer fell silent."""
        told = self._told.get(lead)
        if told is None:
            return
        now = asyncio.get_running_loop().time()
        silent_until = self._heard.get(told.peer, now) + PEER_SILENCE
        if now >= told.deadline or now >= silent_until:
            self._release(worker_id, prefix, lead)
            return
        wake = min(told.deadline, silent_until) - now
        told.timer = asyncio.get_running_loop().call_later(wake, self._check, worker_id, prefix, lead)

    def _release(self, worker_id: str, prefix: str, done: asyncio.Future[None], url: str | None = None) -> None:
        """The lead ``done`` ends: its own (``url``: then the peers are told) or a peer's (its timer cancelled)."""
        leading = self._leading.get(worker_id)
        if leading is not None and leading.get(prefix) is done:
            del leading[prefix]
            if not leading:
                del self._leading[worker_id]
        if self._yielded.get((worker_id, prefix)) is done:
            del self._yielded[worker_id, prefix]
        if (told := self._told.pop(done, None)) is not None and told.timer is not None:
            told.timer.cancel()
        if not done.done():
            done.set_result(None)
            if url is not None:
                self._peers.tell_prefill(url, prefix, done=True)

    async def wait(self, guard: Held, model: str, role: str) -> None:
        """Wait, at most ``seconds``, for the prefill the attempt is behind (none: at once; the request path asks
        only when ``guard.behind`` is set)."""
        ahead = guard.behind
        if ahead is None:
            return
        prefix = guard.held_under or ""
        slot = self._turns.get(ahead)  # None: behind a prefill or in its claim, not waiting for a turn
        turn_claim = slot is None and guard.on_closed is not None
        claim = turn_claim or guard.on_started is not None
        """A lead's or a first turn's claim (counted in prefill_claims, not in prefill_holds)."""
        worker = guard.worker
        try:
            if not ahead.done():
                await asyncio.wait((ahead,), timeout=self.seconds)  # never cancels it: others may wait on it too
        except asyncio.CancelledError:  # the client left
            if slot is not None:
                if ahead.done():  # as its turn came: the next one's
                    self._next_turn(worker.id, worker.url, prefix, slot)
                else:
                    ahead.cancel()  # no turn for it any more
                    self._turns.pop(ahead, None)
            elif claim:
                self._drop_claim((worker.id, prefix), ahead)
                self._settle(ahead)
            raise
        finally:
            guard.unhold()
        released = ahead.done()
        if slot is not None:
            if not released:  # the bound passed: it runs beside the one it waited for
                ahead.cancel()
                self._turns.pop(ahead, None)
            self._run(guard, prefix, slot, counted=released)
        if not claim:
            self._metrics.prefill_holds.labels(model, role, "released" if released else "timed_out").inc()
        elif not released:
            self._metrics.prefill_claims.labels("timed_out").inc()
            self._drop_claim((worker.id, prefix), ahead)
        elif ahead in self._rivals:
            self._rivals.discard(ahead)
            if turn_claim:  # the turn it yielded to ended: a peer's claim that yielded to the same goes now too
                self._claim(guard, prefix, self._in_claim.pop(ahead, None))
                await self.wait(guard, model, role)
                return
        self._settle(ahead)  # the request goes
        if (
            slot is None
            and not claim
            and prefix
            and self._loads is not None
            and self._loads.slots(worker.id) is not None
        ):
            self._take_turn(guard, prefix)  # a peer's turn ended: this replica's requests on it still take turns
            if guard.behind is not None:
                await self.wait(guard, model, role)

    def leads(self, worker_url: str, prefix: str) -> bool:
        """Whether a request of this router leads the first prefill of ``prefix`` on the worker, or has the turn of its
        prompt there on a slot engine (claiming or sent), not yielded: what a peer's claim on the same is answered
        (``receive``)."""
        worker_id = worker_id_for(worker_url)
        key = (worker_id, prefix)
        if key in self._yielded:
            return False
        if key in self._claims:
            return True
        ahead = self._leading.get(worker_id, {}).get(prefix)
        slot = self._slots.get(key)
        return (ahead is not None and ahead not in self._told) or (slot is not None and slot.running > slot.pending)

    def leading(self) -> int:
        """How many bursts are in their first prefill (for tests)."""
        return sum(map(len, self._leading.values()))
