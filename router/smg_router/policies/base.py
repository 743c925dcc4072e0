"""The policy interface and what every instance is built with.

A policy chooses one worker among routable candidates.  It is told which workers it can reach through
``sync`` (the one lifecycle path calls it after every add, update and removal) and never learns of
workers any other way.  ``decide`` is synchronous: the event loop is the lock.

``route`` is what the request path calls, and its answer is a value, a ``Decision``: the worker and why.  A
request with a routing key (a session key, a previous response id) is pinned by ``sticky`` the same way whatever
the policy, then the policy records the choice (``pinned``); every other request gets the policy's own
``decide``.  ``select`` is ``decide``'s worker alone, for callers that need no more.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from smg_router.metrics import Metrics
from smg_router.policies.index import EventIndexes
from smg_router.policies.sticky import pin
from smg_router.settings import PolicySettings
from smg_router.workers.load import LoadView
from smg_router.workers.worker import Worker

NAMESPACE_MARK = "\x00"
"""A routing text that starts with this is in a cache namespace of its own (``request.cache_namespace``)."""


class RouteRequest(Protocol):
    """What a policy may look at: the model key, the routing text (the whole prompt) and its head.

    The request path's one record (``request.ProxyRequest``) satisfies it; policies never see HTTP.
    """

    @property
    def model(self) -> str: ...
    @property
    def text(self) -> str: ...
    @property
    def head(self) -> int:
        """Length of the text's head: the part later turns of the same conversation repeat (0: unknown)."""
        ...

    @property
    def tokens(self) -> Sequence[int] | None:
        """The token ids of the engine's prompt, when the router knows them (``prompts``); None: text only."""
        ...

    @property
    def namespace(self) -> str:
        """The namespace of the prompt's KV blocks on the engine (``tree.blocks.namespace_of``: its LoRA adapter,
        its cache salt); "" for none."""
        ...

    @property
    def routing_key(self) -> str | None:
        """A key that pins the request to a worker by rendezvous hashing (``sticky``); None: the policy chooses."""
        ...

    @property
    def worker_hint(self) -> str | None:
        """Id of a worker known to hold the request's state (the producer of its previous response), or None."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """One routing decision: the chosen worker and what the request path needs to know of why.

    Read by ``attempt.Attempts.open``: the chars the worker is expected to prefill (``Worker.prefill_chars``), and
    the prompt's placement prefix with whether the worker held it (a burst on one new prefix waits for its first
    prefill: ``coordination.Holds``)."""

    worker: Worker
    branch: str
    """Which rule chose it: cache_aware's ``hit``, ``miss``, ``spill``, ``namespace``; ``session`` or
    ``stored`` when a routing key pinned it; the policy's name for a policy that keeps no state of prompts."""
    matched: int = 0
    """Chars of the prompt the chosen worker holds, as the policy's cache index says (0: none, or not known)."""
    prefill: int | None = None
    """Chars the chosen worker is expected to prefill (the prompt's part it does not hold); None: the whole text."""
    prefix: str | None = None
    """The leading chars by which the policy knows the prompt (what placement hashes); None: it keeps no prefixes."""
    cold: bool = False
    """Whether the chosen worker did not hold ``prefix`` before this request (a miss or a spill)."""
    fallback: str | None = None
    """Why the policy's first choice was not taken (``imbalance``, ``stale_tenant``), if it was not."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyContext:
    """Handed to every instance by the factory; an instance cannot be built without it."""

    settings: PolicySettings
    loads: LoadView
    metrics: Metrics
    role: str
    """The policy slot: regular, prefill or decode (the ``role`` label of its metrics)."""
    rng: random.Random
    events: EventIndexes | None = None
    """The workers matched by their engines' KV events, when the router subscribes to any."""


class Policy:
    name: ClassVar[str]
    uses_load: ClassVar[bool] = False
    """Whether the policy reads the load snapshot (keeps the load monitor polling)."""

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx

    def route(self, workers: Sequence[Worker], req: RouteRequest, now: float) -> Decision:
        """The request path's choice: pinned by the request's routing key when it has one (one rule for every
        policy, counted as branch ``session`` or ``stored``), else the policy's own ``decide``."""
        key = req.routing_key
        if key is None:
            return self.decide(workers, req, now)
        loads = self.loads_of(workers, req.model, now)
        i, branch = pin(workers, loads, self.slots_of(workers), key, req.worker_hint, self.ctx.settings)
        self.ctx.metrics.decisions.labels(req.model, self.ctx.role, branch).inc()
        return self.pinned(workers[i], req, branch)

    def decide(self, workers: Sequence[Worker], req: RouteRequest, now: float) -> Decision:
        """Choose among ``workers`` (non-empty, all routable, stable order)."""
        raise NotImplementedError

    def select(self, workers: Sequence[Worker], req: RouteRequest, now: float) -> Worker:
        """The worker ``decide`` chooses, without the rest of the decision."""
        return self.decide(workers, req, now).worker

    def pinned(self, worker: Worker, req: RouteRequest, branch: str) -> Decision:
        """``worker`` was chosen for ``req`` by its routing key (``branch``): keep what the policy knows true
        (cache_aware records the prompt for it) and say so as a decision."""
        return Decision(worker=worker, branch=branch)

    def sync(self, workers: Sequence[Worker]) -> None:
        """The workers this instance can reach now (lifecycle).  Stateless policies ignore it."""

    def observe(self, model: str, worker_url: str, text: str, head: int) -> bool:
        """A peer router sent ``text`` to the worker (``coordination``): keep what the policy knows true, as for a
        request of its own.  Whether it was taken (False: a stateless policy, or a worker it does not know)."""
        return False

    def maintain(self) -> None:
        """Periodic upkeep (tree eviction)."""

    def tree_sizes(self) -> Iterable[tuple[str, str, int]]:
        """(model, worker url, chars) for every tenant of every tree this instance keeps."""
        return ()

    # -- helpers shared by the load-aware policies ------------------------------------------------
    def loads_of(self, workers: Sequence[Worker], model: str, now: float) -> list[int]:
        """Effective loads aligned with ``workers``; counts one ``no_load_data`` fallback if any is stale."""
        effective = self.ctx.loads.effective
        loads: list[int] = []
        all_fresh = True
        for w in workers:
            load, fresh = effective(w, now)
            loads.append(load)
            all_fresh = all_fresh and fresh
        if not all_fresh:
            self.fallback(model, "no_load_data")
        return loads

    def slots_of(self, workers: Sequence[Worker]) -> list[int | None]:
        """Each worker's running slots (``LoadView.running_slots``), aligned with ``workers``: the load gate's."""
        slots = self.ctx.loads.running_slots
        return [slots(w.id) for w in workers]

    def fallback(self, model: str, reason: str) -> None:
        self.ctx.metrics.fallbacks.labels(model, self.ctx.role, self.name, reason).inc()


def least_loaded(workers: Sequence[Worker], loads: Sequence[int], among: Iterable[int] | None = None) -> int:
    """Index of the least-loaded worker; ties go to fewer processed, then to the earlier one."""
    indices = range(len(workers)) if among is None else among
    return min(indices, key=lambda i: (loads[i], workers[i].processed, i))
