"""Active health checks: probe every worker's /health on an interval and move it between states.

pending/not_ready → ready after ``success_threshold`` good probes (discovering the model from
``/v1/models`` first when it was not given); ready → not_ready after ``failure_threshold`` bad ones.
Draining workers are left alone.  Status changes go through the lifecycle.  Each worker is probed on
its own (``WorkerTasks``: a round starts the probes not still running and waits for none), each probe
within its timeout, and a failure while probing one worker is logged, never the end of the checker.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import replace

import orjson

from smg_router.fleet.lifecycle import Lifecycle
from smg_router.fleet.probes import ProbeClient, WorkerTasks
from smg_router.settings import HealthSettings
from smg_router.workers.worker import Worker, WorkerStatus

log = logging.getLogger(__name__)


class HealthChecker:
    def __init__(self, *, probes: ProbeClient, lifecycle: Lifecycle, settings: HealthSettings) -> None:
        self._probes = probes
        self._lifecycle = lifecycle
        self._settings = settings
        self._running = WorkerTasks("health-probe")
        self._broken: set[str] = set()
        """Worker ids whose last probe raised (logged once, until a probe of the worker goes through)."""

    async def run(self) -> None:
        """Every interval, start a probe of each worker not still busy with its last one; ends only when cancelled."""
        failed = False
        try:
            while True:
                try:
                    self.start_round()
                    failed = False
                except Exception:  # a bug in a round must not end health checks for every worker
                    if not failed:
                        log.exception("health check round failed; trying again every %ss", self._settings.interval)
                    failed = True
                await asyncio.sleep(self._settings.interval)
        finally:
            await self._running.close()

    def start_round(self) -> list[asyncio.Task[None]]:
        """Start a probe of every worker that is not draining and has none running; the round's tasks."""
        workers = [w for w in self._lifecycle.registry if w.status is not WorkerStatus.DRAINING]
        self._broken &= {w.id for w in workers}
        return [self._running.start(w.id, functools.partial(self._probe_task, w)) for w in workers]

    async def check_all(self) -> None:
        """One round: probe every worker that is not draining, waited for."""
        await asyncio.gather(*self.start_round())

    async def _probe_task(self, worker: Worker) -> None:
        try:
            await self.probe(worker)
        except Exception:  # a bug of ours with one worker must not end the checker for every worker
            if worker.id not in self._broken:
                self._broken.add(worker.id)
                log.exception("worker %s health check failed", worker.url)
        else:
            self._broken.discard(worker.id)

    async def probe(self, worker: Worker) -> bool:
        ok = await self._get_ok(worker.url + "/health")
        s, lc = self._settings, self._lifecycle
        if ok:
            worker.health_failures = 0
            worker.health_successes += 1
            if (
                worker.status in (WorkerStatus.PENDING, WorkerStatus.NOT_READY)
                and worker.health_successes >= s.success_threshold
            ):
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

    async def _get(self, url: str) -> tuple[int, bytes] | None:
        """The probe client's answer, or None; bounded by the timeout here too, whatever the client does."""
        try:
            async with asyncio.timeout(self._settings.timeout):
                return await self._probes.get(url, seconds=self._settings.timeout)
        except TimeoutError:
            return None

    async def _get_ok(self, url: str) -> bool:
        answer = await self._get(url)
        return answer is not None and answer[0] == 200

    async def _discover_model(self, worker: Worker) -> None:
        answer = await self._get(worker.url + "/v1/models")
        model = _first_model(answer[1]) if answer is not None and answer[0] == 200 else None
        if model is not None and self._lifecycle.current(worker):  # not removed, nor being removed
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
