"""The policy registry: the default slot, per-model slots (worker label ``policy``), and PD slots.

``sync`` is the policies' half of the one lifecycle path: after any worker add, update or removal it
tells every instance exactly which workers it can reach, creating or dropping per-model instances as
the labels say.  No instance is ever left uninitialised, stale or holding a removed worker.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

from smg_router.policies.base import Policy
from smg_router.policies.factory import PolicyFactory
from smg_router.policy_names import canonical_name
from smg_router.settings import PolicySettings
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
                del self.by_model[model]
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
        for _, policy in self.instances():
            policy.maintain()

    def tree_sizes(self) -> Iterator[tuple[str, str, str, int]]:
        """(model, role, worker, chars) across every instance, for the scrape-time gauge."""
        for _, policy in self.instances():
            for model, worker, chars in policy.tree_sizes():
                yield model, policy.ctx.role, worker, chars
