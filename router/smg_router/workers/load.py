"""The one shared load snapshot (the workers' global backlog) and the effective-load rule.

The load monitor writes it; every policy instance reads it through its context (no per-instance
wiring, so a policy created by alias, label or PD slot sees the same numbers).
"""

from __future__ import annotations

import time

from smg_router.workers.worker import Worker

SHARE_DECAY = 0.8
"""Weight of the earlier polls in the share estimate: about the last five polls count."""
SHARE_PRIOR = (1.0, 1.0)
"""The sums before the first poll: a weak belief that this router sends all of a worker's backlog (as a
router alone does), which the first polls overrule."""
MIN_SHARE = 1 / 32
"""The smallest share assumed: a router that sent almost none of a worker's backlog counts each of its own
sends for at most 32."""


class LoadView:
    """Effective load = max(backend + dispatched since the poll, local in-flight) while the backend figure is
    fresh: the workers' global backlog (every replica's requests), plus what this router sent since it was read.

    "Dispatched since the poll" is how far this router's in-flight count grew since the poll went out
    (optimistic accounting: a burst between two polls sees each request it sends, instead of a figure that
    stays flat until the next poll and herds the burst onto one worker; requests that finished take their
    share back out).  It is scaled by one over this router's share of the worker's backlog (its in-flight count
    against the backlog at the recent polls): with N router replicas behind one Service, each sends about 1/N of
    a worker's requests, and the others send as it does between two polls, so each request it sends counts for
    N.  Counted once, N replicas jointly piled N times the gate onto a worker before any saw it over the gate.
    A router alone has a share of 1 (its in-flight is the backlog).  The ``max`` with local in-flight keeps one
    router from stampeding a worker that looked idle at the last poll; a stale or missing figure leaves the
    local in-flight count alone (the caller counts a ``no_load_data`` fallback).
    """

    __slots__ = ("_entries", "_kv_tokens", "_shares", "max_age")

    def __init__(self, *, max_age: float) -> None:
        self.max_age = max_age
        self._entries: dict[str, tuple[int, float, int, float]] = {}
        """worker id -> (backend running + waiting, when polled, this router's in-flight when the poll went out,
        this router's estimated share of the worker's backlog)"""
        self._kv_tokens: dict[str, int] = {}
        self._shares: dict[str, tuple[float, float]] = {}
        """worker id -> decayed sums of (this router's in-flight, the backlog) over the polls"""

    def record(
        self, worker_id: str, load: int, *, at: float | None = None, kv_tokens: int | None = None, inflight: int = 0
    ) -> None:
        """A poll's figures: the backlog, and the engine's KV capacity in tokens when it reports one.
        ``inflight``: this router's in-flight count for the worker when the poll was sent (in the backlog)."""
        ours, seen = self._shares.get(worker_id, SHARE_PRIOR)
        ours, seen = ours * SHARE_DECAY + inflight, seen * SHARE_DECAY + max(load, inflight)
        self._shares[worker_id] = (ours, seen)
        share = max(MIN_SHARE, min(1.0, ours / seen))
        self._entries[worker_id] = (load, time.monotonic() if at is None else at, inflight, share)
        if kv_tokens is not None:
            self._kv_tokens[worker_id] = kv_tokens

    def forget(self, worker_id: str) -> None:
        self._entries.pop(worker_id, None)
        self._kv_tokens.pop(worker_id, None)
        self._shares.pop(worker_id, None)

    def kv_tokens(self, worker_id: str) -> int | None:
        """The KV cache capacity in tokens the worker's engine last reported (kept while it answers polls
        without one), or None when it never reported one."""
        return self._kv_tokens.get(worker_id)

    def backend(self, worker_id: str, now: float | None = None) -> int | None:
        """The worker's last polled running + waiting, or None when missing or stale."""
        entry = self._entries.get(worker_id)
        if entry is None:
            return None
        load, at, _, _ = entry
        if (time.monotonic() if now is None else now) - at > self.max_age:
            return None
        return load

    def effective(self, worker: Worker, now: float) -> tuple[int, bool]:
        """(effective load, whether a fresh backend figure was used)."""
        entry = self._entries.get(worker.id)
        if entry is None or now - entry[1] > self.max_age:
            return worker.inflight, False
        load, _, inflight_then, share = entry
        grown = worker.inflight - inflight_then
        if grown <= 0:
            return max(load, worker.inflight), True
        return max(load + int(grown / share + 0.5), worker.inflight), True
