"""The bodies of ``POST /peers/routes``, both ways: encoded by the sender (``transport.PeerSync``), decoded and
checked by the receiver (``admin.peer_routes``), the answers of a pod's processes merged into one (``pod``).

A batch is ``{"from": <router id>, "records": [[role, model, worker url, text, head], ...], "prefills": [[worker
url, leading chars, done], ...]}``: the routes, then the first prefills a request of the sender leads (``done``
false) or that ended (``done`` true); a router of an older version sends no "prefills".  The answer is ``{"applied",
"ignored", "id", "leads": [[worker url, leading chars], ...]}`` (the starts told that the receiver leads itself: how a
claim learns whether to yield), or ``{"self": true}`` when the batch came from the receiver itself.  The OpenAPI
document (``openapi.SCHEMAS["PeerRoutes"]``) says the same; a test holds them together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from smg_router.errors import BadRequest

PATH = "/peers/routes"
BODY_LIMIT = 8 * 1024 * 1024
"""The largest batch a router reads (the sender keeps its batches well under it: ``transport.MAX_BATCH_CHARS``)."""
ROLES = frozenset({"regular", "prefill", "decode"})

Record = tuple[str, str, str, str, int]
"""(role, model, worker url, routing text, head) of one routed request."""
Prefill = tuple[str, str, bool]
"""(worker url, leading chars, done) of a first prefill a request of the sender leads (``holds.Holds``)."""
Lead = tuple[str, str]
"""(worker url, leading chars) of a start that the receiver leads itself."""
SELF: dict[str, Any] = {"self": True}
"""The answer to a batch of the receiver's own (a DNS name lists its own pod too): the sender asks it no more."""


@dataclass(frozen=True, slots=True)
class Batch:
    """A peer's batch, checked whole."""

    sender: str
    records: list[Record]
    prefills: list[Prefill]


@dataclass(frozen=True, slots=True)
class Answer:
    """A peer's answer as the sender reads it."""

    is_self: bool = False
    leader: str | None = None
    """The peer's id, when it names the starts it leads (a router of an older version answers neither)."""
    leads: frozenset[Lead] = frozenset()


# -- the sender ---------------------------------------------------------------------------------------
def encode_batch(sender: str, records: Sequence[Record], prefills: Sequence[Prefill]) -> bytes:
    message: dict[str, object] = {"from": sender, "records": records}
    if prefills:
        message["prefills"] = prefills
    return orjson.dumps(message)


def decode_answer(raw: bytes) -> Answer:
    """The peer's answer; a ValueError when it is no JSON object.  Malformed ``leads`` entries are skipped."""
    reply = orjson.loads(raw)
    if not isinstance(reply, dict):
        raise ValueError(f"the answer is no JSON object: {raw[:200]!r}")
    if reply.get("self"):
        return Answer(is_self=True)
    leader, told = reply.get("id"), reply.get("leads")
    if not (isinstance(leader, str) and isinstance(told, list)):
        return Answer()
    leads = frozenset(
        (r[0], r[1]) for r in told if isinstance(r, list) and len(r) == 2 and all(isinstance(x, str) for x in r)
    )
    return Answer(leader=leader, leads=leads)


# -- the receiver -------------------------------------------------------------------------------------
def decode_batch(data: dict[str, Any], *, own: str | None) -> Batch | None:
    """A batch checked whole before any of it is applied, or a 400 naming what is wrong; None when it came from this
    router (``own``: its id; None: no peers), whatever its records (answered ``SELF``)."""
    sender, records, told = data.get("from"), data.get("records"), data.get("prefills", [])
    if not isinstance(sender, str) or not isinstance(records, list) or not isinstance(told, list):
        raise BadRequest(
            "a peer batch is {'from': <router id>, 'records': [...], 'prefills': [...] (optional)}",
            code="invalid_field",
        )
    if own is not None and sender == own:
        return None
    batch = [_record(i, r) for i, r in enumerate(records)]
    prefills = [_prefill(i, r) for i, r in enumerate(told)]
    return Batch(sender, batch, prefills)


def encode_answer(*, applied: int, ignored: int, own: str, leads: Sequence[Lead]) -> dict[str, Any]:
    return {"applied": applied, "ignored": ignored, "id": own, "leads": [list(lead) for lead in leads]}


def merge_answers(bodies: Sequence[bytes]) -> dict[str, Any]:
    """The answers of every process of a pod (each applied the batch) as one: the counts added, the leads of every
    process (the id: of the first process that leads one of them, else process 0's)."""
    answers: list[dict[str, Any]] = [orjson.loads(raw) for raw in bodies]
    if any(a.get("self") for a in answers):
        return SELF
    leads: list[Any] = []
    for a in answers:
        leads += [lead for lead in a.get("leads", []) if lead not in leads]
    leader = next((a for a in answers if a.get("leads")), answers[0])
    return {
        "applied": sum(a.get("applied", 0) for a in answers),
        "ignored": sum(a.get("ignored", 0) for a in answers),
        "id": leader.get("id", ""),
        "leads": leads,
    }


def _record(i: int, record: object) -> Record:
    """One ``[role, model, worker url, text, head]`` of a peer's batch, or a 400 naming what is wrong with it."""
    if not (isinstance(record, list) and len(record) == 5):
        raise BadRequest(f"records[{i}]: must be [role, model, worker url, text, head]", code="invalid_field")
    role, model, url, text, head = record
    if not (isinstance(role, str) and role in ROLES):  # a list or an object cannot even be looked up
        raise BadRequest(f"records[{i}]: role must be one of {', '.join(sorted(ROLES))}", code="invalid_field")
    if not (isinstance(model, str) and isinstance(url, str) and isinstance(text, str)):
        raise BadRequest(f"records[{i}]: model, worker url and text must be strings", code="invalid_field")
    if not (type(head) is int and 0 <= head <= len(text)):
        raise BadRequest(f"records[{i}]: head must be an integer from 0 to the text's length", code="invalid_field")
    return role, model, url, text, head


def _prefill(i: int, record: object) -> Prefill:
    """One ``[worker url, leading chars, done]`` of a peer's batch, or a 400 naming what is wrong with it."""
    if not (isinstance(record, list) and len(record) == 3):
        raise BadRequest(f"prefills[{i}]: must be [worker url, leading chars, done]", code="invalid_field")
    url, prefix, done = record
    if not (isinstance(url, str) and isinstance(prefix, str) and prefix):
        raise BadRequest(f"prefills[{i}]: worker url and leading chars must be non-empty strings", code="invalid_field")
    if not isinstance(done, bool):
        raise BadRequest(f"prefills[{i}]: done must be true or false", code="invalid_field")
    return url, prefix, done
