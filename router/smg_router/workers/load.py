"""The one shared load snapshot (the workers' global backlog) and the effective-load rule.

The load monitor writes it; every policy instance reads it through its context (no per-instance
wiring, so a policy created by alias, label or PD slot sees the same numbers).
"""

from __future__ import annotations

import time

from smg_router.workers.worker import Worker


class LoadView:
    """Effective load = max(backend + dispatched since the poll, local in-flight) while the backend figure is
    fresh: the workers' global backlog (every replica's requests), plus what this router sent since it was read.

    "Dispatched since the poll" is how far this router's in-flight count grew since the poll went out
    (optimistic accounting: a burst between two polls sees each request it sends, instead of a figure that
    stays flat until the next poll and herds the burst onto one worker; requests that finished take their
    share back out).  The ``max`` with local in-flight keeps one router from stampeding a worker that looked
    idle at the last poll; a stale or missing figure leaves the local in-flight count alone (the caller
    counts a ``no_load_data`` fallback).
    """

    __slots__ = ("_entries", "_kv_tokens", "_running_slots", "_slots", "max_age")

    def __init__(self, *, max_age: float) -> None:
        self.max_age = max_age
        self._entries: dict[str, tuple[int, float, int]] = {}
        """worker id -> (backend running + waiting, when polled, this router's in-flight when the poll went out)"""
        self._kv_tokens: dict[str, int] = {}
        self._slots: dict[str, int] = {}
        """worker id -> the slots of an engine that keeps one prompt's KV per slot (llama.cpp)"""
        self._running_slots: dict[str, int] = {}
        """worker id -> how many requests its engine runs at once (``running_slots``)"""

    def record(self, worker_id: str, load: int, *, at: float | None = None, inflight: int = 0) -> None:
        """A poll's backlog (the engine's KV capacity comes by ``record_kv``).
        ``inflight``: this router's in-flight count for the worker when the poll was sent (in the backlog)."""
        self._entries[worker_id] = (load, time.monotonic() if at is None else at, inflight)

    def record_kv(self, worker_id: str, tokens: int, *, slots: int | None = None) -> None:
        """The KV cache capacity in tokens the worker's engine reported (kept until another or ``forget``), and
        ``slots`` for an engine that keeps the KV of one prompt per slot (llama.cpp's server)."""
        self._kv_tokens[worker_id] = tokens
        if slots is not None:
            self._slots[worker_id] = slots

    def record_running_slots(self, worker_id: str, slots: int) -> None:
        """How many requests the worker's engine runs at once, as a poll found (kept until another or ``forget``)."""
        self._running_slots[worker_id] = slots

    def forget(self, worker_id: str) -> None:
        self._entries.pop(worker_id, None)
        self._kv_tokens.pop(worker_id, None)
        self._slots.pop(worker_id, None)
        self._running_slots.pop(worker_id, None)

    def kv_tokens(self, worker_id: str) -> int | None:
        """The KV cache capacity in tokens the worker's engine last reported (kept while it answers polls
        without one), or None when it never reported one."""
        return self._kv_tokens.get(worker_id)

    def slots(self, worker_id: str) -> int | None:
        """How many prompts the worker's engine caches, one per slot, when it is such an engine (else None)."""
        return self._slots.get(worker_id)

    def running_slots(self, worker_id: str) -> int | None:
        """How many requests the worker's engine runs at once: as last reported or found by a poll (a slot engine:
        its slots), or None while it is not known (an engine that never reported it nor made a request wait)."""
        found = self._running_slots.get(worker_id)
        return found if found is not None else self._slots.get(worker_id)

    def backend(self, worker_id: str, now: float | None = None) -> int | None:
        """The worker's last polled running + waiting, or None when missing or stale."""
        entry = self._entries.get(worker_id)
        if entry is None:
            return None
        load, at, _ = entry
        if (time.monotonic() if now is None else now) - at > self.max_age:
            return None
        return load

    def effective(self, worker: Worker, now: float) -> tuple[int, bool]:
        """(effective load, whether a fresh backend figure was used)."""
        entry = self._entries.get(worker.id)
        if entry is None or now - entry[1] > self.max_age:
            return worker.inflight, False
        load, _, inflight_then = entry
        return max(load + max(0, worker.inflight - inflight_then), worker.inflight), True
