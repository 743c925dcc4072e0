"""The operator's metrics; nothing else in smg_operator imports prometheus_client."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, generate_latest

disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client leaves it unannotated
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class OperatorMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.hook_calls = Counter(
            "smg_operator_hook_calls", "Router lifecycle calls, by hook and result", ("hook", "result"), registry=r
        )
        self.reconciles = Counter("smg_operator_reconcile", "SMGWorker reconciles, by result", ("result",), registry=r)
        self.registered = Gauge(
            "smg_operator_registered_workers",
            "Endpoints of an SMGWorker registered on every router replica",
            ("smgworker",),
            registry=r,
        )

        self.pool_workers = Gauge(
            "smg_operator_inferencepool_workers",
            "Workers of an InferencePool (ready pods x target ports) registered on every router replica",
            ("inferencepool",),
            registry=r,
        )

    def forget_pool(self, inferencepool: str) -> None:
        with contextlib.suppress(KeyError):
            self.pool_workers.remove(inferencepool)

    def forget(self, smgworker: str) -> None:
        with contextlib.suppress(KeyError):
            self.registered.remove(smgworker)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
