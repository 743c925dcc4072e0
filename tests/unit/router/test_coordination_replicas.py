"""Two and three replicas' ``coordination.Holds`` (the real class) linked by an in-memory transport, driven by
hypothesis: requests arrive, go, start, end, fail or are left by their client; the tells, claims and answers between
the replicas are delivered one at a time in whatever order hypothesis picks; heartbeats, and time passing (a virtual
clock: claims unanswered, holds past their bound, peers silent past STALE).

What must hold (the state table in docs/architecture.md, "Cache-aware decisions with several replicas"):
* while nothing excuses it (every replica in sync at its requests' arrival, no time passed, no request that ended
  before its first chunk, no cold request that cannot lead, no first turn whose client left in its claim), at most
  one request fleet-wide prefills a new prefix on its worker, and on a slot engine at most one request runs on a
  prompt at a time;
* once every message is delivered, nothing waits unless a request it can wait for is on its way (nothing waits
  forever);
* once every request ended and every message is delivered, no replica keeps anything of the prefix (no leak).

The transport delivers in order per direction, and each answer to a start separately, as ``PeerSync`` does; unlike
``PeerSync`` it never merges a start and its end in its queue.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from smg_router.attempt import AttemptGuard
from smg_router.coordination import Holds
from smg_router.coordination.transport import STALE
from smg_router.metrics import Metrics
from smg_router.workers.load import LoadView
from smg_router.workers.registry import WorkerRegistry
from support.policy_env import make_worker

HOLD_SECONDS = 10.0
CLAIM_SECONDS = 0.05
PREFIXES = ("doc A", "doc B")
COLD_CHARS = 4096
"""What a cold request is to prefill: over ``claim_min_chars``, so its lead claims."""


class _VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock moves only when the test says (``Holds`` reads the loop's time and timers)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def time(self) -> float:
        return self.now


@dataclass(eq=False)
class _Claim:
    waiting: set[str]
    answered: Callable[[list[str]], None]
    leaders: list[str] = field(default_factory=list)


class _Port:
    """One replica's ``Peers``: what it tells goes into the network's queues (``_Net``)."""

    def __init__(self, net: _Net, id: str) -> None:
        self.net = net
        self.id = id
        self.claims: dict[tuple[str, str], _Claim] = {}

    def tell(self, role: str, model: str, worker_url: str, text: str, head: int) -> None:
        pass  # the routes go to the policies, not to the holds

    def tell_prefill(self, worker_url: str, prefix: str, *, done: bool, hurry: bool = False) -> None:
        for other in self.net.ids:
            if other != self.id:
                self.net.queues[self.id, other].append((worker_url, prefix, done))

    def claim(self, worker_url: str, prefix: str, answered: Callable[[list[str]], None]) -> None:
        key = (worker_url, prefix)
        if (stale := self.claims.pop(key, None)) is not None:
            stale.answered(stale.leaders)
        self.claims[key] = _Claim({p for p in self.net.ids if p != self.id}, answered)
        self.tell_prefill(worker_url, prefix, done=False, hurry=True)

    def answered(self, peer: str, key: tuple[str, str], leader: str | None) -> None:
        claim = self.claims.get(key)
        if claim is None or peer not in claim.waiting:
            return
        claim.waiting.discard(peer)
        if leader is not None:
            claim.leaders.append(leader)
        if not claim.waiting:
            del self.claims[key]
            claim.answered(claim.leaders)

    def in_sync(self) -> bool:
        now = self.net.loop.time()
        return all(now - at < STALE for (src, _), at in self.net.acked.items() if src == self.id)


class _Net:
    """The replicas' messages in flight: per direction a queue of prefills, and the answers to the starts."""

    def __init__(self, loop: _VirtualLoop, ids: list[str]) -> None:
        self.loop = loop
        self.ids = ids
        self.queues: dict[tuple[str, str], deque[tuple[str, str, bool]]] = {
            (a, b): deque() for a in ids for b in ids if a != b
        }
        self.answers: dict[tuple[str, str], deque[tuple[tuple[str, str], str | None]]] = {
            (a, b): deque() for a in ids for b in ids if a != b
        }
        self.acked: dict[tuple[str, str], float] = {(a, b): float("-inf") for a in ids for b in ids if a != b}

    def idle(self) -> bool:
        return not any(self.queues.values()) and not any(self.answers.values())


@dataclass(eq=False)
class _Request:
    replica: int
    prefix: str
    streamed: bool
    guard: AttemptGuard
    task: asyncio.Task[None] | None = None
    sent: bool = False
    sent_cold: bool = False
    started: bool = False
    closed: bool = False


class Replicas(RuleBasedStateMachine):
    slots = False
    """Whether the worker is a slot engine (llama.cpp): requests on one prompt take turns."""
    clock = False
    """Whether time passes (else every claim is answered and nothing times out: the protocol's promise is whole)."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = _VirtualLoop()
        self.requests: list[_Request] = []
        self.cached: set[str] = set()
        """The prefixes the engine holds (a request on it started)."""
        self.excused: set[str] = set()
        """The prefixes for which something the protocol does not guarantee against happened (module docstring),
        until they are idle again."""

    # -- set-up and driving -----------------------------------------------------------------------------
    @initialize(count=st.sampled_from([2, 3]))
    def replicas(self, count: int) -> None:
        ids = [f"r{n}" for n in range(count)]
        self.net = _Net(self.loop, ids)
        self.ports = [_Port(self.net, i) for i in ids]
        self.metrics = Metrics()
        self.workers = [make_worker(2) for _ in ids]  # one engine, as each replica registered it
        self.registries = [WorkerRegistry() for _ in ids]
        self.holds: list[Holds] = []
        for port, worker, registry in zip(self.ports, self.workers, self.registries, strict=True):
            registry.add(worker)
            loads = LoadView(max_age=1e9)
            if self.slots:
                loads.record_kv(worker.id, 8192, slots=2)
            self.holds.append(
                Holds(
                    seconds=HOLD_SECONDS,
                    metrics=self.metrics,
                    peers=port,
                    claim_seconds=CLAIM_SECONDS,
                    claim_min_chars=1024,
                    loads=loads,
                )
            )
        for src in ids:
            for dst in ids:
                if src != dst:
                    self._heartbeat(src, dst)

    def _run(self, fn: Callable[[], object]) -> None:
        """``fn`` inside the loop (``Holds`` asks for the running loop), then everything it made ready."""

        async def call() -> None:
            fn()

        self.loop.run_until_complete(call())
        self._settle()

    def _settle(self) -> None:
        for _ in range(20):
            self.loop.run_until_complete(asyncio.sleep(0))

    def _heartbeat(self, src: str, dst: str) -> None:
        i = self.net.ids.index(dst)
        self._run(lambda: self.holds[i].receive(src, [], serves=lambda url: True))
        self.net.acked[src, dst] = self.loop.time()

    def _open(self, prefix: str) -> list[_Request]:
        return [r for r in self.requests if r.prefix == prefix and not r.closed]

    def _pick(self, which: int, ok: Callable[[_Request], bool]) -> _Request | None:
        chosen = [r for r in self.requests if ok(r)]
        return chosen[which % len(chosen)] if chosen else None

    def _close(self, r: _Request) -> None:
        if not (self.slots or r.started or r.prefix in self.cached):
            self.excused.add(r.prefix)  # an end before the first chunk releases the burst: it prefills side by side
        r.guard.close()
        r.closed = True

    async def _go(self, r: _Request) -> None:
        try:
            await self.holds[r.replica].wait(r.guard, "m", "regular")
        except asyncio.CancelledError:
            self._close(r)
            return
        r.sent = True
        r.sent_cold = r.prefix not in self.cached
        if r.sent_cold and not r.streamed and not self.slots:
            self.excused.add(r.prefix)  # a request that is not streamed never leads: it goes cold at once

    # -- rules ------------------------------------------------------------------------------------------
    @rule(replica=st.integers(0, 2), prefix=st.sampled_from(PREFIXES), streamed=st.booleans())
    def arrive(self, replica: int, prefix: str, streamed: bool) -> None:
        """A request routed to the worker (placement chose it; cold: the engine does not hold its prefix)."""
        replica %= len(self.holds)
        cold = prefix not in self.cached
        worker = self.workers[replica]
        guard = AttemptGuard(
            worker, registry=self.registries[replica], metrics=self.metrics, prefill_chars=COLD_CHARS if cold else 10
        )
        r = _Request(replica, prefix, streamed, guard)
        self.requests.append(r)
        if not self.ports[replica].in_sync():
            self.excused.add(prefix)

        def arrange() -> None:
            if streamed:
                guard.joins(prefix)
            self.holds[replica].arrange(guard, prefix, cold=cold, streamed=streamed)
            r.task = asyncio.get_running_loop().create_task(self._go(r))

        self._run(arrange)

    @precondition(lambda self: any(r.sent and not r.started and not r.closed for r in self.requests))
    @rule(which=st.integers(0, 50))
    def first_chunk(self, which: int) -> None:
        """The answer's first chunk: the engine prefilled the prompt and holds its prefix now."""
        r = self._pick(which, lambda r: r.sent and not r.started and not r.closed)
        assert r is not None
        r.started = True
        self.cached.add(r.prefix)
        self._run(r.guard.started)

    @precondition(lambda self: any(r.sent and not r.closed for r in self.requests))
    @rule(which=st.integers(0, 50), ok=st.booleans())
    def end(self, which: int, ok: bool) -> None:
        """The answer ends (``ok``: whole; else the worker failed or cut it off)."""
        r = self._pick(which, lambda r: r.sent and not r.closed)
        assert r is not None
        if ok:
            r.guard.answered(200)
            r.started = True
            self.cached.add(r.prefix)
        else:
            r.guard.failed()
        self._run(lambda: self._close(r))

    @precondition(lambda self: any(not r.sent and not r.closed for r in self.requests))
    @rule(which=st.integers(0, 50))
    def client_leaves(self, which: int) -> None:
        r = self._pick(which, lambda r: not r.sent and not r.closed)
        assert r is not None and r.task is not None
        holds, key = self.holds[r.replica], (r.guard.worker.id, r.prefix)
        if self.slots and r.guard.behind in (holds._claims.get(key), holds._yielded.get(key)):
            self.excused.add(r.prefix)  # its turn passes to the next request here, which does not claim it again
        r.task.cancel()
        self._settle()

    @precondition(lambda self: any(self.net.queues.values()))
    @rule(which=st.integers(0, 50))
    def deliver(self, which: int) -> None:
        """The first message of one direction reaches its peer: observed there, its start answered."""
        src, dst = [k for k, q in self.net.queues.items() if q][which % sum(1 for q in self.net.queues.values() if q)]
        url, prefix, done = self.net.queues[src, dst].popleft()
        holds = self.holds[self.net.ids.index(dst)]

        def receive() -> None:
            _, leads = holds.receive(src, [(url, prefix, done)], serves=lambda url: True)
            if not done:
                self.net.answers[dst, src].append(((url, prefix), dst if (url, prefix) in leads else None))

        self._run(receive)
        self.net.acked[src, dst] = self.loop.time()

    @precondition(lambda self: any(self.net.answers.values()))
    @rule(which=st.integers(0, 50))
    def answer(self, which: int) -> None:
        """A peer's answer to a start reaches the replica that told it."""
        busy = [k for k, q in self.net.answers.items() if q]
        peer, told = busy[which % len(busy)]
        key, leader = self.net.answers[peer, told].popleft()
        port = self.ports[self.net.ids.index(told)]
        self._run(lambda: port.answered(peer, key, leader))

    @rule(src=st.integers(0, 2), dst=st.integers(0, 2))
    def heartbeat(self, src: int, dst: int) -> None:
        ids = self.net.ids
        if src % len(ids) != dst % len(ids):
            self._heartbeat(ids[src % len(ids)], ids[dst % len(ids)])

    @precondition(lambda self: self.clock)
    @rule(seconds=st.sampled_from([0.01, CLAIM_SECONDS + 0.01, 1.0, STALE + 0.1, HOLD_SECONDS + 0.1]))
    def time_passes(self, seconds: float) -> None:
        """Claims go unanswered past their bound, holds time out, a peer heard of no more is silent."""
        self.excused.update(r.prefix for r in self.requests if not r.closed)
        self.excused.update(prefix for _, prefix, _ in (m for q in self.net.queues.values() for m in q))
        self.excused.update(prefix for (_, prefix), _ in (m for q in self.net.answers.values() for m in q))
        self.loop.now += seconds
        self._settle()

    @precondition(lambda self: any(not self._open(p) for p in self.cached))
    @rule(prefix=st.sampled_from(PREFIXES))
    def engine_evicts(self, prefix: str) -> None:
        """The engine forgets a prefix nobody is using: the next request on it is cold again."""
        if not self._open(prefix):
            self.cached.discard(prefix)

    # -- what must hold ---------------------------------------------------------------------------------
    @invariant()
    def one_prefill_a_burst(self) -> None:
        if not hasattr(self, "net"):
            return
        for prefix in PREFIXES:
            if not self._open(prefix) and self.net.idle():
                self.excused.discard(prefix)
            if prefix in self.excused:
                continue
            if self.slots:
                running = [r for r in self._open(prefix) if r.sent]
                assert len(running) <= 1, f"{len(running)} requests run on the prompt {prefix!r} at once"
            else:
                prefilling = [r for r in self._open(prefix) if r.sent_cold and not r.started]
                assert len(prefilling) <= 1, f"{len(prefilling)} requests prefill {prefix!r} at once"

    @invariant()
    def nothing_waits_forever(self) -> None:
        if not hasattr(self, "net") or not self.net.idle():
            return
        for prefix in PREFIXES:
            waiting = [r for r in self._open(prefix) if not r.sent]
            on_its_way = [r for r in self._open(prefix) if r.sent and (self.slots or not r.started)]
            assert not waiting or on_its_way, f"{len(waiting)} requests on {prefix!r} wait for nothing"

    @invariant()
    def nothing_left_behind(self) -> None:
        if not hasattr(self, "net") or not self.net.idle() or any(not r.closed for r in self.requests):
            return
        for n, holds in enumerate(self.holds):
            kept = {
                name: getattr(holds, name)
                for name in (
                    "_slots",
                    "_turns",
                    "_leading",
                    "_told",
                    "_claims",
                    "_yielded",
                    "_rivals",
                    "_in_claim",
                    "_asked",
                )
                if getattr(holds, name)
            }
            assert not kept, f"replica {n} keeps {kept}"
            assert not self.ports[n].claims, f"replica {n}'s claims are never answered"
            assert not self.workers[n].held and not self.workers[n].joining

    def teardown(self) -> None:
        tasks = [r.task for r in self.requests if r.task is not None and not r.task.done()]
        for task in tasks:
            task.cancel()
        self._settle()
        self.loop.close()


class ReplicasWithTime(Replicas):
    clock = True


class SlotReplicas(Replicas):
    slots = True


class SlotReplicasWithTime(Replicas):
    slots = clock = True


_EXPLORE = int(os.environ.get("SMG_EXPLORE_EXAMPLES", "0"))
"""A wider random search (``SMG_EXPLORE_EXAMPLES=1500``): its finds become replayed tests below.  The suite's own
run draws the same examples every time, so it fails on a change that breaks them, never on the luck of a draw."""
_SETTINGS = settings(
    max_examples=_EXPLORE or 150,
    stateful_step_count=60 if _EXPLORE else 40,
    derandomize=not _EXPLORE,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestReplicasInSyncPrefillANewPrefixOnce = Replicas.TestCase
TestReplicasPrefillOnceUntilTimeExcusesThem = ReplicasWithTime.TestCase
TestReplicasInSyncTakeTurnsOnASlotEnginesPrompt = SlotReplicas.TestCase
TestReplicasTakeTurnsUntilTimeExcusesThem = SlotReplicasWithTime.TestCase
for _case in (
    TestReplicasInSyncPrefillANewPrefixOnce,
    TestReplicasPrefillOnceUntilTimeExcusesThem,
    TestReplicasInSyncTakeTurnsOnASlotEnginesPrompt,
    TestReplicasTakeTurnsUntilTimeExcusesThem,
):
    _case.settings = _SETTINGS
    pytest.mark.timeout(60)(_case)
del _case


# -- the random search's finds, replayed step by step (and their kin on a lead, found by hand) ----------
def _replay(state: Replicas, *steps: Callable[[], object]) -> None:
    """Run the state machine's rules in this order, its invariants checked after each, as hypothesis runs them."""
    try:
        for step in steps:
            step()
            state.one_prefill_a_burst()
            state.nothing_waits_forever()
            state.nothing_left_behind()
    finally:
        state.teardown()


def test_a_turn_claimed_again_takes_no_answer_to_its_first_claim_for_its_own() -> None:
    """r1's first turn claims, yields to r0's crossing claim and is released by r0's end while r0's answer to that
    first claim ("r0 leads") is still on its way; its claim made again must not take that answer for its own, or it
    waits for an end r0 already told."""
    state = SlotReplicas()
    _replay(
        state,
        lambda: state.replicas(count=2),
        lambda: state.arrive(prefix="doc A", replica=0, streamed=False),
        lambda: state.arrive(prefix="doc A", replica=1, streamed=False),
        lambda: state.deliver(which=0),
        lambda: state.answer(which=0),
        lambda: state.deliver(which=0),
        lambda: state.end(ok=False, which=0),
        lambda: state.deliver(which=0),
        lambda: state.answer(which=0),
        lambda: state.deliver(which=0),
        lambda: state.answer(which=0),
    )


def test_a_lead_claimed_again_takes_no_answer_to_the_claim_before_it_for_its_own() -> None:
    """The same without slots: r1's lead claims, yields to r0's lead and goes at its end, fails before its first
    chunk; the engine evicts the prefix, and r1's next lead claims while r0's answer to the first claim ("r0
    leads") is still on its way."""
    state = Replicas()
    _replay(
        state,
        lambda: state.replicas(count=2),
        lambda: state.arrive(prefix="doc A", replica=0, streamed=True),
        lambda: state.arrive(prefix="doc A", replica=1, streamed=True),
        lambda: state.deliver(which=1),
        lambda: state.deliver(which=0),
        lambda: state.first_chunk(which=0),
        lambda: state.deliver(which=0),
        lambda: state.end(ok=False, which=1),
        lambda: state.end(ok=True, which=0),
        lambda: state.deliver(which=0),
        lambda: state.engine_evicts(prefix="doc A"),
        lambda: state.arrive(prefix="doc A", replica=1, streamed=True),
        lambda: state.answer(which=0),
        lambda: state.deliver(which=0),
        lambda: state.answer(which=0),
        lambda: state.answer(which=0),
    )
