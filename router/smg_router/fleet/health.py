"""Active health checks: probe every worker's /health on an interval and move it between states.

pending/not_ready → ready after ``success_threshold`` good probes (discovering the model from
``/v1/models`` first when it was not given); ready → not_ready after ``failure_threshold`` bad ones.
Draining workers are left alone.  Status changes go through the lifecycle.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import orjson

from smg_router.fleet.lifecycle import Lifecycle
from smg_router.fleet.probes import ProbeClient
from smg_router.settings import HealthSettings
from smg_router.workers.worker import Worker, WorkerStatus

log = logging.getLogger(__name__)


class HealthChecker:
    def __init__(self, *, probes: ProbeClient, lifecycle: Lifecycle, settings: HealthSettings) -> None:
        self._probes = probes
        self._lifecycle = lifecycle
        self._settings = settings

    async def run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self._settings.interval)

    async def check_all(self) -> None:
        """One round: probe every worker that is not draining."""
        workers = [w for w in self._lifecycle.registry if w.status is not WorkerStatus.DRAINING]
        await asyncio.gather(*(self.probe(w) for w in workers))

    async def probe(self, worker: Worker) -> bool:
        ok = await self._get_ok(worker.url + "/health")
        s, lc = self._settings, self._lifecycle
        if ok:
            worker.health_failures = 0
            worker.health_successes += 1
            if worker.status in (WorkerStatus.PENDING, WorkerStatus.NOT_READY) and \
                    worker.health_successes >= s.success_threshold:
                if worker.model_id is None:
                    await self._discover_model(worker)
                lc.set_status(worker, WorkerStatus.READY)
        else:
            worker.health_successes = 0
            worker.health_failures += 1
            if worker.status is WorkerStatus.READY and worker.health_failures >= s.failure_threshold:
                log.warning("worker %s failed %d health checks", worker.url, worker.health_failures)
                lc.set_status(worker, WorkerStatus.NOT_READY)
        return ok

    async def _get_ok(self, url: str) -> bool:
        answer = await self._probes.get(url, seconds=self._settings.timeout)
        return answer is not None and answer[0] == 200

    async def _discover_model(self, worker: Worker) -> None:
        answer = await self._probes.get(worker.url + "/v1/models", seconds=self._settings.timeout)
        model = _first_model(answer[1]) if answer is not None and answer[0] == 200 else None
        if model is not None and self._lifecycle.registry.get(worker.id) is worker:
            self._lifecycle.update(worker, replace(worker.spec, model_id=model))
            log.info("worker %s serves model %s", worker.url, model)


def _first_model(body: bytes) -> str | None:
    """The first model id of a ``/v1/models`` answer, or None when it is not one."""
    try:
        data = orjson.loads(body)
        model = data["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return model if isinstance(model, str) and model else None
