"""The policy registry: the default slot, per-model slots (worker label ``policy``), and PD slots.

``sync`` is the policies' half of the one lifecycle path: after any worker add, update or removal it
tells every instance exactly which workers it can reach, creating or dropping per-model instances as
the labels say.  No instance is ever left uninitialised, stale or holding a removed worker.

``tree_upkeep`` is the one upkeep of every cache-aware tree of the router (every instance, every model,
and the trees of dropped instances until their nodes are reclaimed), under one byte budget
(``--tree-memory-budget``): a generator of slices the router's ``smg-tree-eviction`` task drives.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Iterator

from smg_router.policies.base import Policy
from smg_router.policies.cache_aware import CacheAwarePolicy
from smg_router.policies.factory import PolicyFactory
from smg_router.policy_names import canonical_name
from smg_router.settings import PolicySettings
from smg_router.tree import Limits, RadixTree, Upkeep
from smg_router.workers.worker import Worker

log = logging.getLogger(__name__)
POLICY_LABEL = "policy"


class PolicyRegistry:
    def __init__(self, factory: PolicyFactory, settings: PolicySettings) -> None:
        self._factory = factory
        self.default = factory.create(settings.name, role="regular")
        self.prefill = factory.create(settings.prefill_policy or settings.name, role="prefill")
        self.decode = factory.create(settings.decode_policy or settings.name, role="decode")
        self.by_model: dict[str, Policy] = {}
        self.by_load = factory.create("least_load", role="regular")
        """The choice of the endpoints whose cost no cached prefix lowers (embeddings, rerank, tokenize, audio):
        a slot like the others, so the lifecycle reaches it and the load monitor polls for it."""
        self._retired: list[CacheAwarePolicy] = []
        """Dropped cache-aware instances whose trees upkeep has not reclaimed yet."""
        self._upkeep: Upkeep[tuple[CacheAwarePolicy, str]] = Upkeep(
            Limits(budget_bytes=settings.tree_memory_budget),
            clock=time.perf_counter,
        )

    def policy_for(self, role: str, model: str | None) -> Policy:
        if role == "prefill":
            return self.prefill
        if role == "decode":
            return self.decode
        if model is not None:
            policy = self.by_model.get(model)
            if policy is not None:
                return policy
        return self.default

    def instances(self) -> Iterator[tuple[str, Policy]]:
        """(slot name, instance) for every live instance."""
        yield "default", self.default
        yield "prefill", self.prefill
        yield "decode", self.decode
        yield "by_load", self.by_load
        for model, policy in self.by_model.items():
            yield f"model:{model}", policy

    def needs_load(self) -> bool:
        return any(p.uses_load for _, p in self.instances())

    def sync(self, workers: Iterable[Worker]) -> None:
        """Re-derive per-model slots from labels and give every instance its reachable workers."""
        regular: list[Worker] = []
        prefill: list[Worker] = []
        decode: list[Worker] = []
        wanted: dict[str, str] = {}
        for w in workers:
            (prefill if w.role == "prefill" else decode if w.role == "decode" else regular).append(w)
            label = w.spec.labels.get(POLICY_LABEL)
            if w.role == "regular" and label and w.model_id is not None:
                try:
                    name = canonical_name(label)
                except ValueError:
                    log.warning("worker %s: ignoring unknown policy label %r", w.url, label)
                    continue
                if wanted.setdefault(w.model_id, name) != name:
                    log.warning(
                        "model %s: workers disagree on policy (%s vs %s); keeping %s",
                        w.model_id,
                        wanted[w.model_id],
                        name,
                        wanted[w.model_id],
                    )
        for model in list(self.by_model):
            if wanted.get(model) != self.by_model[model].name:
                dropped = self.by_model.pop(model)
                if isinstance(dropped, CacheAwarePolicy):
                    dropped.retire()
                    self._retired.append(dropped)
        for model, name in wanted.items():
            if model not in self.by_model:
                self.by_model[model] = self._factory.create(name, role="regular")
                log.info("model %s uses policy %s (worker label)", model, name)
        for model, policy in self.by_model.items():
            policy.sync([w for w in regular if w.model_id == model])
        self.default.sync([w for w in regular if w.model_id not in self.by_model])
        self.prefill.sync(prefill)
        self.decode.sync(decode)

    def maintain(self) -> None:
        """Every instance's upkeep at once (tests, tools); the router runs ``tree_upkeep`` in slices."""
        for _, policy in self.instances():
            policy.maintain()

    @property
    def tree_budget(self) -> int:
        """The bytes every tree together may hold (``--tree-memory-budget``, less what other indexes hold)."""
        return self._upkeep.limits.budget_bytes

    @tree_budget.setter
    def tree_budget(self, n: int) -> None:
        self._upkeep.limits = dataclasses.replace(self._upkeep.limits, budget_bytes=n)

    def tree_upkeep(self) -> Iterator[None]:
        """One round of upkeep of every tree (``tree.Upkeep``), yielding between slices of a few ms."""
        return self._upkeep.run(self._tree_slots, self._count_evicted, tenant_cap=self._tenant_cap)

    def _cache_aware(self) -> list[CacheAwarePolicy]:
        live = [p for _, p in self.instances() if isinstance(p, CacheAwarePolicy)]
        self._retired = [p for p in self._retired if any(True for _ in p.tree_slots())]
        return live + self._retired

    def _tree_slots(self) -> list[tuple[tuple[CacheAwarePolicy, str], RadixTree]]:
        return [((policy, model), tree) for policy in self._cache_aware() for model, tree in policy.tree_slots()]

    @staticmethod
    def _tenant_cap(key: tuple[CacheAwarePolicy, str], tenant: str) -> int | None:
        return key[0].tenant_cap(tenant)

    @staticmethod
    def _count_evicted(key: tuple[CacheAwarePolicy, str], chars: int) -> None:
        policy, model = key
        policy.count_evicted(model, chars)

    def tree_bytes(self) -> Iterator[tuple[str, str, int]]:
        """(model, role, estimated bytes) of the trees of every instance, for the scrape-time gauge."""
        out: dict[tuple[str, str], int] = {}
        for policy in self._cache_aware():
            for model, n in policy.tree_bytes():
                key = (model, policy.ctx.role)
                out[key] = out.get(key, 0) + n
        for (model, role), n in out.items():
            yield model, role, n

    def tree_sizes(self) -> Iterator[tuple[str, str, str, int]]:
        """(model, role, worker, chars) across every instance, for the scrape-time gauge."""
        for _, policy in self.instances():
            for model, worker, chars in policy.tree_sizes():
                yield model, policy.ctx.role, worker, chars
