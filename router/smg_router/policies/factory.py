"""The one policy factory: every instance, whatever slot or alias asked for it, gets the same context.

The seed bugs of the Rust gateway came from instances built in several places and wired by hand in
some.  Here ``PolicyFactory.create`` is the only constructor call site, and it always passes the shared
load view, metrics and configured thresholds.
"""

from __future__ import annotations

import random

from smg_router.metrics import Metrics
from smg_router.policies.base import Policy, PolicyContext
from smg_router.policies.cache_aware import CacheAwarePolicy
from smg_router.policies.simple import LeastLoadPolicy, PowerOfTwoPolicy, RandomPolicy, RoundRobinPolicy
from smg_router.settings import PolicySettings
from smg_router.workers.load import LoadView

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (RandomPolicy, RoundRobinPolicy, PowerOfTwoPolicy, LeastLoadPolicy, CacheAwarePolicy)
}
ALIASES = {
    "cacheaware": "cache_aware", "cache": "cache_aware",
    "roundrobin": "round_robin", "rr": "round_robin",
    "poweroftwo": "power_of_two", "power_of_2": "power_of_two", "p2c": "power_of_two",
    "leastload": "least_load", "least_loaded": "least_load", "shortest_queue": "least_load",
}


def canonical_name(name: str) -> str:
    """``Cache-Aware``, ``cacheaware`` and ``cache_aware`` all name the same policy; ValueError otherwise."""
    key = name.strip().lower().replace("-", "_")
    key = ALIASES.get(key, key)
    if key not in POLICIES:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
    return key


class PolicyFactory:
    def __init__(self, *, settings: PolicySettings, loads: LoadView, metrics: Metrics,
                 seed: int | None = None) -> None:
        self._settings = settings
        self._loads = loads
        self._metrics = metrics
        self._rng = random.Random(seed)

    def create(self, name: str, *, role: str) -> Policy:
        cls = POLICIES[canonical_name(name)]
        ctx = PolicyContext(settings=self._settings, loads=self._loads, metrics=self._metrics, role=role,
                            rng=self._rng)
        return cls(ctx)
