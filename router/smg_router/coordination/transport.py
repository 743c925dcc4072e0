"""The transport to the other router replicas (``PeerSync``): per peer a queue and a sender task, heartbeats, claims.

Called by the request path (``tell``, through ``base.Peers``), by ``holds.Holds`` (``tell_prefill``, ``claim``) and by
readiness (``in_sync``, ``alone``); started and stopped by ``core.RouterCore`` (task ``smg-peer-sync``).  The bodies
it sends and reads are ``messages``'s; the receiving end is ``receiver.Receiver``.

Peers come from ``--peer URL`` and from ``--peers-dns HOST:PORT`` (a headless Service: every ready replica's address,
re-resolved every DNS_INTERVAL); a peer that answers ``{"self": true}`` was this router and is asked no more.  Their
addresses (the names of ``--peer`` resolved as often) are the only ones a batch is accepted from (``knows``).  With
``--peer-secret`` each batch is signed and a peer's answer must be too (``auth``): until a peer answered once (signed,
with a secret), it is sent the empty first batch alone, never a route nor a prefill, so a pod that the name lists but
that is no replica of this router (it does not hold the secret) learns no prompt; nothing sends the secret.  Each
peer has its own queue and sender task, so a slow or dead peer delays nobody else; a sender waits BATCH_DELAY after a
batch's first route for more to join it.  A queue holds ``--peer-queue-bytes`` at most (the oldest go first) and
nothing older than ``--peer-queue-seconds``: a peer that accepts connections and never answers costs that much memory,
no more.  A batch that fails is dropped, not retried: a route is a hint about a cache, and a late one is a wrong one.
A peer that leaves the set takes its sender task and its metric series with it.  A claimed start does not wait: the
sender goes at once (its lead waits for the answers).  ``in_sync`` says whether every peer acknowledged a batch (or the
heartbeat sent every HEARTBEAT seconds; the first at once, then every FIRST_CONTACT seconds until the peer first
answers) and sent one (``heard``) within STALE seconds; while it does not, leads and turns do not claim (``holds``) and
readiness may wait (``core``).  The policy does not look: with peers configured it judges room from its index
(``PolicySettings.index_complete``), which then misses the silent peers' routes; rank-only placement is for replicas
that have no peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import secrets
import socket
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp

from smg_router.coordination import auth
from smg_router.coordination.messages import PATH, Prefill, Record, decode_answer, encode_batch
from smg_router.metrics import Metrics

log = logging.getLogger(__name__)

BATCH_DELAY = 0.01
"""Seconds a sender waits after the first route of a batch for more to join it: one POST per route would cost
each peer a request's worth of CPU per route (measured: +140 µs a request with two replicas at ~1000 req/s), and a
route 10 ms late is as good as on time (a group's next request is rarely that close behind its first)."""
HEARTBEAT = 1.0
"""Seconds between two batches to an idle peer (an empty one): what keeps ``in_sync`` true without traffic."""
FIRST_CONTACT = 0.1
"""Seconds between two heartbeats to a peer that never answered yet (the first goes at once): replicas started
together are in sync, and claim, a tenth of a second after both listen, not a heartbeat or more later (the first
requests of a rollout's new replica would else each lead a prefill of their own)."""
STALE = 3.5
"""A peer that acknowledged nothing for this long is out of sync."""
DNS_INTERVAL = 5.0
"""Seconds between two resolutions of ``--peers-dns``."""
SEND_TIMEOUT = 2.0
MAX_PENDING = 8192
"""Prefills queued for one peer at most; past it the oldest are dropped (counted ``dropped``)."""
MAX_BATCH_RECORDS = 2048
"""Routes and prefills sent in one batch at most: a batch's parse on the receiver is one call (``messages``)."""
RECORD_OVERHEAD = 64
"""Bytes a queued route costs beyond its text (what ``--peer-queue-bytes`` counts it for)."""
OUTCOMES = ("sent", "failed", "dropped", "expired")
"""The outcomes of ``smg_peer_records_sent_total``: a peer that leaves takes its series of each."""


def canonical_ip(address: str) -> str:
    """An IP address as ``knows`` compares them (an IPv4 address mapped into IPv6 as the IPv4 one); else as given."""
    try:
        ip = ipaddress.ip_address(address.strip("[]").partition("%")[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


@dataclass(slots=True)
class _Claim:
    """A start told to the peers whose answers a lead waits for (``PeerSync.claim``)."""

    waiting: set[str]
    """The urls of the peers that have not answered the batch carrying it yet."""
    answered: Callable[[list[str]], None]
    leaders: list[str] = field(default_factory=list)
    """The ids of the peers that answered that they lead the same."""


@dataclass(slots=True)
class _Peer:
    url: str
    pending: deque[tuple[float, Record]] = field(default_factory=deque)
    """(when queued, the route), oldest first."""
    prefills: OrderedDict[tuple[str, str], tuple[bool, float]] = field(default_factory=OrderedDict)
    """(worker url, leading chars) -> (done, when queued), in the order told; a lead and its end that meet here cancel
    out."""
    queued: int = 0
    """Bytes of ``pending`` and ``prefills`` (``RECORD_OVERHEAD`` each beyond their text)."""
    addresses: frozenset[str] = frozenset()
    """Its IP addresses (its url's host, resolved): a batch from one of them is its (``PeerSync.knows``)."""
    heard_at: float = float("-inf")
    """When a batch from its address last came (``PeerSync.heard``)."""
    verified: bool = False
    """It answered a batch (signed, with a secret): a replica of this router, told routes and prefills from then on."""
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    hurry: asyncio.Event = field(default_factory=asyncio.Event)
    """Set with a claimed start: the batch goes without waiting BATCH_DELAY for more."""
    acked_at: float = float("-inf")
    is_self: bool = False
    failing: bool = False
    task: asyncio.Task[None] | None = None


class PeerSync:
    """Tells the peers what this router routed (``tell``), says whether they are all in sync (``in_sync``)."""

    def __init__(
        self,
        *,
        urls: Sequence[str],
        dns: str | None,
        metrics: Metrics,
        secret: str | None = None,
        queue_bytes: int = 8 * 1024 * 1024,
        queue_seconds: float = 10.0,
        batch_bytes: int = 1024 * 1024,
        bind: str | None = None,
        scheme: str = "http",
    ) -> None:
        self.id = secrets.token_hex(8)
        """This router's id in the batches it sends: how it knows a batch of its own when a DNS name lists it."""
        self._static = tuple(u.rstrip("/") for u in urls)
        self._dns = dns
        self.batch_bytes = batch_bytes
        """The largest batch this router reads (``admin.peer_routes``: 413 above it) and sends."""
        self._batch_chars = max(1024, batch_bytes // 8)
        """Text per batch at most, and per record: a longer prompt is told by its leading chars (what a tree
        match needs), so that no batch is refused for its size (a char may take 4 bytes and JSON escapes more)."""
        self._queue_bytes = queue_bytes
        self._queue_seconds = queue_seconds
        self._scheme = scheme
        self._bind = bind
        """The address this router's batches leave from (its ``--host`` when that is one address): what the peers
        check them by."""
        self.secret = secret.encode() if secret else None
        self.verifier = auth.Verifier(secret) if secret else None
        """Checks the batches' signatures (``admin.peer_routes``); None: no ``--peer-secret``."""
        self._headers = {"Content-Type": "application/json"}
        self._metrics = metrics
        self._peers: dict[str, _Peer] = {}
        self._claims: dict[tuple[str, str], _Claim] = {}
        """(worker url, leading chars) -> the claim on that start, until every peer answered."""
        self._session: aiohttp.ClientSession | None = None
        self._unresolved = False
        """The last resolution of the DNS name failed (warned once until it resolves again)."""
        metrics.add_peers_in_sync_source(lambda: float(self.in_sync()))

    # -- the request path ---------------------------------------------------------------------------
    def tell(self, role: str, model: str, worker_url: str, text: str, head: int) -> None:
        """Queue one routed request for every peer (their senders wake up; nothing is awaited here)."""
        if len(text) > self._batch_chars:
            text = text[: self._batch_chars]
            head = min(head, len(text))
        record = (role, model, worker_url, text, head)
        size = _size(record)
        now = time.monotonic()
        for peer in self._peers.values():
            if peer.is_self:
                continue
            peer.pending.append((now, record))
            peer.queued += size
            while peer.queued > self._queue_bytes and peer.pending:
                peer.queued -= _size(peer.pending.popleft()[1])
                self._metrics.peer_records_sent.labels(peer.url, "dropped").inc()
            peer.wake.set()

    def tell_prefill(self, worker_url: str, prefix: str, *, done: bool, hurry: bool = False) -> None:
        """Queue a first prefill's start (``done`` False) or end for every peer; it goes with the next batch (a
        prefix longer than a batch may carry is not told: cut, it would name another).  An end whose start has not
        gone out yet goes instead of it (the peer may know of the lead all the same: this router's answer to its
        claim named it, ``holds.Holds.receive``).  A start whose last end has not gone out takes that end back: the
        peer's lead then goes on until this one's end.  ``hurry``: the batch goes without the batch delay."""
        if len(prefix) > self._batch_chars:
            return
        key = (worker_url, prefix)
        for peer in self._peers.values():
            if peer.is_self:
                continue
            pending = peer.prefills
            now = time.monotonic()
            queued = pending.get(key)
            if queued is not None and queued[0] is not done:
                if done:
                    pending[key] = (True, now)
                    self._answered(peer.url, key, None)  # a start that will not go: nothing for that peer to answer
                else:
                    del pending[key]
                    peer.queued -= RECORD_OVERHEAD + len(worker_url) + len(prefix)
                continue
            if queued is None:
                peer.queued += RECORD_OVERHEAD + len(worker_url) + len(prefix)
            pending[key] = (done, now)
            while (len(pending) > MAX_PENDING or peer.queued > self._queue_bytes) and pending:
                (url, old), _ = pending.popitem(last=False)
                peer.queued -= RECORD_OVERHEAD + len(url) + len(old)
                self._answered(peer.url, (url, old), None)
                self._metrics.peer_records_sent.labels(peer.url, "dropped").inc()
            if key not in pending:
                continue
            peer.wake.set()
            if hurry:
                peer.hurry.set()

    def claim(self, worker_url: str, prefix: str, answered: Callable[[list[str]], None]) -> None:
        """Tell a first prefill's start (``tell_prefill``); ``answered`` is called once every peer answered the
        batch that carried it (a failed batch, a dropped peer count as answers), with the ids of the peers that
        lead the same themselves.  Nobody to tell, or a prefix too long to tell: at once, with none."""
        peers = {p.url for p in self._peers.values() if not p.is_self and p.verified}  # the others are told nothing
        key = (worker_url, prefix)
        if not peers or len(prefix) > self._batch_chars:
            answered([])
            return
        if (stale := self._claims.pop(key, None)) is not None:
            stale.answered(stale.leaders)
        self._claims[key] = _Claim(peers, answered)
        self.tell_prefill(worker_url, prefix, done=False, hurry=True)

    def _answered(self, peer_url: str, key: tuple[str, str], leader: str | None) -> None:
        """A peer answered the start of ``key`` (``leader``: its id, when it leads the same itself)."""
        claim = self._claims.get(key)
        if claim is None or peer_url not in claim.waiting:
            return
        claim.waiting.discard(peer_url)
        if leader is not None:
            claim.leaders.append(leader)
        if not claim.waiting:
            del self._claims[key]
            claim.answered(claim.leaders)

    def in_sync(self) -> bool:
        """Whether there is at least one peer and every one acknowledged a batch and sent one within STALE seconds (a
        new replica is not in sync before it heard from each of its peers: they may not know of it yet)."""
        now = time.monotonic()
        peers = [p for p in self._peers.values() if not p.is_self]
        return bool(peers) and all(now - p.acked_at < STALE and now - p.heard_at < STALE for p in peers)

    def knows(self, address: str | None) -> bool:
        """Whether ``address`` (where a batch came from) is a peer's: the only batches ``POST /peers/routes`` takes."""
        if address is None:
            return False
        ip = canonical_ip(address)
        return any(ip in p.addresses for p in self._peers.values())

    def heard(self, address: str) -> None:
        """A batch came from ``address`` (checked: ``knows``): the peers there are heard (``in_sync``)."""
        ip, now = canonical_ip(address), time.monotonic()
        for peer in self._peers.values():
            if ip in peer.addresses:
                peer.heard_at = now

    def peer_urls(self) -> list[str]:
        """The peers known now (for tests and logs)."""
        return sorted(u for u, p in self._peers.items() if not p.is_self)

    def alone(self) -> bool:
        """Whether no other replica is known: the DNS name lists this router alone (or nothing yet), and every
        ``--peer`` URL turned out to be this router's own."""
        if any(u not in self._peers for u in self._static):
            return False  # not even asked yet
        return all(p.is_self for p in self._peers.values())

    # -- background ---------------------------------------------------------------------------------
    async def run(self) -> None:
        """Keep the peer set (static URLs, then the DNS name's addresses) and a sender per peer."""
        connector = aiohttp.TCPConnector(local_addr=(self._bind, 0) if self._bind else None)
        self._session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=SEND_TIMEOUT))
        try:
            while True:
                wanted = set(self._static) | await self._resolve()
                for url in wanted - set(self._peers):
                    peer = self._peers[url] = _Peer(url)
                    peer.task = asyncio.get_running_loop().create_task(self._send_loop(peer), name=f"smg-peer {url}")
                    log.info("peer router %s added", url)
                for url in set(self._peers) - wanted:
                    await self._drop(self._peers.pop(url))
                for peer in self._peers.values():
                    peer.addresses = await self._addresses(peer.url, peer.addresses)
                await asyncio.sleep(DNS_INTERVAL)
        finally:
            for peer in list(self._peers.values()):
                await self._drop(peer)
            self._peers.clear()
            await self._session.close()

    async def _resolve(self) -> set[str]:
        if not self._dns:
            return set()
        host, _, raw_port = self._dns.rpartition(":")
        port = int(raw_port)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as e:
            if not self._unresolved:
                log.warning("peers: cannot resolve %s: %s (keeping the peers known; asking again)", self._dns, e)
            self._unresolved = True
            return {u for u in self._peers if u not in self._static}
        if self._unresolved:
            log.info("peers: %s resolves again", self._dns)
        self._unresolved = False
        urls = set()
        for family, *_, sockaddr in infos:
            ip = str(sockaddr[0])
            addr = f"[{ip}]" if family == socket.AF_INET6 else ip
            urls.add(f"{self._scheme}://{addr}:{port}")
        return urls

    async def _addresses(self, url: str, known: frozenset[str]) -> frozenset[str]:
        """The IP addresses of a peer's url (its host, resolved when it is a name; ``known`` when that fails)."""
        host = urlsplit(url).hostname or ""
        if _is_ip(host):
            return frozenset({canonical_ip(host)})
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError:
            return known
        return frozenset(canonical_ip(str(info[4][0])) for info in infos)

    async def _drop(self, peer: _Peer) -> None:
        """A peer that left the set: its claims answered, its sender task ended, its metric series gone."""
        for key in list(self._claims):
            self._answered(peer.url, key, None)
        if peer.task is not None:
            peer.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await peer.task
        for outcome in OUTCOMES:
            self._metrics.peer_records_sent.remove(peer.url, outcome)
        if not peer.is_self:
            log.info("peer router %s removed", peer.url)

    async def _send_loop(self, peer: _Peer) -> None:
        first = True
        while not peer.is_self:
            if not first:
                idle = HEARTBEAT if peer.acked_at > float("-inf") else FIRST_CONTACT
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(peer.wake.wait(), idle)
            first = False
            if (peer.pending or peer.prefills) and not peer.hurry.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(peer.hurry.wait(), BATCH_DELAY)
            peer.wake.clear()
            peer.hurry.clear()
            self._expire(peer)
            batch: list[Record] = []
            prefills: list[Prefill] = []
            if peer.verified:  # a pod not known as a replica yet is sent nothing but the empty first batch
                chars = 0
                while (
                    peer.pending
                    and len(batch) < MAX_BATCH_RECORDS
                    and chars + len(peer.pending[0][1][3]) <= self._batch_chars
                ):
                    record = peer.pending.popleft()[1]
                    peer.queued -= _size(record)
                    batch.append(record)
                    chars += len(record[3])
                while (
                    peer.prefills
                    and len(batch) + len(prefills) < MAX_BATCH_RECORDS
                    and chars + len(next(iter(peer.prefills))[1]) <= self._batch_chars
                ):
                    (url, prefix), (done, _) = peer.prefills.popitem(last=False)
                    peer.queued -= RECORD_OVERHEAD + len(url) + len(prefix)
                    prefills.append((url, prefix, done))
                    chars += len(prefix)
                if peer.pending or peer.prefills:
                    peer.wake.set()  # the rest goes in the next batch
            await self._send(peer, batch, prefills)

    def _expire(self, peer: _Peer) -> None:
        """Drop what waited for the peer longer than ``--peer-queue-seconds`` (counted ``expired``)."""
        old = time.monotonic() - self._queue_seconds
        expired = 0
        while peer.pending and peer.pending[0][0] < old:
            peer.queued -= _size(peer.pending.popleft()[1])
            expired += 1
        while peer.prefills and next(iter(peer.prefills.values()))[1] < old:
            (url, prefix), _ = peer.prefills.popitem(last=False)
            peer.queued -= RECORD_OVERHEAD + len(url) + len(prefix)
            self._answered(peer.url, (url, prefix), None)
            expired += 1
        if expired:
            self._metrics.peer_records_sent.labels(peer.url, "expired").inc(expired)

    async def _send(self, peer: _Peer, batch: list[Record], prefills: list[Prefill]) -> None:
        assert self._session is not None
        body = encode_batch(self.id, batch, prefills)
        starts = [(url, prefix) for url, prefix, done in prefills if not done]
        leads: frozenset[tuple[str, str]] = frozenset()
        leader: str | None = None
        headers, nonce = self._headers, ""
        if self.secret is not None:
            signed, nonce = auth.sign_batch(self.secret, body)
            headers = {**headers, **signed}
        try:
            async with self._session.post(peer.url + PATH, data=body, headers=headers) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {raw[:200]!r}")
                if self.secret is not None and not auth.answer_signed(self.secret, nonce, resp.headers, raw):
                    raise RuntimeError("its answer is not signed with --peer-secret: no replica of this router")
                answer = decode_answer(raw)
                if answer.is_self:
                    peer.is_self = True
                    log.info("peer %s is this router: not telling it", peer.url)
                    return
                leader, leads = answer.leader, answer.leads
        except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as e:
            self._metrics.peer_records_sent.labels(peer.url, "failed").inc(len(batch) + len(prefills))
            if not peer.failing:
                why = str(e) or type(e).__name__
                log.warning("peer %s: %s (its routes are dropped until it answers)", peer.url, why)
            peer.failing = True
            return
        finally:
            for key in starts:
                self._answered(peer.url, key, leader if key in leads else None)
        if peer.failing:
            log.info("peer %s answers again", peer.url)
        peer.failing = False
        peer.acked_at = time.monotonic()
        if not peer.verified:
            peer.verified = True
            if peer.pending or peer.prefills:
                peer.wake.set()  # what was queued meanwhile goes now
        self._metrics.peer_records_sent.labels(peer.url, "sent").inc(len(batch) + len(prefills))


def _size(record: Record) -> int:
    """What a queued route counts for in ``--peer-queue-bytes``."""
    return RECORD_OVERHEAD + len(record[1]) + len(record[2]) + len(record[3])


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True
