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
from smg_router.policies.index import EventIndexes
from smg_router.policies.simple import LeastLoadPolicy, PowerOfTwoPolicy, RandomPolicy, RoundRobinPolicy
from smg_router.policy_names import POLICY_NAMES, canonical_name
from smg_router.settings import PolicySettings
from smg_router.workers.load import LoadView

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (RandomPolicy, RoundRobinPolicy, PowerOfTwoPolicy, LeastLoadPolicy, CacheAwarePolicy)
}
assert set(POLICIES) == set(POLICY_NAMES), "policy_names.POLICY_NAMES must list every policy class"


class PolicyFactory:
    def __init__(
        self,
        *,
        settings: PolicySettings,
        loads: LoadView,
        metrics: Metrics,
        seed: int | None = None,
        events: EventIndexes | None = None,
    ) -> None:
        self._events = events
        self._settings = settings
        self._loads = loads
        self._metrics = metrics
        self._rng = random.Random(seed)

    def create(self, name: str, *, role: str) -> Policy:
        cls = POLICIES[canonical_name(name)]
        ctx = PolicyContext(
            settings=self._settings,
            loads=self._loads,
            metrics=self._metrics,
            role=role,
            rng=self._rng,
            events=self._events,
        )
        return cls(ctx)
