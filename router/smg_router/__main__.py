"""``smg-router``: parse settings, configure logging and uvloop, serve until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Sequence

from aiohttp import web

from smg_router.app import build_app
from smg_router.settings import Settings, parse_settings

log = logging.getLogger("smg_router")


async def serve(settings: Settings) -> None:
    app = build_app(settings)
    # handler_cancellation: a client that goes away cancels its handler, which aborts the upstream request.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.server.host, settings.server.port, reuse_address=True, backlog=1024)
    await site.start()
    log.info("smg-router serving on http://%s:%d (policy %s, %d worker(s) from the command line)",
             settings.server.host, settings.server.port, settings.policy.name, len(settings.worker_urls))
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(argv)
    logging.basicConfig(level=settings.server.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.run
    else:
        runner = uvloop.run
    with contextlib.suppress(KeyboardInterrupt):
        runner(serve(settings))


if __name__ == "__main__":
    main()
