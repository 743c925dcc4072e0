"""``smg-operator``: settings, Kubernetes login, the metrics/health server, leader election, then kopf."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Sequence

import aiohttp
import kopf
from aiohttp import web

from smg_operator import (
    handlers,  # noqa: F401 - registers the kopf handlers
    k8s,
)
from smg_operator.metrics import CONTENT_TYPE, OperatorMetrics
from smg_operator.reconciler import Runtime
from smg_operator.routers import RouterClient
from smg_operator.settings import OperatorSettings, parse_settings

log = logging.getLogger("smg_operator")


async def _metrics_server(
    settings: OperatorSettings, metrics: OperatorMetrics, ready: asyncio.Event
) -> web.AppRunner | None:
    if not settings.metrics_port:
        return None

    async def metrics_view(_: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response(
            {"status": "ok" if ready.is_set() else "starting"}, status=200 if ready.is_set() else 503
        )

    app = web.Application()
    app.router.add_get("/metrics", metrics_view)
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, settings.metrics_host, settings.metrics_port).start()
    return runner


async def run(settings: OperatorSettings) -> None:
    k8s.load_config()
    metrics = OperatorMetrics()
    ready, stop = asyncio.Event(), asyncio.Event()
    runner = await _metrics_server(settings, metrics, ready)
    keeper: asyncio.Task[None] | None = None
    lease: k8s.LeaderLease | None = None
    async with aiohttp.ClientSession() as session:
        try:
            if settings.leader_election:
                assert settings.leader_election_namespace
                lease = k8s.LeaderLease(namespace=settings.leader_election_namespace, duration=settings.lease_duration)
                log.info(
                    "leader election: %s waiting for lease %s/smg-operator",
                    lease.identity,
                    settings.leader_election_namespace,
                )
                await lease.acquire()
                keeper = asyncio.create_task(lease.keep(lost=stop), name="smg-operator-lease")
            rt = Runtime(
                settings=settings,
                metrics=metrics,
                kube=k8s,
                routers=RouterClient(
                    session=session, token=settings.admin_api_key, metrics=metrics, timeout=settings.router_timeout
                ),
            )
            log.info(
                "smg-operator watching %s (reconcile every %gs, default router %s)",
                ", ".join(settings.namespaces) or "all namespaces",
                settings.reconcile_interval,
                settings.router_service or "-",
            )
            # Only a lost lease sets ``stop``.  kopf 1.45 leaves its waiter on a stop flag pending when a signal
            # stops it, which delays every SIGTERM exit by 5 s: so pass the flag only when it can be set.
            await kopf.operator(
                clusterwide=not settings.namespaces,
                namespaces=list(settings.namespaces),
                standalone=True,
                memo=kopf.Memo(runtime=rt),
                ready_flag=ready,
                stop_flag=stop if settings.leader_election else None,
            )
        finally:
            if keeper is not None:
                keeper.cancel()
            if lease is not None and not stop.is_set():
                await asyncio.to_thread(lease.release)
            if runner is not None:
                await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(argv)
    logging.basicConfig(
        level=settings.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run(settings))


if __name__ == "__main__":
    main()
