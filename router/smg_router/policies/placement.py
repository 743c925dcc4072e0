"""Rendezvous placement and the load gate: what cache-aware placement and session keys share.

Both place a key (a prompt's leading chars, a session key) on the worker that ranks first for it by
rendezvous hashing among the workers within the load gate.  Every router replica computes the same ranking
from the same key, worker ids (hashes of URLs) and shared backlog, so replicas that never talk agree, and a
key moves only when its worker leaves, becomes unroutable or goes over the gate.

The key is one blake2b digest of the leading chars, as an integer; a worker's score for it is a 64-bit mix of
the key and the worker's own digest (splitmix64's finalizer over their xor), a few integer operations instead
of a keyed blake2b per worker (that was 3% of a router's busy time in the proxy benchmark's profile).  Each score
still depends on the key and that worker only, so a worker that leaves moves only its own keys.  The ranking
changed with it: replicas of a version before and after rank differently while a rolling upgrade runs, and a
session key pinned before may move once.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

from smg_router.settings import PolicySettings
from smg_router.workers.worker import Worker

_MASK64 = (1 << 64) - 1


def placement_key(text: str, chars: int) -> int:
    """The 64-bit digest every replica derives from a text to rank the workers for it."""
    return int.from_bytes(hashlib.blake2b(text[:chars].encode("utf-8", "surrogatepass"), digest_size=8).digest())


@functools.lru_cache(maxsize=4096)
def _worker_digest(worker_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(worker_id.encode(), digest_size=8).digest())


def rendezvous_score(key: int, worker_id: str) -> int:
    """Highest random weight of a worker for ``key``: the same on every replica (ids are hashes of URLs)."""
    x = key ^ _worker_digest(worker_id)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def within_gate(loads: Sequence[int], slots: Sequence[int | None], settings: PolicySettings) -> list[bool]:
    """Per worker: not over the load gate.  A worker is over it when requests already wait there for a running
    slot (its load is more than its engine's running slots), another worker would make it wait less (fewer requests
    beyond its slots, or a free one), and its load is more than ``balance_rel_threshold`` times the least load.
    Every slot busy with none waiting is not over: the request starts at the next finish, which a miss elsewhere
    rarely beats by its prefill (and on an engine that keeps one prompt per slot a miss evicts another prompt).
    An engine whose running slots are not known (``LoadView.running_slots``) has shown no limit: never over."""
    lo = min(loads) * settings.balance_rel_threshold
    # Requests beyond the running slots; an engine that showed no limit counts as one with a free slot.
    excess = [-1 if n is None else x - n for x, n in zip(loads, slots, strict=True)]
    least = min(excess)
    return [e <= 0 or e <= least or x <= lo for e, x in zip(excess, loads, strict=True)]


def rendezvous_ranked(workers: Sequence[Worker], ok: Sequence[bool], key: int, count: int) -> list[int]:
    """Indices of the ``count`` workers that rank highest for ``key`` among those with ``ok``, best first
    (fewer when fewer are ``ok``; the least loaded always is, so never none)."""
    scored = sorted(((rendezvous_score(key, w.id), i) for i, w in enumerate(workers) if ok[i]), reverse=True)
    assert scored, "the least loaded worker is always within the gate"
    return [i for _, i in scored[:count]]


def rendezvous_pick(workers: Sequence[Worker], ok: Sequence[bool], key: int) -> int:
    """Index of the worker that ranks first for ``key`` among those with ``ok`` (the least loaded is always
    within the gate, so there is one)."""
    best, best_score = 0, -1
    for i, w in enumerate(workers):
        if ok[i]:
            score = rendezvous_score(key, w.id)
            if score > best_score:
                best, best_score = i, score
    return best
