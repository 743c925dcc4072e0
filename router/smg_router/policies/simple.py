"""The policies that keep no tree: random, round_robin, power_of_two, least_load."""

from __future__ import annotations

from collections.abc import Sequence

from smg_router.policies.base import Decision, Policy, PolicyContext, RouteRequest, least_loaded
from smg_router.workers.worker import Worker


class RandomPolicy(Policy):
    name = "random"

    def decide(self, workers: Sequence[Worker], req: RouteRequest, now: float) -> Decision:
        return Decision(worker=workers[self.ctx.rng.randrange(len(workers))], branch=self.name)


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._next = 0

    def decide(self, workers: Sequence[Worker], req: RouteRequest, now: float) -> Decision:
        worker = workers[self._next % len(workers)]
        self._next += 1
        return Decision(worker=worker, branch=self.name)


class PowerOfTwoPolicy(Policy):
    """Two random candidates, the less loaded wins (effective load: the global backlog)."""

    name = "power_of_two"
    uses_load = True

    def decide(self, workers: Sequence[Worker], req: RouteRequest, now: float) -> Decision:
        if len(workers) == 1:
            return Decision(worker=workers[0], branch=self.name)
        pair = self.ctx.rng.sample(range(len(workers)), 2)
        picked = [workers[i] for i in pair]
        loads = self.loads_of(picked, req.model, now)
        return Decision(worker=picked[least_loaded(picked, loads)], branch=self.name)


class LeastLoadPolicy(Policy):
    """Shortest effective queue."""

    name = "least_load"
    uses_load = True

    def decide(self, workers: Sequence[Worker], req: RouteRequest, now: float) -> Decision:
        loads = self.loads_of(workers, req.model, now)
        return Decision(worker=workers[least_loaded(workers, loads)], branch=self.name)
