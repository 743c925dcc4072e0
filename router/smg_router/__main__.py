"""``smg-router``: parse settings, configure logging and uvloop, serve until SIGTERM/SIGINT, then shut down gracefully.

Graceful shutdown, as Kubernetes needs it (the pod leaves the Service endpoints at about the time SIGTERM
arrives, and not at once everywhere):
1. ``/readiness`` answers 503 at once; requests are still served for ``--shutdown-delay`` seconds, every answer
   with ``Connection: close`` (``Server.closing``), so that clients retire their pooled connections to this router.
2. The listening socket closes; in-flight requests and streams get ``--shutdown-timeout`` seconds to finish.
3. Streams still running end with an error event and ``[DONE]``; the app stops (upstream connections closed,
   background tasks cancelled) and the process exits 0.

The collector: a request allocates a few dozen container objects (the parsed body, futures, headers)
that refcounting frees, but every 700 allocations CPython runs a young collection anyway; measured under load
(c=64 chat, 30 s) that was 215 collections, ~33 µs per request, 4-8% of the router's CPU.  A young generation of
GC_YOUNG_THRESHOLD objects made it 10 collections, ~8 µs per request, longest pause 33 ms against 52 ms.  The
objects of start-up (modules, functions, settings: ~10^5) are frozen out of the collector once serving
(``gc.freeze``), so a full collection walks only what was made since: mostly the cache-aware trees.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import os
import signal
import sys
from collections.abc import Sequence

from smg_router.app import build_private_server, child_socket, running
from smg_router.core import RouterCore
from smg_router.epp.server import EppServer
from smg_router.pod import supervise
from smg_router.server import Server
from smg_router.settings import Settings, parse_settings

log = logging.getLogger("smg_router")
GC_YOUNG_THRESHOLD = 10_000
"""Allocations between two young collections (CPython's default: 700); the older generations keep theirs."""
PR_SET_PDEATHSIG = 1
"""prctl(2): the signal a process gets when its parent dies."""
STREAM_END_GRACE = 2.0
"""Seconds the streams ended at the shutdown deadline get to write their last events."""


async def serve(settings: Settings) -> None:
    s, p = settings.server, settings.process
    async with running(settings, shutdown_timeout=STREAM_END_GRACE) as (core, server):
        private: Server | None = None
        if p.index is not None and p.dir:  # a child of --processes: the port shared, the admin port the parent's
            listeners = [await server.listen(s.host, s.port, backlog=1024, reuse_port=True)]
            private = build_private_server(core)
            await private.listen_unix(os.path.join(p.dir, child_socket(p.index)))
        else:
            listeners = [await server.listen(s.host, s.port, backlog=1024)]
            if s.admin_port:  # the lifecycle mutations answer only here (app.Dispatcher)
                listeners.append(await server.listen(s.host, s.admin_port))
        epp: EppServer | None = None
        if settings.epp.enabled:  # the Endpoint Picker: a gateway's Envoy asks where each request goes (docs/epp.md)
            epp = EppServer(core)
            await epp.start()
        gc.freeze()  # start-up's objects leave the collector's walks (module docstring)
        log.info(
            "smg-router serving on http://%s:%d%s (policy %s, %d worker(s) from the command line)",
            s.host,
            s.port,
            f", worker lifecycle changes on port {s.admin_port}" if s.admin_port else "",
            settings.policy.name,
            len(settings.worker_urls),
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await _drain(core, listeners, settings, epp)
        if private is not None:
            await private.shutdown(STREAM_END_GRACE)


async def _drain(
    core: RouterCore, listeners: list[asyncio.Server], settings: Settings, epp: EppServer | None = None
) -> None:
    s = settings.server
    core.shutting_down = True
    admission = core.admission
    log.info(
        "shutting down: not ready; serving %.1f s more, then up to %.1f s for %d request(s) in flight",
        s.shutdown_delay,
        s.shutdown_timeout,
        len(admission),
    )
    await asyncio.sleep(s.shutdown_delay)
    for listener in listeners:
        listener.close()  # no new connections; open ones keep being served
    stopping = None
    if epp is not None:  # no new ext_proc streams; open ones (admitted: counted below) end with their requests
        stopping = asyncio.get_running_loop().create_task(epp.stop(s.shutdown_timeout), name="smg-epp-stop")
    if not await admission.wait_idle(s.shutdown_timeout):
        ended = core.proxy.relay.end_streams()
        log.warning(
            "shutdown timeout: ending %d stream(s) with an error event; %d request(s) left", ended, len(admission)
        )
        await admission.wait_idle(STREAM_END_GRACE)
    if stopping is not None:
        await stopping
    log.info("shut down (%d request(s) left)", len(admission))


def _die_with_parent() -> None:
    """A child of ``--processes`` gets SIGTERM (and drains) when its parent dies, however it died (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(argv)
    index = settings.process.index
    logging.basicConfig(
        level=settings.server.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        if index is None
        else f"%(asctime)s %(levelname)s %(name)s [process {index}]: %(message)s",
    )
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.run
    else:
        runner = uvloop.run
    if settings.process.parent:  # --processes N: the children serve, this one supervises them (``pod``)
        status = 1
        with contextlib.suppress(KeyboardInterrupt):
            status = runner(supervise(settings, sys.argv[1:] if argv is None else argv))
        sys.exit(status)
    if index is not None:
        _die_with_parent()
    with contextlib.suppress(KeyboardInterrupt):
        runner(serve(settings))


if __name__ == "__main__":
    main()
