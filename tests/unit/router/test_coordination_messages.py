"""The bodies of ``POST /peers/routes`` (``coordination.messages``): what the sender encodes the receiver decodes, and
the OpenAPI document describes both."""

from __future__ import annotations

import orjson
import pytest
from smg_router.coordination import messages
from smg_router.errors import BadRequest
from smg_router.openapi import document

W = "http://127.0.0.2:8000"


def test_a_batch_the_sender_encodes_is_the_batch_the_receiver_decodes() -> None:
    records: list[messages.Record] = [("regular", "m", W, "hello world", 5)]
    prefills: list[messages.Prefill] = [(W, "hello", False), (W, "doc", True)]
    raw = messages.encode_batch("r1", records, prefills)
    batch = messages.decode_batch(orjson.loads(raw), own="r2")
    assert batch == messages.Batch("r1", records, prefills)
    assert "prefills" not in orjson.loads(messages.encode_batch("r1", records, []))  # an older router's shape


def test_a_batch_of_this_routers_own_is_answered_self_whatever_its_records() -> None:
    assert messages.decode_batch({"from": "r1", "records": [["bad"]]}, own="r1") is None
    with pytest.raises(BadRequest, match=r"records\[0\]"):
        messages.decode_batch({"from": "r1", "records": [["bad"]]}, own=None)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"records": []}, "a peer batch is"),
        ({"from": "a", "records": {}}, "a peer batch is"),
        ({"from": "a", "records": [], "prefills": {}}, "a peer batch is"),
        ({"from": "a", "records": [["router", "m", W, "t", 0]]}, "role must be one of"),
        ({"from": "a", "records": [["regular", 1, W, "t", 0]]}, "must be strings"),
        ({"from": "a", "records": [["regular", "m", W, "t", 2]]}, "head must be an integer"),
        ({"from": "a", "records": [["regular", "m", W, "t", True]]}, "head must be an integer"),
        ({"from": "a", "records": [], "prefills": [[W, "", False]]}, "non-empty strings"),
        ({"from": "a", "records": [], "prefills": [[W, "p", 0]]}, "done must be true or false"),
        ({"from": "a", "records": [], "prefills": [[W, "p"]]}, r"prefills\[0\]: must be"),
    ],
)
def test_a_malformed_batch_is_a_400_naming_what_is_wrong(body: dict[str, object], says: str) -> None:
    with pytest.raises(BadRequest, match=says) as e:
        messages.decode_batch(body, own="me")
    assert e.value.status == 400 and e.value.code == "invalid_field"


def test_an_answer_the_receiver_encodes_is_the_answer_the_sender_reads() -> None:
    answer = messages.encode_answer(applied=2, ignored=1, own="r2", leads=[(W, "doc")])
    read = messages.decode_answer(orjson.dumps(answer))
    assert read == messages.Answer(leader="r2", leads=frozenset({(W, "doc")}))
    assert messages.decode_answer(orjson.dumps(messages.SELF)).is_self
    older = messages.decode_answer(b'{"applied": 1, "ignored": 0}')  # no id, no leads: it leads nothing
    assert older == messages.Answer()
    odd = messages.decode_answer(orjson.dumps({"id": "a", "leads": [[W, "doc"], ["x"], [1, 2]]}))
    assert odd.leads == {(W, "doc")}
    for garbage in (b"not json", b"[1, 2]"):
        with pytest.raises(ValueError):
            messages.decode_answer(garbage)


def test_a_pods_answers_merge_into_one() -> None:
    one = orjson.dumps(messages.encode_answer(applied=1, ignored=0, own="p0", leads=[]))
    two = orjson.dumps(messages.encode_answer(applied=1, ignored=1, own="p1", leads=[(W, "doc")]))
    assert messages.merge_answers([one, two]) == {"applied": 2, "ignored": 1, "id": "p1", "leads": [[W, "doc"]]}
    assert messages.merge_answers([one, orjson.dumps(messages.SELF)]) == messages.SELF


def test_the_openapi_document_describes_the_bodies() -> None:
    doc = document()
    batch = doc["components"]["schemas"]["PeerRoutes"]
    assert set(batch["properties"]) == set(orjson.loads(messages.encode_batch("a", [], [(W, "p", False)]))) | {
        "records"
    }
    assert set(batch["properties"]["records"]["items"]["prefixItems"][0]["enum"]) == messages.ROLES
    post = doc["paths"][messages.PATH]["post"]
    answer = post["responses"]["200"]["content"]["application/json"]["schema"]
    encoded = messages.encode_answer(applied=0, ignored=0, own="a", leads=[])
    assert set(answer["properties"]) == set(encoded) | set(messages.SELF)
