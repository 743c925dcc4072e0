"""The router client: the lifecycle REST API of every router replica, over HTTP only.

The operator never reaches into router internals; it uses the same API as people do, with the admin
token from ``SMG_ADMIN_API_KEY``.  Every call is counted in ``smg_operator_hook_calls_total``.

Every call, reads included (they carry the token too), goes through the leadership ``Gate``: once this
replica stops leading, a call is refused before anything is sent (``NotLeading``, not counted as a hook call)
and a call in flight is cancelled.

``GET /workers`` answers a replica's whole registry (a thousand workers at scale) and every SMGWorker's pass
needs one per replica, so the passes share it: a list in flight is joined, and one younger than
``list_max_age`` is reused unless this client has changed that replica since.  Reusing a slightly old list
is safe: a pass only plans its own SMGWorker's workers, a repeated ``POST`` of a registered URL is a no-op
and a repeated ``DELETE`` a 404.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp

from smg_operator.leadership import Gate, GateClosed
from smg_operator.metrics import OperatorMetrics


class RouterCallError(Exception):
    """A call to a router replica failed: unreachable (``reachable`` False) or answered with an error."""

    def __init__(self, message: str, *, reachable: bool) -> None:
        super().__init__(message)
        self.reachable = reachable


class NotLeading(RouterCallError):
    """The gate refused the call (or cancelled it): this replica no longer leads."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reachable=False)


LIST_MAX_AGE = 1.0
"""Seconds a replica's ``GET /workers`` answer is shared by the passes that need one."""


@dataclass(frozen=True, slots=True)
class _Listing:
    started: float
    task: asyncio.Future[dict[str, Any]]
    """The replica's ``GET /workers`` answer: ``workers`` and ``declared_models``."""


class RouterClient:
    def __init__(
        self,
        *,
        session: aiohttp.ClientSession,
        token: str | None,
        metrics: OperatorMetrics,
        timeout: float = 5.0,
        gate: Gate | None = None,
        list_max_age: float = LIST_MAX_AGE,
    ) -> None:
        self._list_max_age = list_max_age
        self._listings: dict[str, _Listing] = {}
        self._session = session
        self._gate = gate or Gate()  # no election: always open
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._metrics = metrics
        self._timeout = aiohttp.ClientTimeout(total=timeout)

    async def _call(
        self,
        hook: str,
        method: str,
        url: str,
        *,
        json: Any = None,
        ok: tuple[int, ...] = (200, 201),
        client_timeout: aiohttp.ClientTimeout | None = None,
    ) -> Any:
        try:
            return await self._gate.run(self._send(hook, method, url, json=json, ok=ok, client_timeout=client_timeout))
        except GateClosed as e:
            raise NotLeading(f"{method} {url} not sent: {e}") from None

    async def _send(
        self,
        hook: str,
        method: str,
        url: str,
        *,
        json: Any,
        ok: tuple[int, ...],
        client_timeout: aiohttp.ClientTimeout | None,
    ) -> Any:
        try:
            async with self._session.request(
                method, url, json=json, headers=self._headers, timeout=client_timeout or self._timeout
            ) as resp:
                body = await resp.json(content_type=None)
                if resp.status not in ok:
                    message = (body or {}).get("error", {}).get("message") if isinstance(body, dict) else body
                    self._metrics.hook_calls.labels(hook, "error").inc()
                    raise RouterCallError(f"{method} {url} -> {resp.status}: {message}", reachable=True)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
            self._metrics.hook_calls.labels(hook, "unreachable").inc()
            raise RouterCallError(f"{method} {url}: {type(e).__name__}: {e}", reachable=False) from None
        self._metrics.hook_calls.labels(hook, "ok").inc()
        return body

    async def list_workers(self, router: str) -> list[dict[str, Any]]:
        """One replica's registry, shared with the other passes that ask within ``list_max_age``."""
        return list((await self._listing(router)).get("workers") or [])

    async def list_declared(self, router: str) -> list[dict[str, Any]]:
        """The models declared on one replica (``declared_models``: model and its declarations), from the same shared
        ``GET /workers`` answer as ``list_workers`` (a router that predates declarations: none)."""
        return list((await self._listing(router)).get("declared_models") or [])

    async def _listing(self, router: str) -> dict[str, Any]:
        if not self._gate.is_open:  # a pass of a replica that no longer leads gets no shared list either
            self._listings.clear()
            raise NotLeading(f"GET {router}/workers not sent: this replica does not lead")
        listing = self._listings.get(router)
        if listing is None or (listing.task.done() and time.monotonic() - listing.started > self._list_max_age):
            listing = _Listing(time.monotonic(), asyncio.ensure_future(self._list(router)))
            self._listings[router] = listing
            listing.task.add_done_callback(lambda task: self._settled(router, task))
        # shielded: one waiter cancelled (its daemon stopping) must not cancel the others' list
        return await asyncio.shield(listing.task)

    async def _list(self, router: str) -> dict[str, Any]:
        body = await self._call("list", "GET", f"{router}/workers")
        return body if isinstance(body, dict) else {}

    def _settled(self, router: str, task: asyncio.Future[dict[str, Any]]) -> None:
        """A failed list is not shared: the next pass asks again."""
        if task.cancelled() or task.exception() is not None:  # exception(): retrieved even if no waiter is left
            listing = self._listings.get(router)
            if listing is not None and listing.task is task:
                del self._listings[router]

    async def _change(self, router: str, hook: str, method: str, path: str, **kw: Any) -> Any:
        """A call that changes the replica: no list taken before it ends is shared after it."""
        self._listings.pop(router, None)
        try:
            return await self._call(hook, method, router + path, **kw)
        finally:
            self._listings.pop(router, None)

    # The answers of register and replace (the worker record) are not used beyond the new id: each reconcile
    # reads the replica's state back with list_workers, so there is one source of truth for what a replica holds.
    async def register(self, router: str, registration: dict[str, Any]) -> str | None:
        """POST the worker; its id on that replica (None if the answer had none)."""
        body = await self._change(router, "register", "POST", "/workers", json=registration)
        worker_id = body.get("id") if isinstance(body, dict) else None
        return worker_id if isinstance(worker_id, str) else None

    async def set_draining(self, router: str, worker_id: str, draining: bool) -> None:
        """Drain (no new requests, in-flight finish) or undrain a worker without removing it."""
        await self._change(router, "drain", "PATCH", f"/workers/{worker_id}", json={"draining": draining})

    async def replace(self, router: str, worker_id: str, registration: dict[str, Any]) -> None:
        await self._change(router, "update", "PUT", f"/workers/{worker_id}", json=registration)

    async def remove(self, router: str, worker_id: str, *, drain_timeout: float) -> None:
        await self._change(
            router,
            "remove",
            "DELETE",
            f"/workers/{worker_id}?timeout={drain_timeout:g}",
            ok=(200, 404),
            client_timeout=aiohttp.ClientTimeout(total=drain_timeout + 10),
        )

    async def declare(self, router: str, model: str, body: dict[str, Any]) -> None:
        """Declare a model on the replica (``PUT /models/{model}``): known with or without workers."""
        await self._change(router, "declare", "PUT", f"/models/{quote(model, safe='')}", json=body)

    async def withdraw(self, router: str, model: str, owner: str) -> None:
        """Withdraw one owner's declaration of a model (a 404, none there, is done too)."""
        path = f"/models/{quote(model, safe='')}?owner={quote(owner, safe='')}"
        await self._change(router, "withdraw", "DELETE", path, ok=(200, 404))
