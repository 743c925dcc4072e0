"""Routing headers (``request.apply_routing_headers``), model aliases (``Proxy``) and the response id tags."""

from __future__ import annotations

import orjson
import pytest
from smg_router.errors import BadRequest
from smg_router.metrics import Metrics
from smg_router.proxy import Proxy
from smg_router.relay import Relay, _Retag
from smg_router.request import (
    MAX_ROUTING_TOKENS,
    ROUTING_TOKENS_HEADER,
    apply_routing_headers,
    parse_request,
    routing_tokens_text,
)
from smg_router.response_ids import MARKER, TOKEN_HEX, ResponseIdTags, id_of_body, id_of_events
from smg_router.settings import RetrySettings, RoutingSettings, parse_settings
from smg_router.tree.blocks import namespace_of
from smg_router.upstream import Timeouts, Upstream
from smg_router.workers.registry import WorkerRegistry
from support.policy_env import Env, make_worker

KEY = "x-smg-routing-key"


def _chat(**extra: object) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello there"}], **extra})


def test_the_session_key_header_is_read_and_forwarded() -> None:
    req = parse_request("chat", _chat(), {})
    apply_routing_headers(req, {KEY: "user-42"}, KEY)
    assert req.routing_key == "user-42"
    assert req.headers[KEY] == "user-42"


def test_an_empty_header_name_turns_session_keys_off() -> None:
    req = parse_request("chat", _chat(), {})
    apply_routing_headers(req, {KEY: "user-42"}, "")
    assert req.routing_key is None


def test_routing_tokens_replace_the_text_after_the_namespace_marker() -> None:
    req = parse_request("chat", _chat(cache_salt="s1"), {})
    marker = req.text[: req.text.index("\x00", 1) + 1]
    apply_routing_headers(req, {ROUTING_TOKENS_HEADER: "1, 2,3"}, KEY)
    assert req.text == marker + routing_tokens_text("1,2,3")
    assert req.head == 0
    assert req.tokens == [1, 2, 3] and req.namespace == namespace_of(None, "s1")  # matched in the salt's blocks


def test_token_prefixes_are_text_prefixes_and_never_match_text() -> None:
    short, long = routing_tokens_text("5,200000,7"), routing_tokens_text("5,200000,7,9")
    assert long.startswith(short)
    assert len(routing_tokens_text("1,126975")) == 2 and len(routing_tokens_text("126976")) == 2
    assert routing_tokens_text("0") != routing_tokens_text("126976")[:1]
    assert all(ord(c) >= 0xF0000 for c in long)


@pytest.mark.parametrize("value", ["", "1,,2", "-1", "1.5", "a", "[1,2]", "1;2", "٣", str(2**29)])
def test_malformed_routing_tokens_are_a_400_naming_the_header(value: str) -> None:
    with pytest.raises(BadRequest) as e:
        routing_tokens_text(value)
    assert ROUTING_TOKENS_HEADER in e.value.message


def test_too_many_routing_tokens_are_a_400() -> None:
    with pytest.raises(BadRequest, match="more than"):
        routing_tokens_text(",".join(["1"] * (MAX_ROUTING_TOKENS + 1)))


def _proxy(env: Env, aliases: tuple[tuple[str, str], ...], *workers) -> Proxy:  # type: ignore[no-untyped-def]
    from smg_router.policies.registry import PolicyRegistry

    registry = WorkerRegistry()
    for w in workers:
        registry.add(w)
    policies = PolicyRegistry(env.factory, env.settings)
    policies.sync(registry)
    return Proxy(
        registry=registry,
        policies=policies,
        upstream=Upstream(Timeouts(connect=1, total=1)),
        metrics=env.metrics,
        retry=RetrySettings(),
        routing=RoutingSettings(model_aliases=aliases),
    )


def test_an_alias_routes_to_the_served_model_and_rewrites_only_its_body(env: Env) -> None:
    proxy = _proxy(env, (("public", "m"),), make_worker(2, model="m"))
    req = parse_request("chat", _chat(model="public"), {})
    req.model = proxy.resolve_model(req.requested_model)
    proxy._apply_alias(req)
    assert req.model == "m"
    assert orjson.loads(req.raw)["model"] == "m"
    plain = parse_request("chat", _chat(), {})
    raw = plain.raw
    plain.model = proxy.resolve_model(plain.requested_model)
    proxy._apply_alias(plain)
    assert plain.raw is raw  # no alias: the bytes the client sent


def test_a_served_name_wins_over_an_alias_of_the_same_name(env: Env) -> None:
    proxy = _proxy(env, (("public", "m"),), make_worker(2, model="m"), make_worker(3, model="public"))
    req = parse_request("chat", _chat(model="public"), {})
    req.model = proxy.resolve_model(req.requested_model)
    proxy._apply_alias(req)
    assert req.model == "public" and orjson.loads(req.raw)["model"] == "public"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model-alias", "a=b", "--model-alias", "b=a"], "model alias a is part of a cycle: a -> b -> a"),
        (["--model-alias", "m=x", "--model-id", "m"], "model alias m is the name of the served model"),
        (["--model-alias", "a=b", "--model-alias", "a=c"], "model alias a is given twice"),
        (["--model-alias", "ab"], "--model-alias takes PUBLIC=SERVED"),
    ],
)
def test_bad_aliases_are_a_startup_error_naming_them(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_settings(argv)
    assert message in capsys.readouterr().err


def test_alias_chains_resolve_and_the_env_form_is_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMG_MODEL_ALIAS", "gpt=llama, chat=gpt")
    assert dict(parse_settings([]).routing.model_aliases) == {"gpt": "llama", "chat": "llama"}
    assert parse_settings(["--routing-key-header", "X-Session"]).routing.key_header == "x-session"


def test_a_tagged_response_id_gives_back_the_engines_id_and_the_workers_token() -> None:
    tags = ResponseIdTags()
    a, b = "http://10.0.0.5:8000", "http://10.0.0.6:8000"
    tagged = tags.tag("resp_abc_smg", a)  # an engine id that holds the marker itself
    assert tagged.startswith("resp_abc_smg" + MARKER) and "10.0.0.5" not in tagged
    assert tags.untag(tagged) == ("resp_abc_smg", tags.token(a))
    assert tags.token(a) != tags.token(b) and len(tags.token(a)) == TOKEN_HEX
    assert ResponseIdTags().token(a) == tags.token(a)  # every replica reads every tag
    assert ResponseIdTags(b"another key").token(a) != tags.token(a)
    for untagged in ("resp_abc", "resp_abc" + MARKER, "resp" + MARKER + "0123", MARKER + "0" * TOKEN_HEX):
        assert tags.untag(untagged) == (untagged, None)
    assert tags.untag(tagged.upper())[1] is None  # a token is lower-case hex, exactly


def test_response_ids_are_read_from_the_body_and_the_first_events() -> None:
    assert id_of_body(b'{"id": "resp_1", "object": "response"}') == "resp_1"
    assert id_of_body(b"not json") is None
    events = b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_2"}}\n\n'
    assert id_of_events(events) == "resp_2"
    assert id_of_events(events[:-30]) is None  # the data line is not complete yet


def test_a_responses_stream_split_anywhere_reaches_the_client_with_every_id_tagged() -> None:
    """The relay's rewriting of a stream (``relay._Retag``), its pieces cut at every byte: the client's bytes are
    the worker's with the ids replaced, whatever the cuts."""
    tags = ResponseIdTags()
    worker = make_worker(5)
    relay = Relay(metrics=Metrics(), response_ids=tags)
    req = parse_request("chat", _chat(), {})
    req.endpoint = "/v1/responses"
    req.body["previous_response_id"] = "resp_prev"  # as forwarded
    req.previous_response_id = "resp_prev" + MARKER + "0" * TOKEN_HEX  # as the client sent it
    worker_bytes = (
        b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_new",'
        b'"previous_response_id":"resp_prev"}}\n\n'
        b'event: response.output_text.delta\ndata: {"delta":"resp_new is not quoted here"}\n\n'
        b'event: response.completed\ndata: {"type":"response.completed","response":{"id":"resp_new"}}\n\n'
    )
    expected = worker_bytes.replace(b'"resp_new"', b'"' + tags.tag("resp_new", worker.url).encode() + b'"').replace(
        b'"resp_prev"', b'"' + req.previous_response_id.encode() + b'"'
    )
    for cut in range(1, len(worker_bytes)):
        for last_marked in (True, False):
            retag = _Retag(relay, req, worker)
            out = retag.feed(worker_bytes[:cut], False) + retag.feed(worker_bytes[cut:], last_marked)
            out += retag.flush()
            assert out == expected, cut
