"""Who may speak on the replica channel (``POST /peers/routes``), and how both ends prove that they hold the peer secret
(``--peer-secret``) without ever sending it.

Called by the sender (``transport.PeerSync``: it signs each batch, and checks the answer's signature before it counts a
peer as a replica) and by the receiver (``admin.peer_routes``, through ``Verifier``; ``pod`` signs the answer it merges
for its processes).

A batch carries three headers: the sender's clock (``TIME``), a random ``NONCE`` and ``SIGNATURE``, an HMAC-SHA256
under the secret of (the word "batch", the time, the nonce, the SHA-256 of the body).  The receiver refuses (401) a
batch whose signature is wrong, whose time is more than SKEW seconds off its own clock, or whose nonce it saw within
the last 2 x SKEW seconds (a replay).  The answer carries ``SIGNATURE`` over (the word "answer", the batch's nonce, the
SHA-256 of the answer's body): a pod that answers without it (any pod the discovery lists that is not a replica of
this router: it does not hold the secret) is never sent a route, a prefill or anything but the empty first batch,
which carries no secret and no prompt (``transport``).  Compared in constant time (``hmac.compare_digest``).

What it does not guarantee.  The body is not encrypted: a route's text travels in clear between replicas (as the
requests travel from the clients to the router), so the network between pods must be trusted for confidentiality; a
holder of the secret on a peer's address can still send any well-formed batch.  Without a secret the channel is
guarded by the source address alone (``PeerSync.knows``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

from smg_router.errors import Unauthorized

TIME = "X-SMG-Peer-Time"
NONCE = "X-SMG-Peer-Nonce"
SIGNATURE = "X-SMG-Peer-Signature"
SOURCE = "X-SMG-Peer-Source"
"""The address a batch came from, set by the process that read it from the network when it hands the batch to another
over a unix socket (``--processes``); read only from a unix socket, never from the network."""
HEADERS = (TIME, NONCE, SIGNATURE, SOURCE)
"""What a process of a pod passes on with a batch it hands to another."""
SKEW = 30.0
"""Seconds a batch's time may differ from the receiver's clock (replicas run on clocks synced by their nodes)."""
MAX_NONCES = 65536
"""Nonces remembered at most (a peer sends a batch every ~10 ms at most: 6000 in 2 x SKEW seconds)."""


def _mac(secret: bytes, *parts: bytes) -> str:
    return hmac.new(secret, b"\n".join(parts), hashlib.sha256).hexdigest()


def sign_batch(secret: bytes, body: bytes, *, at: float | None = None) -> tuple[dict[str, str], str]:
    """The headers of a batch signed under ``secret`` (``at``: the sender's clock, now by default), and its nonce."""
    stamp = f"{time.time() if at is None else at:.3f}"
    nonce = secrets.token_hex(16)
    signature = _mac(secret, b"batch", stamp.encode(), nonce.encode(), hashlib.sha256(body).digest())
    return {TIME: stamp, NONCE: nonce, SIGNATURE: signature}, nonce


def sign_answer(secret: bytes, nonce: str, body: bytes) -> str:
    """The signature of the answer ``body`` to the batch whose nonce was ``nonce``."""
    return _mac(secret, b"answer", nonce.encode(), hashlib.sha256(body).digest())


def answer_signed(secret: bytes, nonce: str, headers: Mapping[str, str], body: bytes) -> bool:
    """Whether an answer carries the signature only a holder of ``secret`` could make for it."""
    given = headers.get(SIGNATURE, "")
    return hmac.compare_digest(given.encode(), sign_answer(secret, nonce, body).encode())


class Verifier:
    """The receiver's check of a batch's signature, time and nonce (the module docstring)."""

    def __init__(self, secret: str, *, clock: Callable[[], float] = time.time) -> None:
        self.secret = secret.encode()
        self._clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()
        """Nonce -> when it came, oldest first, for 2 x SKEW seconds (MAX_NONCES at most)."""

    def check(self, headers: Mapping[str, str], body: bytes) -> str:
        """The batch's nonce, or a 401 saying what is wrong (never the expected signature)."""
        stamp, nonce, given = (headers.get(h, "") for h in (TIME, NONCE, SIGNATURE))
        if not (stamp and nonce and given):
            raise Unauthorized(f"a peer batch needs {TIME}, {NONCE} and {SIGNATURE} (--peer-secret)", code="unsigned")
        expected = _mac(self.secret, b"batch", stamp.encode(), nonce.encode(), hashlib.sha256(body).digest())
        if not hmac.compare_digest(given.encode(), expected.encode()):
            raise Unauthorized("the peer batch's signature does not match (--peer-secret)", code="bad_signature")
        now = self._clock()
        try:
            at = float(stamp)
        except ValueError:
            at = float("nan")
        if not abs(now - at) <= SKEW:
            raise Unauthorized(f"the peer batch's time is more than {SKEW:g} s off this router's", code="stale_batch")
        while self._seen and (len(self._seen) >= MAX_NONCES or next(iter(self._seen.values())) < now - 2 * SKEW):
            self._seen.popitem(last=False)
        if nonce in self._seen:
            raise Unauthorized("the peer batch was sent before (its nonce was seen)", code="replayed_batch")
        self._seen[nonce] = now
        return nonce
