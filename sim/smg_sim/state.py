"""Per-worker shared state, stored on the aiohttp app under `STATE_KEY` (no module globals).

Built by `server.create_app`, read by every route module (`generation`, `openai_api`, `sglang_api`,
`info_api`).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from .bootstrap import RoomTable
from .config import SimConfig
from .engine import Engine
from .faults import FaultInjector


def crash_process() -> None:
    """Default `--crash-after` action: die like a crashed engine (no cleanup, exit status 1)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


@dataclass(eq=False)
class SimState:
    """Everything the routes of one worker share."""

    config: SimConfig
    engine: Engine
    faults: FaultInjector
    crash: Callable[[], None] = crash_process
    rooms: RoomTable | None = None
    """Bootstrap rooms (prefill role only)."""
    session: aiohttp.ClientSession | None = None
    """Client for bootstrap look-ups (decode role); opened on app startup."""
    worker_id: str = ""
    """host:port of this worker, sent as `x-smg-sim-worker`; known once the socket is bound."""
    bootstrap_port: int | None = None
    """Port the bootstrap server is bound to (prefill role), known once bound."""
    responses: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Stored Responses (``store``, the default): response id -> its conversation as chat messages, the output
    included, so a ``previous_response_id`` continues it on this worker (``responses_api``; oldest dropped)."""
    started_at: float = field(default_factory=time.monotonic)
    created: int = field(default_factory=lambda: int(time.time()))

    def warming_up(self) -> bool:
        """True during `--slow-start` (wall clock)."""
        return time.monotonic() - self.started_at < self.config.slow_start

    def client(self) -> aiohttp.ClientSession:
        if self.session is None:
            raise RuntimeError("client session is opened on app startup")
        return self.session


STATE_KEY = web.AppKey("smg_sim_state", SimState)
