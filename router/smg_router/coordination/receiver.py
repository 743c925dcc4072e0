"""The receiving end of the replica channel, ``POST /peers/routes`` (``admin.peer_routes`` calls ``Receiver.accept``).

Who may send, checked in this order before anything of the batch is read or applied: a router with no peers takes no
batch (404 ``peers_disabled``); a batch from an address that is no peer's (``transport.PeerSync.knows``: the
``--peer`` hosts, resolved, and the addresses ``--peers-dns`` lists) is refused (403 ``not_a_peer``); a body over
``--peer-batch-bytes`` is refused (413); with ``--peer-secret`` a batch not signed with it, too old or seen before is
refused (401: ``auth``).  Each refusal is counted in ``smg_peer_batches_rejected_total``.

Then the batch, checked whole (``messages.decode_batch``), is applied in slices of at most SLICE_SECONDS of work with
turns of the event loop between two, so that no request waits behind a big batch for more than a slice; and only
what names this router's fleet: a route whose worker url no worker of this router has is dropped (``unknown_worker``),
as one whose model or role is not that worker's (``unknown_model``; a worker whose model is not known yet takes
none), counted in ``smg_peer_records_rejected_total``: a peer's batch never makes a tree, a metric series or anything
else for a name the fleet does not have.  A prefill on a worker this router does not serve is dropped the same way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import orjson

from smg_router import wire
from smg_router.coordination import auth, messages
from smg_router.coordination.holds import Holds
from smg_router.coordination.transport import PeerSync
from smg_router.errors import NotFound, PayloadTooLarge, RouterError, Unauthorized
from smg_router.http_io import parse_json_object, read_body
from smg_router.metrics import Metrics
from smg_router.policies.registry import PolicyRegistry
from smg_router.workers.registry import WorkerRegistry
from smg_router.workers.worker import worker_id_for

SLICE_SECONDS = 0.002
"""Work on a batch between two turns of the event loop, at most (a route takes a few to a few hundred µs)."""


class Forbidden(RouterError):
    status, type = 403, "permission_error"


def source_of(request: wire.Request) -> str | None:
    """Where a batch came from: the connection's address, or, on a unix socket (a process of the pod handing it over:
    ``--processes``), the address that process read it from (``auth.SOURCE``)."""
    if request.remote is not None:
        return request.remote
    return request.headers.get(auth.SOURCE)


class Receiver:
    """Takes the peers' batches (the module docstring)."""

    def __init__(
        self,
        *,
        peers: PeerSync | None,
        registry: WorkerRegistry,
        policies: PolicyRegistry,
        holds: Holds,
        metrics: Metrics,
    ) -> None:
        self._peers = peers
        self._registry = registry
        self._policies = policies
        self._holds = holds
        self._metrics = metrics

    async def accept(self, request: wire.Request) -> wire.Response:
        """``POST /peers/routes``: the checks, then the batch applied; the answer (signed with a secret)."""
        peers, rejected = self._peers, self._metrics.peer_batches_rejected
        if peers is None:
            rejected.labels("peers_disabled").inc()
            raise NotFound(
                "this router has no peers (--peer, --peers-dns): it takes no peer batches", code="peers_disabled"
            )
        source = source_of(request)
        if not peers.knows(source):
            rejected.labels("not_a_peer").inc()
            raise Forbidden(f"{source} is no peer of this router (--peer, --peers-dns)", code="not_a_peer")
        try:
            raw = await read_body(request, peers.batch_bytes)
        except PayloadTooLarge:
            rejected.labels("too_large").inc()
            raise
        nonce = ""
        if peers.verifier is not None:
            try:
                nonce = peers.verifier.check(request.headers, raw)
            except Unauthorized as e:
                rejected.labels(e.code or "unsigned").inc()
                raise
        assert source is not None  # knows() said so
        peers.heard(source)
        batch = messages.decode_batch(parse_json_object(raw), own=peers.id)
        answer = messages.SELF if batch is None else await self._apply(batch, peers.id)
        body = orjson.dumps(answer)
        headers = {} if peers.secret is None else {auth.SIGNATURE: auth.sign_answer(peers.secret, nonce, body)}
        return wire.Response(body=body, content_type="application/json", headers=headers)

    async def _apply(self, batch: messages.Batch, own: str) -> dict[str, object]:
        """The routes of a batch on this router's fleet, in slices; then its prefills (``holds``)."""
        dropped = self._metrics.peer_records_rejected
        applied = 0
        started = time.perf_counter()
        for role, model, url, text, head in batch.records:
            worker = self._registry.get(worker_id_for(url))
            if worker is None:
                dropped.labels("unknown_worker").inc()
            elif worker.role != role or worker.model_id != model:
                dropped.labels("unknown_model").inc()
            else:
                applied += self._policies.policy_for(role, model).observe(model, url, text, head)
            if time.perf_counter() - started > SLICE_SECONDS:
                await _turns()
                started = time.perf_counter()
        serves: Callable[[str], bool] = lambda url: self._registry.get(worker_id_for(url)) is not None  # noqa: E731
        unknown = sum(not serves(url) for url, _, _ in batch.prefills)
        if unknown:
            dropped.labels("unknown_worker").inc(unknown)
        told, leads = self._holds.receive(batch.sender, batch.prefills, serves=serves)
        applied += told
        total = len(batch.records) + len(batch.prefills)
        received = self._metrics.peer_records_received
        received.labels("applied").inc(applied)
        received.labels("ignored").inc(total - applied)
        return messages.encode_answer(applied=applied, ignored=total - applied, own=own, leads=leads)


async def _turns() -> None:
    """Three turns of the event loop (``core.run_tree_upkeep`` says why three): what waited runs before the next
    slice."""
    for _ in range(3):
        await asyncio.sleep(0)
