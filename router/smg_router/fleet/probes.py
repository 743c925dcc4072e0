"""The control-plane HTTP client and the per-worker task set of the loops that use it.

``ProbeClient`` is one small interface (``fetch`` → status and body, or a ``ProbeError`` naming why not;
``get`` → the same or None) so the checkers never handle aiohttp's exceptions themselves.  The fleet gives
the health checker and the load monitor a client each: separate pools, so a round of one never queues
behind the other's connections.  Within a pool every worker (host and port) has its own small connection
budget and there is no global cap, so black-holed workers cannot make a healthy one wait for a connection;
the connect timeout sits inside each request's total.

``WorkerTasks`` runs at most one background task per worker: a loop's round starts the tasks that are not
still running and waits for none of them, so a worker that hangs delays nobody else's poll or probe.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp

log = logging.getLogger(__name__)

MAX_BODY = 4 * 1024 * 1024
"""Largest answer read from a worker (a vLLM /metrics is some hundred KB); more is a bad payload."""


class ProbeError(Exception):
    """A GET that gave no usable answer; ``kind`` is ``timeout``, ``connect`` or ``bad_payload``."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


class ProbeClient:
    def __init__(self, *, limit_per_host: int = 2, connect_timeout: float = 1.0, max_body: int = MAX_BODY) -> None:
        self._limit_per_host = limit_per_host
        self._connect_timeout = connect_timeout
        self._max_body = max_body
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # limit=0: no pool-wide cap whose queue would count against every worker's timeout; each worker
        # (host, port) has limit_per_host connections, and the loops keep one request per worker in flight.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=self._limit_per_host)
        self._session = aiohttp.ClientSession(connector=connector)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def fetch(self, url: str, *, seconds: float) -> tuple[int, bytes]:
        """(status, body) within ``seconds`` (connecting included), or ProbeError."""
        if self._session is None:
            raise ProbeError("connect", "probe client not started")
        timeout = aiohttp.ClientTimeout(total=seconds, sock_connect=min(seconds, self._connect_timeout))
        try:
            async with self._session.get(url, timeout=timeout, allow_redirects=False) as resp:
                if resp.content_length is not None and resp.content_length > self._max_body:
                    raise ProbeError("bad_payload", f"answer of {resp.content_length} bytes")
                body = bytearray()
                async for chunk in resp.content.iter_any():
                    body += chunk
                    if len(body) > self._max_body:
                        raise ProbeError("bad_payload", f"answer over {self._max_body} bytes")
                return resp.status, bytes(body)
        except aiohttp.ConnectionTimeoutError:  # before TimeoutError: it is both
            raise ProbeError("connect", f"no connection within {min(seconds, self._connect_timeout)}s") from None
        except TimeoutError:
            raise ProbeError("timeout", f"no answer within {seconds}s") from None
        except aiohttp.ClientResponseError as e:  # not HTTP: a malformed status line or headers
            raise ProbeError("bad_payload", f"not an HTTP answer ({e.message})") from None
        except (aiohttp.ClientError, OSError) as e:
            raise ProbeError("connect", str(e) or type(e).__name__) from None

    async def get(self, url: str, *, seconds: float) -> tuple[int, bytes] | None:
        """(status, body) within ``seconds``, or None when there is no usable answer (and before ``start``)."""
        try:
            return await self.fetch(url, seconds=seconds)
        except ProbeError:
            return None


class WorkerTasks:
    """At most one running task per worker id, named ``<name>:<worker id>``; ``close`` cancels and awaits them.

    The coroutines handle their own failures; one that escapes anyway is logged here, never left unread.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, worker_id: str, work: Callable[[], Coroutine[Any, Any, None]]) -> asyncio.Task[None]:
        """The worker's running task, or a new one running ``work()`` when it has none."""
        task = self._tasks.get(worker_id)
        if task is None:
            task = asyncio.get_running_loop().create_task(work(), name=f"{self._name}:{worker_id}")
            self._tasks[worker_id] = task
            task.add_done_callback(functools.partial(self._finished, worker_id))
        return task

    def _finished(self, worker_id: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(worker_id) is task:
            del self._tasks[worker_id]
        if not task.cancelled() and task.exception() is not None:
            log.error("%s ended with an error", task.get_name(), exc_info=task.exception())

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
