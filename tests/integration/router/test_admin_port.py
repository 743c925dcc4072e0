"""``--admin-port``: the worker lifecycle changes answer only on their own port, so that a NetworkPolicy can
let only the operator reach them while the data plane stays open; reads stay on both ports."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.procs import MODEL, Router, Sim, free_port, http_json, start_router

KEY = "admin-port-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def split(logs: Path) -> Iterator[tuple[Router, str]]:
    """A router with its lifecycle changes on a second port; the URL of that port."""
    admin_port = free_port()
    r = start_router(logs, admin_key=KEY, args=["--admin-port", str(admin_port)])
    yield r, f"http://{r.host}:{admin_port}"
    r.stop()


def urls(base: str) -> set[str]:
    status, body = http_json("GET", base + "/workers")
    assert status == 200, body
    return {w["url"] for w in body["workers"]}


def test_mutations_on_the_data_port_are_refused_with_the_admin_port_named(
    split: tuple[Router, str], fleet: list[Sim]
) -> None:
    r, admin = split
    admin_port = admin.rsplit(":", 1)[1]
    status, w = http_json("POST", admin + "/workers", {"url": fleet[0].url, "model_id": MODEL}, headers=AUTH)
    assert status == 201, w
    attempts = [
        ("POST", "/workers", {"url": fleet[1].url, "model_id": MODEL}),
        ("PATCH", f"/workers/{w['id']}", {"priority": 9}),
        ("PUT", f"/workers/{w['id']}", {"model_id": MODEL, "priority": 9}),
        ("DELETE", f"/workers/{w['id']}?timeout=0", None),
        ("POST", f"/add_worker?url={fleet[1].url}", None),
        ("POST", f"/remove_worker?url={fleet[0].url}&timeout=0", None),
    ]
    for method, path, body in attempts:
        status, answer = http_json(method, r.url + path, body, headers=AUTH)  # with the right token, even
        assert status == 404, (method, path, status, answer)
        assert answer["error"]["code"] == "admin_port_only" and admin_port in answer["error"]["message"], answer
    # nothing changed: still the one worker, unpatched
    assert urls(r.url) == {fleet[0].url}
    assert http_json("GET", f"{r.url}/workers/{w['id']}")[1]["priority"] == 50


def test_the_admin_port_serves_the_whole_lifecycle_api_and_reads_stay_on_both(
    split: tuple[Router, str], fleet: list[Sim]
) -> None:
    r, admin = split
    assert http_json("POST", admin + "/workers", {"url": fleet[1].url, "model_id": MODEL})[0] == 401  # still a key
    status, w = http_json("POST", admin + "/workers", {"url": fleet[1].url, "model_id": MODEL}, headers=AUTH)
    assert status in (200, 201), w
    assert fleet[1].url in urls(r.url) and urls(r.url) == urls(admin)
    assert http_json("GET", f"{r.url}/workers/{w['id']}")[0] == 200
    assert http_json("GET", f"{admin}/workers/{w['id']}")[0] == 200
    assert fleet[1].url in http_json("GET", r.url + "/list_workers")[1]["urls"]
    status, patched = http_json("PATCH", f"{admin}/workers/{w['id']}", {"priority": 7}, headers=AUTH)
    assert status == 200 and patched["priority"] == 7
    assert http_json("POST", f"{admin}/remove_worker?url={fleet[1].url}&timeout=0", headers=AUTH)[0] == 200
    assert fleet[1].url not in urls(r.url)
    assert http_json("POST", f"{admin}/add_worker?url={fleet[2].url}", headers=AUTH)[0] == 201
    status, removed = http_json("DELETE", f"{admin}/workers/{w['id']}?timeout=0", headers=AUTH)
    assert status == 404, removed  # removed above through the compat alias
    (added,) = [x for x in http_json("GET", admin + "/workers")[1]["workers"] if x["url"] == fleet[2].url]
    assert http_json("DELETE", f"{admin}/workers/{added['id']}?timeout=0", headers=AUTH)[0] == 200
    assert fleet[2].url not in urls(r.url)


def test_the_admin_port_serves_nothing_but_the_lifecycle_api(split: tuple[Router, str], fleet: list[Sim]) -> None:
    r, admin = split
    data_port = str(r.port)
    for method, path, body in [
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}),
        ("GET", "/v1/models", None),
        ("GET", "/metrics", None),
    ]:
        status, answer = http_json(method, admin + path, body)
        assert status == 404 and answer["error"]["code"] == "not_on_admin_port", (path, answer)
        assert data_port in answer["error"]["message"], answer
    # while the data port routes as ever
    assert http_json("POST", admin + "/workers", {"url": fleet[0].url, "model_id": MODEL}, headers=AUTH)[0] in (
        200,
        201,
    )
    r.wait_routable(1)
    assert r.complete("hello").status == 200
    assert http_json("GET", r.url + "/metrics")[0] == 200


def test_without_an_admin_port_the_main_port_takes_mutations(logs: Path, fleet: list[Sim]) -> None:
    r = start_router(logs, admin_key=KEY)
    try:
        assert r.admin("POST", "/workers", {"url": fleet[0].url, "model_id": MODEL})[0] == 201
    finally:
        r.stop()


def test_an_admin_port_equal_to_the_main_port_is_refused() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "smg_router", "--port", "30123", "--admin-port", "30123"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "--admin-port" in out.stderr, out.stderr
