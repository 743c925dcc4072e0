"""A fleet for the operator's scale scenario on the real API server: many SMGWorkers, many worker pods, churn.

Used by ``bench/operator_scale.py`` (50 SMGWorkers x 20 pods, figures) and ``tests/kube/test_operator_scale_smoke.py``
(5 x 4, assertions).  The caller brings an ``operator_env.Env`` with its router replicas and the operator running;
this module plays the kubelet for the worker pods and remembers when each pod became Ready and when it was deleted,
so that ``scale_figures`` can set those times against the routers' own log of when each worker was added and removed.

Worker pods have no process behind them.  ``POST /workers`` does not need the worker to answer: the router probes it
once, the connection is refused at once (nothing listens on the pod's loopback address), and the worker is
registered as ``pending``; nothing the operator does depends on a worker's health.  A thousand answering workers
would instead have each router probe a thousand servers every health interval, load the 2-core machine the
operator and the API server share, and measure that instead.

Every pod gets an address of its own from 127.20.0.0/16 (never reused within a run) and the one worker port, so a
worker URL names exactly one pod.  A replacement pod gets a new name, UID and address; it is created Running and
not Ready, and made Ready ``ready_delay`` later.  A deleted pod stays terminating (``deletionTimestamp`` set, held
by ``smg.test/hold``) for ``grace`` seconds, as a kubelet keeps it during its grace period, and is then released.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import json
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from support.kube import HOLD_FINALIZER
from support.operator_env import Env, pool


@dataclass(frozen=True, kw_only=True)
class Scenario:
    smgworkers: int = 50
    pods_per_smgworker: int = 20
    churn_per_minute: float = 0.10
    """Fraction of all worker pods replaced per minute (delete one, create its replacement)."""
    ready_delay: float = 1.0
    """Seconds from a replacement's creation (Running, not Ready) to its Ready."""
    grace: float = 2.0
    """Seconds a deleted pod stays terminating before it goes away."""
    min_victim_age: float = 10.0
    """A pod is chosen for deletion only after it has been Ready this long (by default the operator's reconcile
    interval): pods seldom die within seconds of starting, and one deleted before it could be registered measures
    nothing."""
    seed: int = 10

    @property
    def pods(self) -> int:
        return self.smgworkers * self.pods_per_smgworker

    @property
    def churn_period(self) -> float:
        """Seconds between two replacements."""
        return 60.0 / (self.churn_per_minute * self.pods)


@dataclass
class PodRecord:
    name: str
    pool: str
    url: str
    ip: str
    created: float
    ready_at: float | None = None
    """Wall-clock time the API server answered the status patch that made the pod Ready."""
    deleted_at: float | None = None
    """Wall-clock time the API server answered the DELETE (the pod is terminating from then on)."""


def addresses() -> Iterator[str]:
    """127.20.0.1, 127.20.0.2, ... 127.20.255.254: one per pod, never twice in a run."""
    for a, b in itertools.product(range(256), range(1, 255)):
        yield f"127.20.{a}.{b}"


@dataclass
class ScaleFleet:
    env: Env
    scenario: Scenario
    pods: dict[str, PodRecord] = field(default_factory=dict)
    """Every pod of the run, by name, deleted ones included."""
    churned: int = 0
    """Replacements made (deletions) so far."""
    _ips: Iterator[str] = field(default_factory=addresses)
    _serial: Iterator[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.scenario.seed)

    # -- setup ---------------------------------------------------------------------------------------------
    def pool_names(self) -> list[str]:
        return [f"pool-{i:02d}" for i in range(self.scenario.smgworkers)]

    def create_smgworkers(self) -> None:
        """One SMGWorker per pool, each selecting the pods labelled ``pool=<its name>``, all on the one router."""
        e = self.env
        docs = [
            json.loads(pool(name, {"pool": name}, port=e.worker_port, router_port=e.router_port))
            for name in self.pool_names()
        ]
        e.cp.apply_yaml(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}), e.ns)

    def _new_record(self, pool_name: str) -> PodRecord:
        ip = next(self._ips)
        name = f"{pool_name}-{next(self._serial):05d}"
        record = PodRecord(
            name=name, pool=pool_name, url=f"http://{ip}:{self.env.worker_port}", ip=ip, created=time.time()
        )
        self.pods[name] = record
        return record

    def _create(self, record: PodRecord, *, ready: bool) -> None:
        # stamped before the call: the operator may register the pod before the call has returned to us
        sent = time.time()
        self.env.cp.make_ready_pod(
            self.env.ns, record.name, {"pool": record.pool}, record.ip, finalizers=[HOLD_FINALIZER], ready=ready
        )
        if ready:
            record.ready_at = sent

    def fill(self, *, threads: int = 4) -> None:
        """Create every pool's pods, Running and Ready, a few at a time (pools interleaved)."""
        names = self.pool_names()
        records = [self._new_record(names[i % len(names)]) for i in range(self.scenario.pods)]
        with concurrent.futures.ThreadPoolExecutor(threads) as ex:
            for future in [ex.submit(self._create, r, ready=True) for r in records]:
                future.result()

    # -- state ---------------------------------------------------------------------------------------------
    def live_ready_urls(self) -> set[str]:
        """What the routers should hold: the pods that are Ready and not terminating."""
        return {p.url for p in self.pods.values() if p.ready_at is not None and p.deleted_at is None}

    def router_urls(self) -> dict[str, set[str]]:
        return {pod: self.env.urls(pod) for pod in self.env.routers}

    def converged(self) -> bool:
        want = self.live_ready_urls()
        return all(urls == want for urls in self.router_urls().values())

    # -- churn ---------------------------------------------------------------------------------------------
    def churn(self, duration: float) -> None:
        """Replace ``churn_per_minute`` of the pods per minute for ``duration`` seconds, then finish the
        replacements in progress (Ready patches and releases due after the end are done at once)."""
        due: list[tuple[float, int, Callable[[], None]]] = []
        tie = itertools.count()
        start = time.monotonic()
        end = start + duration
        next_churn = start
        while True:
            now = time.monotonic()
            while due and due[0][0] <= now:
                heapq.heappop(due)[2]()
            if next_churn <= now < end:
                for when, action in self._replace_one():
                    heapq.heappush(due, (now + when, next(tie), action))
                next_churn += self.scenario.churn_period
            if now >= end:
                break
            wake = min(next_churn, due[0][0]) if due else next_churn
            time.sleep(max(0.0, min(wake, end) - time.monotonic()))
        for _, _, action in sorted(due):
            action()

    def _replace_one(self) -> list[tuple[float, Callable[[], None]]]:
        """Delete one Ready pod (it stays terminating), create its replacement (not Ready); the follow-ups, as
        (seconds from now, action): the replacement's Ready, the old pod's release."""
        victim = self._victim()
        actions: list[tuple[float, Callable[[], None]]] = []
        if victim is not None:
            sent = time.time()  # before the call, as in _make_ready
            self.env.cp.mark_terminating(self.env.ns, victim.name)
            victim.deleted_at = sent
            self.churned += 1
            actions.append((self.scenario.grace, lambda: self.env.cp.release_pod(self.env.ns, victim.name, wait=False)))
            record = self._new_record(victim.pool)
            self._create(record, ready=False)
            actions.append((self.scenario.ready_delay, lambda: self._make_ready(record)))
        return actions

    def _victim(self) -> PodRecord | None:
        cutoff = time.time() - self.scenario.min_victim_age
        candidates = [
            p for p in self.pods.values() if p.deleted_at is None and p.ready_at is not None and p.ready_at <= cutoff
        ]
        return self._rng.choice(candidates) if candidates else None

    def _make_ready(self, record: PodRecord) -> None:
        sent = time.time()  # the operator may register the pod before this call has returned to us
        self.env.cp.set_pod_ready(self.env.ns, record.name, True)
        record.ready_at = sent
