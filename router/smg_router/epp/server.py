"""The Endpoint Picker's gRPC servers: Envoy's ext_proc service and the gRPC health service, on the router's loop.

``EppServer.start`` opens ``--epp-port`` (ext_proc, and health) and ``--epp-health-port`` (health alone) on ``--host``
with ``grpc.aio``, in the router's event loop: a pick runs between two requests of the HTTP face, on the same
routing state, with no lock.  One ``Process`` call is one ext_proc stream (``stream.ExtProcStream``): its answers are
relayed as the messages come, and the stream is closed however the call ends (the gateway's request over, the
gateway gone, the server stopping).

Health (the gRPC health protocol): ``liveness`` (and the empty name) is SERVING while the process answers;
``readiness`` and ``envoy.service.ext_proc.v3.ExternalProcessor`` follow the router's readiness (a routable worker,
not shutting down: ``RouterCore.readiness``); another name is NOT_FOUND.  ``Watch`` sends the status when it changes
(read every ``WATCH_INTERVAL`` seconds).

``stop(grace)``: no new streams, those open get ``grace`` seconds to end, then they are cancelled (and closed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from smg_router.core import RouterCore
from smg_router.epp.pick import Picker
from smg_router.epp.stream import ExtProcStream

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS, READINESS = "liveness", "readiness"
WATCH_INTERVAL = 1.0
SERVING, NOT_SERVING = 1, 2
"""``grpc.health.v1.HealthCheckResponse.ServingStatus`` values."""


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """``Process``: one ext_proc stream per HTTP request at the gateway."""

    def __init__(self, picker: Picker) -> None:
        self._picker = picker

    async def Process(  # the gRPC method's name
        self, requests: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> None:
        # the context's own read and write, not an async generator over ``requests``: grpc.aio wraps each of those
        # in machinery of its own, per message
        stream = ExtProcStream(picker=self._picker)
        read, write, eof = context.read, context.write, grpc.aio.EOF
        try:
            while (msg := await read()) is not eof:
                for answer in stream.on_message(msg):
                    await write(answer)
        except asyncio.CancelledError:
            raise  # the gateway went away or the server stops: the request is over all the same
        except Exception:
            log.exception("ext_proc stream of %s failed", stream.pick.req.endpoint if stream.pick else "a request")
            stream.failed()
            raise
        finally:
            stream.close()


class Health(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """The gRPC health protocol over the router's readiness (module docstring)."""

    def __init__(self, core: RouterCore) -> None:
        self._core = core

    def _status(self, service: str) -> int | None:
        if service in ("", LIVENESS):
            return SERVING
        if service in (READINESS, EXT_PROC_SERVICE):
            return SERVING if self._core.readiness()[0] else NOT_SERVING
        return None

    async def Check(  # the gRPC method's name
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        status = self._status(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(  # the gRPC method's name
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        last = None
        while True:
            status = self._status(request.service)
            if status is None:
                status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            if status != last:
                last = status
                yield health_pb2.HealthCheckResponse(status=status)
            await asyncio.sleep(WATCH_INTERVAL)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class EppServer:
    """The ext_proc server (and the health server when it has a port of its own) of one router process."""

    def __init__(self, core: RouterCore) -> None:
        self._core = core
        self.picker = Picker(
            proxy=core.proxy,
            admission=core.admission,
            registry=core.registry,
            loads=core.loads,
            metrics=core.metrics,
            forward_headers=core.forward_headers,
            fallbacks=core.settings.epp.fallbacks,
        )
        self._servers: list[grpc.aio.Server] = []

    async def start(self) -> None:
        """Listen on ``--epp-port`` and ``--epp-health-port``; a port that cannot be bound ends the start
        (SystemExit naming it)."""
        settings = self._core.settings
        host, epp = settings.server.host, settings.epp
        # the processes of --processes share the ports (the kernel spreads the gateway's connections); one process
        # alone must own its port: a second router on it would take half of the streams unseen
        options = [("grpc.so_reuseport", 1 if settings.process.child else 0)]
        health = Health(self._core)
        main = grpc.aio.server(options=options)
        pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(self.picker), main)
        health_pb2_grpc.add_HealthServicer_to_server(health, main)
        ports = [(main, epp.port, "--epp-port")]
        if epp.health_port:
            alone = grpc.aio.server(options=options)
            health_pb2_grpc.add_HealthServicer_to_server(health, alone)
            ports.append((alone, epp.health_port, "--epp-health-port"))
        for server, port, flag in ports:
            try:
                server.add_insecure_port(_address(host, port))
            except RuntimeError as e:
                await self.stop(0)
                raise SystemExit(f"{flag} {port}: cannot listen on {host} ({e})") from None
            self._servers.append(server)
        for server in self._servers:
            await server.start()
        log.info(
            "endpoint picker: ext_proc on %s%s",
            _address(host, epp.port),
            f", gRPC health on {_address(host, epp.health_port)}" if epp.health_port else "",
        )

    async def stop(self, grace: float) -> None:
        """No new streams; those open get ``grace`` seconds, then are cancelled (each closes its attempt)."""
        servers, self._servers = self._servers, []
        await asyncio.gather(*(server.stop(grace) for server in servers))
