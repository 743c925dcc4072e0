"""One attempt at one worker: choosing the worker, and the guard that owns the attempt's bookkeeping.

``Attempts.open(role, req, exclude)`` gathers the routable workers of the role that serve the request's
model, asks that model's policy to choose (or, ``by_load``, the router's one ``least_load`` instance: the
non-generative endpoints) through ``Policy.route``, which pins a request with a routing key the same way
whatever the policy (retries exclude the workers already tried, so a pinned key moves on only then), and
returns an ``AttemptGuard`` for the chosen worker.  The
guard is the only code that touches a worker's in-flight count, processed count and circuit breaker
(the Rust SMG's ``WorkerLoadGuard``): it counts the attempt in when it opens, and when it closes (at the
end of the response, however it ends) it counts it out and hands the outcome to the breaker.

A burst on one new prefix waits for its first prefill (``coordination.Holds``): the guard carries the hooks and
the place to wait (``hold``, ``on_started``, ``on_closed``) that the holds use; ``Attempts.open`` arranges each
attempt there, and the caller awaits ``holds.wait`` before it sends.

Open breakers take at most ``--max-ejection-share`` of a model's ready workers out of routing (Envoy's max ejection
percent): when more of them are open, every ready worker of the model is a candidate again, open breakers or not
(Envoy's panic routing), and each attempt so opened is counted in ``smg_breaker_panics_total{model,role}``.  A fleet
whose every worker failed a burst (a slow client, a spike of timeouts, a bad minute) then still answers what it can
instead of a 503 for everyone; a breaker's trial still closes it on the first success.

What counts as a worker failure, written once (``AttemptGuard.answered`` and ``AttemptGuard.failed``):
a connect error, a timeout, a 5xx answer, a body cut off by the worker.  A 429 is back-pressure, not a
fault: it is retried elsewhere but leaves the breaker alone.  A client that goes away is no outcome.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Collection
from enum import Enum
from types import TracebackType

from smg_router.coordination import NO_PEERS, Holds, Peers
from smg_router.errors import NoWorkerAvailable
from smg_router.metrics import Metrics
from smg_router.policies.base import Policy, RouteRequest
from smg_router.policies.registry import PolicyRegistry
from smg_router.workers.registry import WorkerRegistry
from smg_router.workers.worker import Worker, WorkerStatus


def is_worker_failure(status: int) -> bool:
    """A 5xx says the worker is broken; a 4xx (429 included) says it is working."""
    return status >= 500


def is_retryable(status: int) -> bool:
    """Worth another worker, while nothing reached the client: a broken worker (5xx) or a busy one (429)."""
    return status >= 500 or status == 429


class Outcome(Enum):
    SUCCESS = "success"
    FAILURE = "failure"


class AttemptGuard:
    """In-flight, processed and breaker outcome of one attempt.  Use as ``with``; it closes exactly once."""

    __slots__ = (
        "_closed",
        "_held_under",
        "_joins",
        "_metrics",
        "_outcome",
        "_prefill",
        "_prompt_tokens",
        "_registry",
        "_started",
        "_trial",
        "behind",
        "on_closed",
        "on_started",
        "worker",
    )

    def __init__(
        self,
        worker: Worker,
        *,
        registry: WorkerRegistry,
        metrics: Metrics,
        prefill_chars: int = 0,
        prompt_tokens: int = 0,
    ) -> None:
        self.worker = worker
        self._registry = registry
        self._metrics = metrics
        self._outcome: Outcome | None = None
        self._closed = False
        self._started = False
        self.on_started: Callable[[], None] | None = None
        """Set when this attempt leads a burst (``Holds``): releases the requests waiting for its prefill."""
        self.on_closed: Callable[[], None] | None = None
        """Set when this attempt has its turn on a slot engine (``Holds``): gives the turn to the next."""
        self.behind: asyncio.Future[None] | None = None
        """The prefill this attempt waits for before it is sent (``Holds``), or None."""
        self._held_under: str | None = None
        self._joins: str | None = None
        worker.inflight += 1
        self._prefill = prefill_chars
        worker.prefilling += 1
        worker.prefill_chars += prefill_chars
        self._prompt_tokens = prompt_tokens
        worker.prompt_tokens += prompt_tokens
        worker.processed += 1
        self._trial = worker.breaker.acquire()
        self._publish()

    @property
    def prefill_chars(self) -> int:
        """The chars of the prompt its worker is expected to prefill (what it does not hold)."""
        return self._prefill

    def joins(self, prefix: str) -> None:
        """A streamed attempt whose leading chars are ``prefix``: counted in the worker's ``joining`` until it
        starts its answer."""
        self._joins = prefix
        joining = self.worker.joining
        joining[prefix] = joining.get(prefix, 0) + 1

    def started(self) -> None:
        """The answer's first chunk arrived: the worker has prefilled the prompt (``Worker.prefilling``)."""
        if not self._started:
            self._started = True
            self.worker.prefilling -= 1
            self.worker.prefill_chars -= self._prefill
            if (prefix := self._joins) is not None:
                joining = self.worker.joining
                if joining[prefix] > 1:
                    joining[prefix] -= 1
                else:
                    del joining[prefix]
            if self.on_started is not None:
                self.on_started()

    def hold(self, ahead: asyncio.Future[None], prefix: str) -> None:
        """Wait for ``ahead`` (the first prefill of ``prefix`` on this worker) before being sent; counted in the
        worker's ``held`` until ``unhold``."""
        self.behind = ahead
        self._held_under = prefix
        held = self.worker.held
        held[prefix] = held.get(prefix, 0) + 1

    @property
    def held_under(self) -> str | None:
        """The leading chars of the prefill or turn this attempt waits for, while it waits."""
        return self._held_under

    def unhold(self) -> None:
        """No longer waiting (sent, or never: the attempt ended)."""
        self.behind = None
        prefix, self._held_under = self._held_under, None
        if prefix is not None:
            held = self.worker.held
            if held[prefix] > 1:
                held[prefix] -= 1
            else:
                del held[prefix]

    def answered(self, status: int) -> None:
        """The worker answered ``status`` in full: a failure for a 5xx, nothing for a 429, else a success."""
        if is_worker_failure(status):
            self._outcome = Outcome.FAILURE
        elif status != 429:
            self._outcome = Outcome.SUCCESS

    def failed(self) -> None:
        """The worker could not be reached, timed out or cut its answer off."""
        self._outcome = Outcome.FAILURE

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.worker.inflight -= 1
        self.worker.prompt_tokens -= self._prompt_tokens
        self.unhold()
        self.started()
        if self.on_closed is not None:
            self.on_closed()
        self._publish()
        if self._outcome is Outcome.SUCCESS:
            self.worker.breaker.record_success()
        elif self._outcome is Outcome.FAILURE:
            self.worker.breaker.record_failure()
        elif self._trial:
            self.worker.breaker.release()

    def __enter__(self) -> AttemptGuard:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _publish(self) -> None:
        w = self.worker
        if self._registry.get(w.id) is w:  # a removed worker's series must not come back
            self._metrics.worker_inflight.labels(w.url, w.role).set(w.inflight)


class Attempts:
    """Opens attempts: selection by the model's policy among the routable workers, then a guard."""

    def __init__(
        self,
        *,
        registry: WorkerRegistry,
        policies: PolicyRegistry,
        metrics: Metrics,
        by_load: Policy | None = None,
        holds: Holds | None = None,
        peers: Peers = NO_PEERS,
        max_ejection_share: float = 1.0,
        chars_per_token: float = 3.0,
    ) -> None:
        self._registry = registry
        self._chars_per_token = chars_per_token if chars_per_token > 0 else 1.0
        """How a prompt whose tokens the router does not know is counted in tokens (``--tree-chars-per-token``; 0,
        the tree's cap off: a char a token, as the KV event index counts)."""
        self._max_ejection = max_ejection_share
        """The share of a model's ready workers open breakers may take out (``--max-ejection-share``)."""
        self._peers = peers
        """Told every route of a policy that keeps prompts (so their indexes hold what the fleet was sent)."""
        self._policies = policies
        self._metrics = metrics
        self._by_load = by_load
        """The choice of the requests routed by load (a ``least_load`` instance); None: the model's policy."""
        self.holds = holds if holds is not None else Holds(seconds=0.0, metrics=metrics)
        """The bursts in prefill (None given: nobody waits)."""

    def prompt_tokens(self, req: RouteRequest) -> int:
        """The request's prompt tokens: their count when the router knows them (``--tokenizer``, token prompts), else
        its routing text's chars over the chars per token, rounded up (what the tree's KV cap assumes)."""
        tokens = req.tokens
        if tokens is not None:
            return len(tokens)
        return math.ceil(len(req.text) / self._chars_per_token)

    def any_left(self, role: str, req: RouteRequest, exclude: Collection[str]) -> bool:
        """Whether another attempt would find a routable worker."""
        return bool(self.routable(role, req.model, exclude)[0])

    def has_routable(self, role: str, model: str) -> bool:
        """Whether an attempt of ``role`` for ``model`` would find a worker (``routable``'s answer, without the list:
        a ready worker counts when open breakers may panic, since they then cannot take out every ready one)."""
        panics = self._max_ejection < 1.0
        return any(
            w.routable or (panics and w.status is WorkerStatus.READY) for w in self._registry.serving(role, model)
        )

    def routable(self, role: str, model: str, exclude: Collection[str] = ()) -> tuple[list[Worker], bool]:
        """The workers of ``role`` serving ``model`` an attempt may go to (but ``exclude``), and whether that is
        every ready one because open breakers would take out more than the ejection share (panic)."""
        serving = self._registry.serving(role, model)
        candidates = [w for w in serving if w.routable and w.id not in exclude]
        if len(candidates) >= (1.0 - self._max_ejection) * len(serving):
            return candidates, False  # so many are routable that the breakers cannot be past the share: no count
        candidates = []
        ready = ejected = 0
        for w in serving:
            if w.status is WorkerStatus.READY:
                ready += 1
                if not w.breaker.allows():
                    ejected += 1
                elif w.id not in exclude:
                    candidates.append(w)
        if ejected <= self._max_ejection * ready:
            return candidates, False
        return [w for w in serving if w.status is WorkerStatus.READY and w.id not in exclude], True

    def open(
        self,
        role: str,
        req: RouteRequest,
        exclude: Collection[str] = (),
        *,
        by_load: bool = False,
        streamed: bool | None = None,
    ) -> AttemptGuard:
        """The guard of a newly chosen worker; 503 when no routable worker is left.  ``by_load``: the
        least-loaded one, not the model's policy's choice (endpoints whose cost no cached prefix lowers).
        ``streamed`` (whether the answer is streamed): the attempt takes part in ``holds`` (the caller then awaits
        ``holds.wait`` before it sends); None: it does not."""
        candidates, panic = self.routable(role, req.model, exclude)
        if panic and candidates:
            self._metrics.breaker_panics.labels(req.model, role).inc()
        if not candidates:
            what = "other " if exclude else ""
            raise NoWorkerAvailable(
                f"no {what}healthy {role} worker for model '{req.model}'", code="no_available_workers"
            )
        policy = self._by_load if by_load and self._by_load is not None else self._policies.policy_for(role, req.model)
        t0 = time.perf_counter()
        decision = policy.route(candidates, req, time.monotonic())  # a routing key pins it first (sticky)
        self._metrics.decision_seconds.labels(policy.name).observe(time.perf_counter() - t0)
        if decision.prefix is not None:
            self._peers.tell(role, req.model, decision.worker.url, req.text, req.head)
        prefill = len(req.text) if decision.prefill is None else decision.prefill
        guard = AttemptGuard(
            decision.worker,
            registry=self._registry,
            metrics=self._metrics,
            prefill_chars=prefill,
            prompt_tokens=self.prompt_tokens(req),
        )
        if streamed is not None:
            if streamed and decision.prefix is not None:
                guard.joins(decision.prefix)
            self.holds.arrange(guard, decision.prefix, cold=decision.cold, streamed=streamed)
        return guard
