"""Which worker produced a Responses API response, written into the response's id: stateful Responses routing
through any replica.

A ``/v1/responses`` call with ``previous_response_id`` needs the worker that stored that response (engines keep
them in memory).  The relay tags the id of every response it passes through with its worker: the engine's id
``resp_abc`` becomes ``resp_abc_smg`` + ``TOKEN_HEX`` hex digits, the worker's token (an HMAC-SHA256 of its URL
under ``--response-id-key``, ``ResponseIdTags.token``).  Where the id appears -- the JSON body's ``id``, every event
of a stream that carries it (``_Retag`` in ``relay``), and the ``previous_response_id`` the answer repeats -- the
client sees the tagged form.  A follow-up names the tagged id; whichever replica it reaches reads the worker from the
token (the worker of the model whose token it is: ``policies.sticky``'s ``stored`` branch) and forwards the engine's
own id.  Nothing is remembered and no replica tells another anything: every replica with the same key (the default
one, or the same ``--response-id-key``) reads every tag, across restarts.

An id without a valid tag (the marker, then exactly ``TOKEN_HEX`` lower-case hex digits), or whose token is no
registered worker's (it was removed), is forwarded as sent and routed by rendezvous hashing of the id: a session key
like any other.  The token tells nothing of the worker's URL without the key; with the default key it is as
opaque as the ``x-smg-worker-id`` header (a hash of the URL).  A client that forges a token can only pick one of the
model's workers, as a session key already lets it.
"""

from __future__ import annotations

import functools
import hashlib
import hmac

import orjson

MARKER = "_smg"
"""Between the engine's id and the worker's token."""
TOKEN_HEX = 16
"""Hex digits of a worker's token (64 bits: no two workers of a fleet share one)."""
DEFAULT_KEY = b"smg-response-id"
"""The key without ``--response-id-key``: the same on every replica, so tags are read everywhere; not a secret."""
SCAN_LIMIT = 65536
"""Bytes of a stream's start searched for its response id: the first event is far smaller."""
_HEX = frozenset("0123456789abcdef")


class ResponseIdTags:
    """Tags response ids with their worker and reads the tags back."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes = DEFAULT_KEY) -> None:
        self._key = key

    def token(self, worker_url: str) -> str:
        return _token(self._key, worker_url)

    def tag(self, response_id: str, worker_url: str) -> str:
        """The id the client gets for ``response_id``, produced by the worker at ``worker_url``."""
        return response_id + MARKER + _token(self._key, worker_url)

    def untag(self, tagged: str) -> tuple[str, str | None]:
        """(the engine's id, the worker's token) of a tagged id; (the id as given, None) without a valid tag."""
        head, marker, token = tagged.rpartition(MARKER)
        if not marker or not head or len(token) != TOKEN_HEX or not _HEX.issuperset(token):
            return tagged, None
        return head, token


@functools.lru_cache(maxsize=4096)
def _token(key: bytes, worker_url: str) -> str:
    return hmac.new(key, worker_url.encode(), hashlib.sha256).hexdigest()[:TOKEN_HEX]


def quoted(text: str) -> bytes:
    """``text`` as a JSON string, quotes included: what is searched and replaced in an answer's bytes."""
    return orjson.dumps(text)


def id_of_body(body: bytes) -> str | None:
    """The ``id`` of a JSON response body, or None."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    rid = parsed.get("id") if isinstance(parsed, dict) else None
    return rid if isinstance(rid, str) and rid else None


def id_of_events(buffer: bytes) -> str | None:
    """The ``response.id`` of the first complete SSE ``data:`` line of ``buffer`` that carries one, or None."""
    for line in buffer.split(b"\n")[:-1]:  # the last piece may be an incomplete line
        if not line.startswith(b"data:") or b'"response"' not in line:
            continue
        try:
            event = orjson.loads(line[5:])
        except orjson.JSONDecodeError:
            continue
        response = event.get("response") if isinstance(event, dict) else None
        rid = response.get("id") if isinstance(response, dict) else None
        if isinstance(rid, str) and rid:
            return rid
    return None
