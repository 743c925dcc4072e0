"""Session pinning: the step before every policy's own choice, for requests that carry a routing key.

A request with a routing key (the ``x-smg-routing-key`` header, or the ``previous_response_id`` of a
Responses call) goes to the worker its key ranks first by rendezvous hashing among the candidates within
the load gate (``placement``: the same gate as cache_aware's, over the effective loads of ``LoadView``).
So a key stays on one worker, every replica sends it to the same one, and it moves only when that worker
leaves, becomes unroutable, was already tried by this request (retries exclude it), or is over the gate.

A worker known to hold the request's state (``RouteRequest.worker_hint``: the worker that produced the
previous response, named by the tag of its id) is taken whenever it is a candidate, over the gate or not: no other
worker can answer.

``Policy.route`` calls ``pin`` for every policy alike and then lets the policy record the choice
(``Policy.pinned``: cache_aware inserts the text for that worker, so its tree stays true).
"""

from __future__ import annotations

from collections.abc import Sequence

from smg_router.policies.placement import placement_key, rendezvous_pick, within_gate
from smg_router.settings import PolicySettings
from smg_router.workers.worker import Worker

KEY_CHARS = 4096
"""Leading chars of a routing key that are hashed (header values are bounded by the server anyway)."""


def pin(
    workers: Sequence[Worker],
    loads: Sequence[int],
    slots: Sequence[int | None],
    key: str,
    hint: str | None,
    settings: PolicySettings,
) -> tuple[int, str]:
    """(index of the pinned worker, decision branch): ``stored`` for the hinted worker, else ``session``."""
    if hint is not None:
        for i, w in enumerate(workers):
            if w.id == hint:
                return i, "stored"
    return rendezvous_pick(workers, within_gate(loads, slots, settings), placement_key(key, KEY_CHARS)), "session"
