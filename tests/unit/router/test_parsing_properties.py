"""Hostile input to the request parsers and the lifecycle validation, as properties (hypothesis).

On any bytes and any JSON, ``parse_request`` returns a record or raises ``BadRequest``, and
``WorkerSpec.from_json`` / ``normalize_url`` return a value or raise ``SpecError``: never another
exception, which would reach the client as a bare 500.  What they accept is consistent: the record
describes the body it came from, a growing chat keeps its routing text as a prefix, an accepted spec
validates again to itself.  Derandomized (the same examples on every run) with a bounded count, so each
test stays well inside the unit tier's 10 s.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from smg_router.admin import PATCHABLE
from smg_router.errors import BadRequest
from smg_router.openapi import document
from smg_router.request import ENDPOINTS, ProxyRequest, parse_request
from smg_router.workers.worker import ROLES, SpecError, WorkerSpec, normalize_url

KINDS = sorted(ENDPOINTS)
SETTINGS = settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- strategies ----------------------------------------------------------------------------------
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
JSON_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_TOKEN = (
    st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.integers(min_value=0, max_value=0x10FFFF) | st.booleans()
)
_CONTENT = (
    st.none()
    | st.text(max_size=20)
    | JSON_VALUES
    | st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url"])}, optional={"text": JSON_VALUES | st.text(max_size=10)}
        )
        | JSON_VALUES,
        max_size=3,
    )
)
_ROLE = st.sampled_from(["system", "user", "assistant", "tool", ""]) | st.text(max_size=6)
GOOD_MESSAGE = st.fixed_dictionaries({"role": _ROLE}, optional={"content": _CONTENT, "name": JSON_VALUES})
MESSAGE = GOOD_MESSAGE | st.fixed_dictionaries({}, optional={"role": _ROLE | JSON_VALUES, "content": _CONTENT})
_PROMPT = (
    st.text(max_size=20)
    | st.lists(st.text(max_size=8), max_size=3)
    | st.lists(_TOKEN, max_size=4)
    | st.lists(st.lists(_TOKEN, max_size=3), max_size=3)
    | JSON_VALUES
)
_COMMON = {"model": st.text(max_size=8) | JSON_VALUES, "stream": JSON_VALUES, "max_tokens": JSON_VALUES}
# bodies close to what each endpoint wants, so the fields' own checks are reached, not only "not an object"
BODIES = {
    "chat": st.fixed_dictionaries(
        {},
        optional={
            "messages": st.lists(GOOD_MESSAGE, min_size=1, max_size=4) | st.lists(MESSAGE, max_size=4) | JSON_VALUES,
            **_COMMON,
        },
    ),
    "completions": st.fixed_dictionaries({}, optional={"prompt": _PROMPT, **_COMMON}),
    "generate": st.fixed_dictionaries({}, optional={"text": _PROMPT, "input_ids": _PROMPT, **_COMMON}),
}


def _encode(value: Any) -> bytes:
    """JSON bytes as a client may send them: big integers, NaN and Infinity included."""
    return json.dumps(value, allow_nan=True).encode()


def _parse_or_bad_request(kind: str, raw: bytes) -> ProxyRequest | None:
    try:
        return parse_request(kind, raw, {"content-type": "application/json", "x-other": "dropped"})
    except BadRequest as e:
        assert e.status == 400 and e.message and e.code in {"invalid_json", "invalid_field", "missing_field"}, e
        return None


def _check_record(kind: str, raw: bytes, record: ProxyRequest) -> None:
    body = orjson.loads(raw)
    assert record.body == body and record.raw is raw and record.endpoint == ENDPOINTS[kind]
    assert record.requested_model is None or (isinstance(record.requested_model, str) and record.requested_model)
    assert record.requested_model == body.get("model")
    assert record.stream is (body.get("stream") is True)
    assert body.get("stream") is None or isinstance(body["stream"], bool)  # as the worker will read it too
    routed_by = {
        "chat": None,
        "completions": "prompt",
        "generate": "input_ids" if body.get("text") is None else "text",
    }[kind]
    value = body.get(routed_by) if routed_by else None  # true is no token id (Python's bool is an int)
    items = [i for v in value for i in (v if isinstance(v, list) else [v])] if isinstance(value, list) else []
    assert not any(isinstance(i, bool) for i in items), (routed_by, value)
    assert isinstance(record.text, str)
    assert record.headers == {"content-type": "application/json"}


# -- parse_request -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@SETTINGS
@given(raw=st.binary(max_size=64) | st.text(max_size=40).map(str.encode))
def test_any_bytes_give_a_record_or_a_bad_request(kind: str, raw: bytes) -> None:
    record = _parse_or_bad_request(kind, raw)
    if record is not None:
        _check_record(kind, raw, record)


@pytest.mark.parametrize("kind", KINDS)
@SETTINGS
@given(value=JSON_VALUES)
def test_any_json_value_gives_a_record_or_a_bad_request(kind: str, value: Any) -> None:
    raw = _encode(value)
    record = _parse_or_bad_request(kind, raw)
    if record is not None:
        _check_record(kind, raw, record)


@pytest.mark.parametrize("kind", KINDS)
@SETTINGS
@given(data=st.data())
def test_near_valid_bodies_give_a_record_describing_them_or_a_bad_request(kind: str, data: st.DataObject) -> None:
    raw = _encode(data.draw(BODIES[kind]))
    record = _parse_or_bad_request(kind, raw)
    if record is not None:
        _check_record(kind, raw, record)


@SETTINGS
@given(
    conversation=st.lists(GOOD_MESSAGE, min_size=1, max_size=5) | st.lists(MESSAGE, min_size=1, max_size=5),
    more=MESSAGE,
)
def test_a_chat_extended_by_one_message_keeps_its_routing_text_as_a_prefix(conversation: list[Any], more: Any) -> None:
    shorter = _parse_or_bad_request("chat", _encode({"messages": conversation}))
    longer = _parse_or_bad_request("chat", _encode({"messages": [*conversation, more]}))
    if shorter is None:  # a bad message stays bad when another follows it
        assert longer is None
    elif longer is not None:
        assert longer.text.startswith(shorter.text) and len(longer.text) > len(shorter.text)


@pytest.mark.parametrize(("kind", "field"), [("completions", "prompt"), ("generate", "input_ids")])
@SETTINGS
@given(
    ids=st.lists(st.integers(min_value=0, max_value=0x10FFFF), min_size=1, max_size=8),
    more=st.lists(st.integers(min_value=0, max_value=0x10FFFF), min_size=1, max_size=8),
)
def test_token_ids_extended_keep_their_routing_text_as_a_prefix(
    kind: str, field: str, ids: list[int], more: list[int]
) -> None:
    shorter = parse_request(kind, _encode({field: ids}))
    longer = parse_request(kind, _encode({field: ids + more}))
    assert len(shorter.text) == len(ids)  # one character per token
    assert longer.text.startswith(shorter.text)


@SETTINGS
@given(text=st.text(max_size=30), prompts=st.lists(st.text(max_size=10), min_size=1, max_size=4))
def test_string_prompts_are_their_own_routing_text(text: str, prompts: list[str]) -> None:
    assert parse_request("generate", _encode({"text": text})).text == text
    assert parse_request("completions", _encode({"prompt": text})).text == text
    assert parse_request("completions", _encode({"prompt": prompts})).text == "\n".join(prompts)


# -- normalize_url and WorkerSpec.from_json -------------------------------------------------------
_HOSTS = st.sampled_from(
    [
        "127.0.0.2",
        "localhost",
        "10.0.0.5",
        "[::1]",
        "[",
        "[::1",
        "[v1.x]",
        "a b",
        "a\\b",
        "ex\u2100ample",
        "\u0130",
        "h%20",
        "",
    ]
) | st.text(max_size=10)
_PORTS = st.none() | st.integers(min_value=-1, max_value=70000).map(str) | st.text(max_size=6)
URLS = st.builds(
    lambda scheme, user, host, port, tail: f"{scheme}{user}{host}{'' if port is None else ':' + port}{tail}",
    st.sampled_from(["http://", "https://", "HTTP://", "ftp://", "http:", "//", ""]),
    st.sampled_from(["", "", "", "user@", "u:p@", "@"]),
    _HOSTS,
    _PORTS,
    st.sampled_from(["", "/", "//", "/v1", "?a=1", "#f", "?", " "]) | st.text(max_size=4),
) | st.text(max_size=30)
_GOOD_URLS = st.builds(
    "{}://{}{}{}".format,
    st.sampled_from(["http", "https", "HTTP"]),
    st.sampled_from(["127.0.0.2", "localhost", "[::1]", "worker-0.smg.svc"]),
    st.none().map(lambda _: "") | st.integers(min_value=1, max_value=65535).map(":{}".format),
    st.sampled_from(["", "/", " "]),
)


def _url_or_spec_error(raw: object) -> str | None:
    try:
        return normalize_url(raw)
    except SpecError as e:
        assert e.field == "url" and str(e).startswith("url: ")
        return None


@SETTINGS
@given(raw=_GOOD_URLS | URLS | JSON_VALUES)
def test_normalize_url_returns_a_canonical_http_url_or_raises_spec_error(raw: object) -> None:
    url = _url_or_spec_error(raw)
    if url is None:
        return
    parts = urlsplit(url)
    assert parts.scheme in ("http", "https") and parts.hostname
    assert parts.username is None and parts.password is None
    assert parts.path == "" and not parts.query and not parts.fragment
    assert normalize_url(url) == url  # canonical: normalising again changes nothing


_SPEC_FIELDS = {
    "url": URLS | JSON_VALUES,
    "role": st.sampled_from([*ROLES, "", "Regular", "router"]) | JSON_VALUES,
    "model_id": st.text(max_size=6) | JSON_VALUES,
    "bootstrap_port": st.integers(min_value=-1, max_value=70000) | JSON_VALUES,
    "labels": st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3) | JSON_VALUES,
    "priority": st.integers(min_value=-(2**63), max_value=2**63) | JSON_VALUES,
    "owner": st.text(max_size=6) | JSON_VALUES,
    "kv_capacity_tokens": st.integers(min_value=-2, max_value=2**40) | JSON_VALUES,
    "draining": JSON_VALUES,
}
_GOOD_SPEC_FIELDS = {
    "role": st.sampled_from(ROLES) | st.none(),
    "model_id": st.text(min_size=1, max_size=6) | st.none(),
    "bootstrap_port": st.integers(min_value=1, max_value=65535) | st.none(),
    "labels": st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3) | st.none(),
    "priority": st.integers(min_value=-(2**63), max_value=2**63 - 1),
    "owner": st.text(max_size=6) | st.none(),
    "kv_capacity_tokens": st.integers(min_value=1, max_value=2**40) | st.none(),
    "draining": JSON_VALUES,
}
GOOD_SPEC_BODIES = st.fixed_dictionaries({"url": _GOOD_URLS}, optional=_GOOD_SPEC_FIELDS)
_HOSTILE_BUT_URL = {k: v for k, v in _SPEC_FIELDS.items() if k != "url"}
SPEC_BODIES = (
    GOOD_SPEC_BODIES
    | st.fixed_dictionaries({"url": _GOOD_URLS}, optional=_HOSTILE_BUT_URL)
    | st.fixed_dictionaries({}, optional={**_SPEC_FIELDS, "extra": JSON_VALUES})
    | JSON_VALUES
)


def _spec_or_spec_error(data: object, base: WorkerSpec | None = None) -> WorkerSpec | None:
    try:
        return WorkerSpec.from_json(data, base=base)
    except SpecError as e:
        assert isinstance(e.field, str) and str(e).startswith(f"{e.field}: ")
        if isinstance(data, dict):
            assert e.field in data or e.field == "url", (e.field, data)  # it names a field that was sent
        return None


def _as_json(spec: WorkerSpec) -> dict[str, Any]:
    return {
        "url": spec.url,
        "role": spec.role,
        "model_id": spec.model_id,
        "bootstrap_port": spec.bootstrap_port,
        "labels": spec.labels,
        "priority": spec.priority,
        "owner": spec.owner,
        "kv_capacity_tokens": spec.kv_capacity_tokens,
    }


def _check_spec(spec: WorkerSpec) -> None:
    assert normalize_url(spec.url) == spec.url and spec.role in ROLES
    assert spec.model_id is None or (isinstance(spec.model_id, str) and spec.model_id)
    assert spec.bootstrap_port is None or (type(spec.bootstrap_port) is int and 0 < spec.bootstrap_port < 65536)
    assert all(type(k) is str and type(v) is str for k, v in spec.labels.items())
    assert type(spec.priority) is int and type(spec.owner) is str
    assert spec.kv_capacity_tokens is None or (type(spec.kv_capacity_tokens) is int and spec.kv_capacity_tokens > 0)
    assert WorkerSpec.from_json(orjson.loads(orjson.dumps(_as_json(spec)))) == spec  # what GET shows registers again


@SETTINGS
@given(data=SPEC_BODIES)
def test_from_json_returns_a_valid_spec_or_raises_spec_error_naming_a_field(data: object) -> None:
    spec = _spec_or_spec_error(data)
    if spec is not None:
        _check_spec(spec)


WORKER_SPEC_SCHEMA = Draft202012Validator(document()["components"]["schemas"]["WorkerSpec"])


ONE_FIELD_CHANGED = st.builds(
    lambda good, key, value: {**good, key: value}, GOOD_SPEC_BODIES, st.sampled_from(sorted(_SPEC_FIELDS)), JSON_VALUES
)
"""A good registration with one field set to any JSON value."""


@SETTINGS
@given(data=ONE_FIELD_CHANGED | SPEC_BODIES)
def test_from_json_accepts_nothing_the_documented_worker_spec_forbids(data: object) -> None:
    """GET /openapi.json's WorkerSpec is no looser than the router (false, 0 or [] are not a missing field)."""
    if _spec_or_spec_error(data) is not None:
        errors = [e.message for e in WORKER_SPEC_SCHEMA.iter_errors(data)]
        assert not errors, (data, errors)


BASE = WorkerSpec(
    url="http://127.0.0.2:8000", role="regular", model_id="m", labels={"a": "b"}, priority=7, kv_capacity_tokens=4096
)


@SETTINGS
@given(
    patch=st.fixed_dictionaries({}, optional={k: _GOOD_SPEC_FIELDS[k] for k in PATCHABLE})
    | st.fixed_dictionaries({}, optional={k: _SPEC_FIELDS[k] for k in PATCHABLE})
)
def test_a_patch_changes_only_what_it_names_or_nothing(patch: dict[str, Any]) -> None:
    """PATCH validates against the worker's spec: the URL and every field it leaves out stay as they were."""
    fields = {k: v for k, v in patch.items() if k != "draining"}
    spec = _spec_or_spec_error(fields, base=BASE)
    if spec is None:
        return
    _check_spec(spec)
    assert (spec.url, spec.role, spec.model_id, spec.bootstrap_port, spec.owner) == (
        BASE.url,
        BASE.role,
        BASE.model_id,
        BASE.bootstrap_port,
        BASE.owner,
    )
    if "labels" not in fields:
        assert spec.labels == BASE.labels
    if "priority" not in fields:
        assert spec.priority == BASE.priority
    if "kv_capacity_tokens" not in fields:
        assert spec.kv_capacity_tokens == BASE.kv_capacity_tokens
