"""``smg-operator``: settings, Kubernetes login, the health/metrics server, leader election, then kopf.

With ``--leader-election`` a replica stands by (live, not ready) until it holds the Lease, then runs kopf.
When leadership ends (``leadership.Elector.keep``), the gate closes at once (no router call, status patch or
Event from then on), kopf is stopped, and the process exits with status 1 so that Kubernetes restarts it as a
standby.  It does not go back to standing by in-process: kopf's registry, indexes, daemons and their memo are
built for one run of ``kopf.operator`` and are not meant to be started twice in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
from collections.abc import Callable, Sequence

import aiohttp
import kopf
from aiohttp import web
from kopf._core.engines import peering as kopf_peering  # Identity: the type of kopf.operator(identity=), unexported

from smg_operator import (
    handlers,  # noqa: F401 - registers the kopf handlers
    k8s,
    pool_handlers,
)
from smg_operator.inference_pools import POOL_GROUP, POOL_PLURAL, POOL_VERSION
from smg_operator.leadership import Elector, Gate, LeaseTiming
from smg_operator.metrics import CONTENT_TYPE, OperatorMetrics
from smg_operator.pool_sync import PoolSync
from smg_operator.reconciler import Runtime
from smg_operator.routers import RouterClient
from smg_operator.settings import OperatorSettings, parse_settings

log = logging.getLogger("smg_operator")
LOST = 1
"""Exit status after leadership ended: not 0, so the container is restarted (``restartPolicy: Always``
restarts either way; a non-zero status also shows in ``kubectl get pods`` as a restart with a reason)."""


def identity() -> str:
    """This process's name in the Lease and in kopf: the hostname (the pod name) and the pid.

    Passed to kopf explicitly: without it kopf derives one from ``getpass.getuser()``, which raises
    ``KeyError: 'getpwuid(): uid not found'`` in a container whose uid has no passwd entry."""
    return f"{socket.gethostname()}-{os.getpid()}"


async def _health_server(
    settings: OperatorSettings, metrics: OperatorMetrics, *, ready: Callable[[], bool], leading: Callable[[], bool]
) -> web.AppRunner | None:
    """``/metrics``; ``/healthz`` (liveness: 200 while the process serves, leader or standby); ``/readyz``
    (200 only while this replica leads, or election is off, and kopf is ready)."""
    if not settings.metrics_port:
        return None

    async def metrics_view(_: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "leader": leading()})

    async def readyz(_: web.Request) -> web.Response:
        if not leading():
            return web.json_response({"status": "standby", "leader": False}, status=503)
        if not ready():
            return web.json_response({"status": "starting", "leader": True}, status=503)
        return web.json_response({"status": "ready", "leader": True})

    app = web.Application()
    app.router.add_get("/metrics", metrics_view)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, settings.metrics_host, settings.metrics_port).start()
    return runner


def _kopf_settings(settings: OperatorSettings) -> kopf.OperatorSettings:
    """kopf's own API calls get the same bound as ours (its default is 5 minutes per request)."""
    ks = kopf.OperatorSettings()
    ks.networking.request_timeout = settings.kube_request_timeout
    ks.networking.connect_timeout = settings.kube_request_timeout
    return ks


def _elector(settings: OperatorSettings, name: str) -> Elector:
    assert settings.leader_election_namespace
    timing = LeaseTiming(
        lease_duration=settings.lease_duration,
        renew_deadline=settings.leader_election_renew_deadline,
        retry_period=settings.leader_election_retry_period,
    )
    store = k8s.LeaseStore(namespace=settings.leader_election_namespace, timeout=settings.kube_request_timeout)
    return Elector(store=store, identity=name, timing=timing)


async def run(settings: OperatorSettings) -> int:
    """Run until stopped; the exit status (0, or ``LOST`` when leadership ended)."""
    k8s.load_config()
    metrics = OperatorMetrics()
    ready, stop = asyncio.Event(), asyncio.Event()
    name = identity()
    gate = Gate(open=not settings.leader_election)
    runner = await _health_server(settings, metrics, ready=ready.is_set, leading=lambda: gate.is_open)
    elector = _elector(settings, name) if settings.leader_election else None
    keeper: asyncio.Task[None] | None = None
    rt: Runtime | None = None
    pools: PoolSync | None = None
    lost: list[str] = []

    def on_lost(reason: str) -> None:
        # Synchronous, in the order that matters: no write may start after this returns.
        gate.close(reason)
        lost.append(reason)
        stop.set()
        # kopf's own writes (finalizers, its annotations) do not pass our gate: if kopf has not stopped by the
        # time a standby could take the lease, end the process without waiting for it.
        grace = max(0.5, settings.lease_duration - settings.leader_election_renew_deadline)
        asyncio.get_running_loop().call_later(grace, _exit_now, grace)

    async with aiohttp.ClientSession() as session:
        try:
            if elector is not None:
                log.info(
                    "leader election: %s waiting for lease %s/smg-operator", name, settings.leader_election_namespace
                )
                await elector.acquire()
                gate.open()
                keeper = asyncio.create_task(elector.keep(on_lost=on_lost), name="smg-operator-lease")
            rt = Runtime(
                settings=settings,
                metrics=metrics,
                kube=k8s.KubeWrites(gate=gate, timeout=settings.kube_request_timeout),
                routers=RouterClient(
                    session=session,
                    token=settings.admin_api_key,
                    metrics=metrics,
                    timeout=settings.router_timeout,
                    gate=gate,
                ),
            )
            pools = await _pool_source(settings, rt)
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
                identity=kopf_identity(name),
                settings=_kopf_settings(settings),
                memo=kopf.Memo(runtime=rt, pools=pools),
                ready_flag=ready,
                stop_flag=stop if settings.leader_election else None,
            )
        finally:
            if pools is not None:
                await pools.stop()
            if rt is not None:
                await rt.close()  # drains in flight end with the session they use
            if keeper is not None:
                keeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await keeper
            if elector is not None and elector.leading and not lost:
                gate.close("shutting down")
                with contextlib.suppress(Exception):  # best effort: the lease expires anyway
                    if await asyncio.to_thread(elector.release):
                        log.info("leader election: released the lease")
            if runner is not None:
                await runner.cleanup()
    if lost:
        log.error(
            "leader election: leadership ended (%s); exiting with status %d to be restarted as a standby", lost[0], LOST
        )
        return LOST
    return 0


async def _pool_source(settings: OperatorSettings, rt: Runtime) -> PoolSync | None:
    """The InferencePool source when ``--inference-pools`` is on: its handlers registered, its loop (started by
    the first event).  A missing CRD is a log line, not a failure: kopf starts watching once the CRD appears."""
    if settings.inference_pools == "off":
        return None
    pool_handlers.install(kopf.get_default_registry())
    resource = f"{POOL_PLURAL}.{POOL_GROUP}/{POOL_VERSION}"
    try:
        present = await asyncio.to_thread(
            k8s.served, POOL_GROUP, POOL_VERSION, POOL_PLURAL, timeout=settings.kube_request_timeout
        )
    except Exception as e:  # discovery is advice here: kopf's own discovery decides what is watched
        log.warning("InferencePool source: could not check for %s: %s", resource, e)
    else:
        if present:
            log.info("InferencePool source on (%s pools): watching %s", settings.inference_pools, resource)
        else:
            log.warning(
                "InferencePool source on, but the API server does not serve %s (the Gateway API Inference "
                "Extension CRD is not installed): no pool is registered until it is; the operator keeps running "
                "and starts watching pools when the CRD appears",
                resource,
            )
    return PoolSync(rt=rt, mode=settings.inference_pools)


def kopf_identity(name: str) -> kopf_peering.Identity:
    """kopf's peering identity, given so that kopf never calls ``getpass.getuser()`` (see ``identity``)."""
    return kopf_peering.Identity(name)


def _exit_now(grace: float) -> None:
    log.error("leader election: kopf did not stop within %gs of losing the lease; exiting now", grace)
    logging.shutdown()
    os._exit(LOST)


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(argv)
    logging.basicConfig(
        level=settings.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    status = 0
    with contextlib.suppress(KeyboardInterrupt):
        status = asyncio.run(run(settings))
    sys.exit(status)


if __name__ == "__main__":
    main()
