"""The one shared load snapshot (the workers' global backlog) and the effective-load rule.

The load monitor writes it; every policy instance reads it through its context (no per-instance
wiring, so a policy created by alias, label or PD slot sees the same numbers).
"""

from __future__ import annotations

import time

from smg_router.workers.worker import Worker


class LoadView:
    """Effective load = max(backend running + waiting, local in-flight) while the backend figure is fresh.

    The ``max`` keeps one router from stampeding a worker that looked idle at the last poll; a stale or
    missing figure leaves the local in-flight count alone (the caller counts a ``no_load_data`` fallback).
    """

    __slots__ = ("_entries", "_kv_tokens", "max_age")

    def __init__(self, *, max_age: float) -> None:
        self.max_age = max_age
        self._entries: dict[str, tuple[int, float]] = {}
        self._kv_tokens: dict[str, int] = {}

    def record(self, worker_id: str, load: int, *, at: float | None = None, kv_tokens: int | None = None) -> None:
        """A poll's figures: the backlog, and the engine's KV capacity in tokens when it reports one."""
        self._entries[worker_id] = (load, time.monotonic() if at is None else at)
        if kv_tokens is not None:
            self._kv_tokens[worker_id] = kv_tokens

    def forget(self, worker_id: str) -> None:
        self._entries.pop(worker_id, None)
        self._kv_tokens.pop(worker_id, None)

    def kv_tokens(self, worker_id: str) -> int | None:
        """The KV cache capacity in tokens the worker's engine last reported (kept while it answers polls
        without one), or None when it never reported one."""
        return self._kv_tokens.get(worker_id)

    def backend(self, worker_id: str, now: float | None = None) -> int | None:
        """The worker's last polled running + waiting, or None when missing or stale."""
        entry = self._entries.get(worker_id)
        if entry is None:
            return None
        load, at = entry
        if (time.monotonic() if now is None else now) - at > self.max_age:
            return None
        return load

    def effective(self, worker: Worker, now: float) -> tuple[int, bool]:
        """(effective load, whether a fresh backend figure was used)."""
        backend = self.backend(worker.id, now)
        if backend is None:
            return worker.inflight, False
        return max(backend, worker.inflight), True
