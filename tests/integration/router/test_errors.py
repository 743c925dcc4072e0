"""Bad input gets a clear OpenAI-shaped 4xx/5xx JSON error, and the router keeps serving after each."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from support.procs import MODEL, Router, http_json, start_router

GOOD = {"model": MODEL, "prompt": "still serving?", "max_tokens": 1}


def _assert_error(status: int, body: object, expected: int, words: str) -> None:
    assert status == expected, body
    assert isinstance(body, dict) and set(body["error"]) >= {"message", "type", "code"}, body
    assert words in body["error"]["message"], body


def _still_serving(router: Router) -> None:
    status, body = http_json("POST", router.url + "/v1/completions", GOOD)
    assert status == 200, body


@pytest.mark.parametrize(
    ("path", "raw", "status", "words"),
    [
        ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/completions", b"[1, 2]", 400, "JSON object"),
        ("/v1/chat/completions", b'{"model": "sim-model"}', 400, "messages is required"),
        ("/v1/completions", b'{"model": "sim-model"}', 400, "prompt is required"),
        ("/generate", b'{"sampling_params": {}}', 400, "text or input_ids"),
        (
            "/v1/chat/completions",
            b'{"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}',
            404,
            "no-such-model",
        ),
    ],
)
def test_bad_requests_are_rejected_with_json(router: Router, path: str, raw: bytes, status: int, words: str) -> None:
    got, body = http_json("POST", router.url + path, raw)
    _assert_error(got, body, status, words)
    _still_serving(router)


def test_body_over_the_limit_is_413(logs: Path, fleet) -> None:
    r = start_router(logs, workers=[fleet[0].url], args=["--max-payload-size", "2048"])
    try:
        r.wait_routable(1)
        got, body = http_json("POST", r.url + "/v1/completions", {**GOOD, "prompt": "x" * 5000})
        _assert_error(got, body, 413, "exceeds the limit")
        _still_serving(r)
    finally:
        r.stop()


def test_no_routable_worker_is_503(logs: Path) -> None:
    r = start_router(logs)
    try:
        got, body = http_json("POST", r.url + "/v1/completions", GOOD)
        _assert_error(got, body, 503, "no regular workers")
        # a registered but unreachable worker is not routable either
        status, _ = r.admin("POST", "/workers", {"url": "http://127.0.0.1:9", "model_id": MODEL})
        assert status == 201
        got, body = http_json("POST", r.url + "/v1/completions", GOOD)
        _assert_error(got, body, 503, "no healthy regular worker")
        assert http_json("GET", r.url + "/readiness")[0] == 503
        assert http_json("GET", r.url + "/liveness")[0] == 200
    finally:
        r.stop()


def test_admin_calls_need_the_token(logs: Path, fleet) -> None:
    r = start_router(logs, workers=[fleet[0].url], admin_key="s3cret")
    try:
        r.wait_routable(1)
        for method, path, body in [
            ("POST", "/workers", {"url": fleet[1].url}),
            ("DELETE", f"/workers/{r.workers()[0]['id']}", None),
            ("POST", f"/add_worker?url={fleet[1].url}", None),
        ]:
            got, answer = http_json(method, r.url + path, body)
            _assert_error(got, answer, 401, "admin API key")
            got, answer = http_json(method, r.url + path, body, headers={"Authorization": "Bearer wrong"})
            _assert_error(got, answer, 401, "admin API key")
        assert len(r.workers()) == 1  # nothing changed
        status, created = r.admin("POST", "/workers", {"url": fleet[1].url, "model_id": MODEL})
        assert status == 201, created
        _still_serving(r)
    finally:
        r.stop()


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"url": "not a url"}, "url"),
        ({"url": "ftp://127.0.0.2:8000"}, "url"),
        ({"url": "http://127.0.0.2:99999"}, "url"),
        ({"url": "http://127.0.0.2:8000/v1"}, "url"),
        ({"url": "http://127.0.0.2:8000", "role": "boss"}, "role"),
        ({"url": "http://127.0.0.2:8000", "bootstrap_port": 70000}, "bootstrap_port"),
        ({"url": "http://127.0.0.2:8000", "labels": {"a": 1}}, "labels"),
        ({"url": "http://127.0.0.2:8000", "colour": "red"}, "colour"),
    ],
)
def test_bad_worker_specs_are_400_and_change_nothing(router: Router, spec: dict, field: str) -> None:
    before = router.workers()
    got, body = router.admin("POST", "/workers", spec)
    _assert_error(got, body, 400, field)
    assert router.workers() == before or [w["id"] for w in router.workers()] == [w["id"] for w in before]
    _still_serving(router)


def test_a_wrong_method_is_405_json_naming_the_allowed_methods(router: Router) -> None:
    req = urllib.request.Request(router.url + "/v1/models", method="DELETE")
    try:
        urllib.request.urlopen(req, timeout=5)
        raise AssertionError("DELETE /v1/models was accepted")
    except urllib.error.HTTPError as e:
        assert e.code == 405
        assert "GET" in e.headers["Allow"]
        assert json.loads(e.read())["error"]["type"] == "invalid_request_error"


def test_expect_100_continue_gets_the_go_ahead_before_the_body(router: Router) -> None:
    """curl sends ``Expect: 100-continue`` for bodies over 1 KiB and waits for the go-ahead (the router's own
    server has no Application to send it)."""
    import socket

    host, port = router.url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "x" * 2000, "max_tokens": 1}).encode()
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        assert s.recv(64).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")  # before any body byte was sent
        s.sendall(body)
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


def test_head_answers_like_get_without_a_body(router: Router) -> None:
    req = urllib.request.Request(router.url + "/liveness", method="HEAD")
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200 and r.read() == b""
        assert r.headers["Content-Type"].startswith("application/json")
