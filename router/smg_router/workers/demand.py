"""Demand per model and role, as an autoscaler reads it: computed at scrape time from the registry and the load view.

The metrics collector (``Metrics.add_demand_source``) calls ``model_demand`` on every scrape; the request path does
nothing for it but keep the per-worker counts it already keeps (in flight, prompt tokens in flight).

Saturation is the backlog over the running slots of the routable workers whose engines' slots are known
(``LoadView.running_slots``: reported, as SGLang's and smg-sim's ``max_running_requests``, or learned when a poll
found requests waiting, as for vLLM).  A worker's backlog is its effective load (``LoadView.effective``): its
engine's polled running + waiting while fresh (every replica's requests), plus what this router sent it since the
poll, never less than this router's in-flight; without a fresh poll, this router's in-flight.  Routable workers
whose slots are not known yet (an engine that never said nor ever made a request wait: not full as far as anyone
knows) are left out of both sums.  With no routable worker at all, the value is ``SATURATED`` while any worker of
the model still has a backlog (demand with nowhere to run), else 0.  With routable workers none of whose slots are
known, there is no sample (unknown, not idle).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from smg_router.workers.load import LoadView
from smg_router.workers.worker import Worker

SATURATED = 1.0
"""Saturation with a backlog and no routable worker: "full", a finite figure.  +Inf would make an HPA's ratio
(current * value / target) meaningless and a Prometheus sum over models +Inf; any figure above 1 would make it scale
by a factor that says nothing about capacity.  1 reaches every target and activation threshold below 1 (saturation
targets are below 1: a fleet at 1 has no free slot), so the scaler adds replicas by current / target, as for a
full fleet."""


@dataclass(slots=True)
class ModelDemand:
    """The figures of one (model, role): what the demand gauges expose."""

    inflight: int = 0
    """Requests this router has in flight to the workers of the model and role."""
    prompt_tokens: int = 0
    """Their prompt tokens (``Worker.prompt_tokens``)."""
    backlog: int = 0
    """The effective load of the routable workers whose slots are known."""
    capacity: int = 0
    """Their running slots."""
    routable: int = 0
    unroutable: int = 0
    pending: int = 0
    """The effective load of the workers left out of ``backlog`` (not routable, or slots unknown)."""

    @property
    def saturation(self) -> float | None:
        """``backlog / capacity``; ``SATURATED`` or 0 with no routable worker; None while no routable worker's slots
        are known (the module's docstring)."""
        if self.capacity > 0:
            return self.backlog / self.capacity
        if self.routable == 0:
            return SATURATED if self.pending > 0 else 0.0
        return None


def model_demand(workers: Iterable[Worker], loads: LoadView, *, now: float) -> dict[tuple[str, str], ModelDemand]:
    """(model, role) -> its demand, for every pair with a registered worker ("" for a worker whose model is not
    known yet)."""
    out: dict[tuple[str, str], ModelDemand] = {}
    for w in workers:
        key = (w.model_id or "", w.role)
        d = out.get(key)
        if d is None:
            d = out[key] = ModelDemand()
        d.inflight += w.inflight
        d.prompt_tokens += w.prompt_tokens
        load, _ = loads.effective(w, now)
        slots = loads.running_slots(w.id)
        if w.routable:
            d.routable += 1
            if slots is not None and slots > 0:
                d.backlog += load
                d.capacity += slots
                continue
        else:
            d.unroutable += 1
        d.pending += load
    return out


def demand_rows(workers: Iterable[Worker], loads: LoadView, *, now: float) -> Iterator[tuple[str, str, ModelDemand]]:
    """(model, role, demand) sorted by model and role: a stable exposition order."""
    for (model, role), d in sorted(model_demand(workers, loads, now=now).items()):
        yield model, role, d
