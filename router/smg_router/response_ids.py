"""Which worker produced each Responses API response this router relayed: stateful Responses routing.

A ``/v1/responses`` call with ``previous_response_id`` needs the worker that stored that response (engines
keep them in memory).  The relay records the ``id`` of every response it passes through -- the JSON body's
``id``, or in a stream the ``response.id`` of the first event that carries one (``response.created``) --
with the worker that produced it, in a bounded LRU map; the proxy looks the id up and hands the worker to
the policy as a hint (``policies.sticky``).  An id this replica never saw (another replica relayed it, or
this one restarted) is routed by rendezvous hashing of the id: a session key like any other.

Memory: ``MAX_RESPONSE_IDS`` entries of ~200 bytes (an id, a worker id, the map's links): ~13 MB at most.
"""

from __future__ import annotations

from collections import OrderedDict

import orjson

MAX_RESPONSE_IDS = 65536
"""Response ids remembered (the least recently used is forgotten first): a conversation continued within
the last 65536 responses this replica relayed finds its worker."""
SCAN_LIMIT = 65536
"""Bytes of a stream's start searched for its response id: the first event is far smaller."""


class ResponseIds:
    """A bounded LRU map: response id → id of the worker that produced it."""

    __slots__ = ("_map", "max_size")

    def __init__(self, max_size: int = MAX_RESPONSE_IDS) -> None:
        self.max_size = max_size
        self._map: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._map)

    def remember(self, response_id: str, worker_id: str) -> None:
        self._map[response_id] = worker_id
        self._map.move_to_end(response_id)
        if len(self._map) > self.max_size:
            self._map.popitem(last=False)

    def worker_of(self, response_id: str) -> str | None:
        worker = self._map.get(response_id)
        if worker is not None:
            self._map.move_to_end(response_id)
        return worker


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
