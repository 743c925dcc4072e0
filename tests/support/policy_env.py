"""Shared builders for unit tests of policies: real metrics, a real load view, ready workers."""

from __future__ import annotations

from dataclasses import dataclass

from smg_router.metrics import Metrics
from smg_router.policies.factory import PolicyFactory
from smg_router.settings import PolicySettings
from smg_router.workers.breaker import CircuitBreaker
from smg_router.workers.load import LoadView
from smg_router.workers.worker import Worker, WorkerSpec, WorkerStatus


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """The fields a policy reads (``policies.base.RouteRequest``), without the HTTP request around them."""

    model: str
    text: str
    head: int = 0
    """No conversation structure (a plain prompt) unless a test says otherwise."""
    routing_key: str | None = None
    """A session key that pins the request (``policies.sticky``); None: the policy chooses."""
    worker_hint: str | None = None
    """A worker known to hold the request's state (a previous response)."""
    tokens: list[int] | None = None
    """The engine prompt's token ids, when known: what an index of KV events matches."""
    namespace: str = ""
    """Their KV namespace (``tree.blocks.namespace_of``)."""


def make_worker(n: int, *, model: str = "m", role: str = "regular", labels: dict[str, str] | None = None) -> Worker:
    w = Worker(
        WorkerSpec(url=f"http://127.0.0.{n}:8000", model_id=model, role=role, labels=labels or {}),
        CircuitBreaker(failure_threshold=3, cooldown=10),
    )
    w.status = WorkerStatus.READY
    return w


class Loads(LoadView):
    """A load view whose engines all report ``slots`` running slots, unless a test records others."""

    def __init__(self, *, slots: int | None) -> None:
        super().__init__(max_age=5.0)
        self.default_slots = slots

    def running_slots(self, worker_id: str) -> int | None:
        found = super().running_slots(worker_id)
        return self.default_slots if found is None else found


class Env:
    """A factory with real metrics and a load view, as the router wires them; its engines run ``slots`` requests at
    once (None: they never said)."""

    def __init__(self, *, slots: int | None = 5, **policy: object) -> None:
        self.settings = PolicySettings(**policy)  # type: ignore[arg-type]
        self.metrics = Metrics()
        self.loads = Loads(slots=slots)
        self.factory = PolicyFactory(settings=self.settings, loads=self.loads, metrics=self.metrics, seed=7)

    def sample(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value
