"""Router replicas that tell each other their routes (``--peer``, ``--peers-dns``; ``smg_router.coordination``), shown
on the cached tokens real ``smg-sim`` engines report: a replica that never saw a group still knows which worker
holds it and which worker has no KV room left, as a router alone would.  And the faults: a peer that is down, a
DNS name that lists the router itself, a batch that is garbage."""

from __future__ import annotations

import random
import string
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from smg_router.coordination import auth
from smg_router.policies.placement import placement_key, rendezvous_score
from smg_router.workers.worker import worker_id_for
from support.procs import (
    MODEL,
    Router,
    Sim,
    free_port,
    free_ports,
    http_json,
    http_json_headers,
    metric_value,
    start_router,
    start_sim,
    wait_until,
)

KV = 3000
"""Tokens of KV per engine (1 char each): one 2000-char group fits, two do not."""
PREFIX = 2000
ARGS = ["--tree-chars-per-token", "1", "--load-monitor-interval", "0.2"]


def words(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(n))


def served(router: Router, prompt: str) -> tuple[str, int]:
    """(the worker URL in x-smg-routed-worker-id, the cached tokens the engine reports) of one completion."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    status, answer, headers = http_json_headers("POST", router.url + "/v1/completions", body)
    assert status == 200, answer
    return headers["x-smg-routed-worker-id"], answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def groups_ranking_first(first: Sim, other: Sim, count: int) -> list[str]:
    """``count`` group prefixes that every replica's rendezvous ranking sends to ``first`` before ``other``."""
    rng = random.Random(21)
    out: list[str] = []
    while len(out) < count:
        text = f"{uuid.uuid4()} " + words(rng, PREFIX)
        key = placement_key(text, 1024)
        if rendezvous_score(key, worker_id_for(first.url)) > rendezvous_score(key, worker_id_for(other.url)):
            out.append(text)
    return out


def ready(routers: list[Router], sims: list[Sim], *, peers: bool) -> None:
    for r in routers:
        r.wait_routable(len(sims))
        for s in sims:
            wait_until(
                lambda r=r, s=s: metric_value(r.metrics(), "smg_worker_kv_capacity_tokens", worker=s.url) == KV,
                timeout=15,
                what="the engines' KV capacity polled",
            )
        if peers:
            wait_until(lambda r=r: metric_value(r.metrics(), "smg_peers_in_sync") == 1, timeout=15, what="in sync")


def applied(router: Router) -> float:
    return metric_value(router.metrics(), "smg_peer_records_received_total", outcome="applied")


@pytest.fixture
def sims(tmp_path: Path) -> Iterator[list[Sim]]:
    started = [start_sim(tmp_path, extra=["--kv-capacity", str(KV)]) for _ in range(2)]
    yield started
    for s in started:
        s.stop()


def pair(tmp_path: Path, sims: list[Sim], *, peers: bool) -> tuple[Router, Router]:
    ports = free_ports(2)
    urls = [s.url for s in sims]
    a, b = (
        start_router(
            tmp_path,
            workers=urls,
            port=port,
            args=[*ARGS, *(["--peer", f"http://127.0.0.1:{other}"] if peers else [])],
        )
        for port, other in zip(ports, reversed(ports), strict=True)
    )
    return a, b


def test_a_replica_told_its_peers_routes_places_a_group_where_there_is_room_and_finds_the_others(
    tmp_path: Path, sims: list[Sim]
) -> None:
    """Two groups that both rank first on worker 1, whose KV holds one.  Replica A sends the first group there;
    replica B, which never saw it, gets the second: told A's route, B knows worker 1 is full and sends it to worker
    2; then each replica sends the other's group where it is cached.  Without peers (the premise, checked first)
    B sends the second group to worker 1 too, whose engine evicts the first."""
    w1, w2 = (s.url for s in sims)
    one, two = groups_ranking_first(sims[0], sims[1], 2)

    a, b = pair(tmp_path, sims, peers=False)
    try:
        ready([a, b], sims, peers=False)
        assert served(a, one + " first question")[0] == w1
        assert served(b, two + " first question")[0] == w1  # B's own tree: worker 1 has room
        assert served(b, one + " second question")[1] < PREFIX, "the engine kept both groups: the premise is wrong"
    finally:
        a.stop()
        b.stop()
    for s in sims:  # empty caches for the second arm
        assert http_json("POST", s.url + "/flush_cache")[0] == 200

    a, b = pair(tmp_path, sims, peers=True)
    try:
        ready([a, b], sims, peers=True)
        assert served(a, one + " first question")[0] == w1
        wait_until(lambda: applied(b) >= 1, timeout=10, what="B told A's route")
        assert served(b, two + " first question")[0] == w2, "B placed the second group on the full worker"
        wait_until(lambda: applied(a) >= 1, timeout=10, what="A told B's route")
        worker, cached = served(b, one + " second question")
        assert (worker, cached >= PREFIX) == (w1, True), (worker, cached)
        worker, cached = served(a, two + " second question")
        assert (worker, cached >= PREFIX) == (w2, True), (worker, cached)
        for r in (a, b):  # each told the other its two routes (batched: the last one a few ms later)
            wait_until(
                lambda r=r: metric_value(r.metrics(), "smg_peer_records_sent_total", outcome="sent") == 2,
                timeout=10,
                what="both routes acknowledged",
            )
            assert metric_value(r.metrics(), "smg_peer_records_sent_total", outcome="failed") == 0
    finally:
        a.stop()
        b.stop()


def test_a_peer_that_is_down_is_counted_and_the_router_routes_on_without_it(tmp_path: Path, sims: list[Sim]) -> None:
    """Its routes are dropped (``expired``, one warning), the router is not in sync, and it routes on as a router
    without peers does (its own share of the backlog decides whether it judges room)."""
    dead = free_port("127.0.0.1")
    args = [*ARGS, "--peer", f"http://127.0.0.1:{dead}", "--peer-queue-seconds", "1"]
    r = start_router(tmp_path, workers=[s.url for s in sims], args=args)
    try:
        ready([r], sims, peers=False)
        w1 = sims[0].url
        one, two = groups_ranking_first(sims[0], sims[1], 2)
        assert served(r, one + " q")[0] == w1
        wait_until(  # never sent: a peer that never answered is told nothing, and its queue's routes expire
            lambda: metric_value(r.metrics(), "smg_peer_records_sent_total", outcome="expired") >= 1,
            timeout=10,
            what="the route to the dead peer counted expired",
        )
        text = r.metrics()
        assert metric_value(text, "smg_peers_in_sync") == 0
        assert metric_value(text, "smg_peer_records_sent_total", outcome="sent") == 0
        assert served(r, two + " q")[1] == 0  # served, a miss as it should be
        assert r.log().count("its routes are dropped until it answers") == 1  # one warning, not one per batch
    finally:
        r.stop()


def readiness(router: Router) -> tuple[int, str]:
    status, body = http_json("GET", router.url + "/readiness", timeout=2)
    return status, body.get("status", "")


def test_a_replica_is_ready_once_in_sync_with_its_peers_or_after_the_grace(tmp_path: Path, sims: list[Sim]) -> None:
    """A new replica takes traffic in sync with the others: ``/readiness`` answers 503 ``peers_not_in_sync`` while a
    peer has not answered yet, though its workers are routable (its first requests would not claim their prefills:
    two replicas' first requests on one new prompt made the engine prefill it twice), and 200 as soon
    as every peer answered; a peer that never answers holds it back for ``--peers-ready-grace`` seconds at most."""
    urls = [s.url for s in sims]
    port_a, port_b, dead = free_ports(3)
    a = start_router(
        tmp_path,
        workers=urls,
        port=port_a,
        args=[*ARGS, "--peer", f"http://127.0.0.1:{port_b}", "--peers-ready-grace", "60"],
    )
    b = c = None
    try:
        a.wait_routable(2)
        time.sleep(0.5)  # a few of its tries found nobody at b's port
        assert readiness(a) == (503, "peers_not_in_sync")
        b = start_router(tmp_path, workers=urls, port=port_b, args=[*ARGS, "--peer", f"http://127.0.0.1:{port_a}"])
        b.wait_routable(2)
        wait_until(lambda: readiness(a)[0] == 200 and readiness(b)[0] == 200, timeout=5, what="both ready")

        started = time.monotonic()
        c = start_router(
            tmp_path,
            workers=urls,
            args=[*ARGS, "--peer", f"http://127.0.0.1:{dead}", "--peers-ready-grace", "6"],
        )
        assert readiness(c) == (503, "peers_not_in_sync")  # whether its workers are routable yet or not
        c.wait_routable(2)
        wait_until(lambda: readiness(c)[0] == 200, timeout=10, what="ready after the grace")
        assert time.monotonic() - started >= 6
        assert metric_value(c.metrics(), "smg_peers_in_sync") == 0  # ready all the same: it serves alone
    finally:
        for r in (a, b, c):
            if r is not None:
                r.stop()


def test_a_dns_name_that_lists_the_router_itself_is_no_peer(tmp_path: Path, sims: list[Sim]) -> None:
    port = free_port("127.0.0.1")
    r = start_router(tmp_path, workers=[sims[0].url], port=port, args=["--peers-dns", f"127.0.0.1:{port}"])
    try:
        r.wait_routable(1)
        wait_until(lambda: "is this router" in r.log(), timeout=10, what="the router finding itself in the name")
        assert readiness(r)[0] == 200  # alone: nobody to wait for
        served(r, "hello " * 10)
        text = r.metrics()
        assert metric_value(text, "smg_peers_in_sync") == 0
        assert metric_value(text, "smg_peer_records_received_total", outcome="applied") == 0
        assert metric_value(text, "smg_peer_records_sent_total", outcome="failed") == 0
    finally:
        r.stop()


def test_a_peer_batch_is_checked_whole_before_any_of_it_is_applied(tmp_path: Path, sims: list[Sim]) -> None:
    secret = "peer-secret"
    dead = free_port("127.0.0.1")
    args = [*ARGS, "--peer", f"http://127.0.0.1:{dead}", "--peer-secret", secret]
    r = start_router(tmp_path, workers=[sims[0].url], admin_key="admin-key", args=args)
    try:
        r.wait_routable(1)
        url = r.url + "/peers/routes"

        def signed(batch: dict[str, object]) -> tuple[int, Any]:
            body = orjson.dumps(batch)
            headers, _ = auth.sign_batch(secret.encode(), body)
            return http_json("POST", url, body, headers=headers)

        good = ["regular", MODEL, sims[0].url, "x" * 100, 0]
        status, body = http_json("POST", url, {"from": "other", "records": [good]})
        assert status == 401, body
        for bad, says in [
            ({"records": [good]}, "a peer batch is"),
            ({"from": "other", "records": [good, ["regular", MODEL, sims[0].url, "x", 5]]}, "records[1]: head"),
            ({"from": "other", "records": [good, ["leader", MODEL, sims[0].url, "x", 0]]}, "records[1]: role"),
            ({"from": "other", "records": [[{"role": 1}, MODEL, sims[0].url, "x", 0]]}, "records[0]: role"),
            ({"from": "other", "records": [[["regular"], MODEL, sims[0].url, "x", 0]]}, "records[0]: role"),
            ({"from": "other", "records": [good, [1, 2]]}, "records[1]: must be"),
            ({"from": "other", "records": [["regular", MODEL, 7, "x", 0]]}, "must be strings"),
            ({"from": "other", "records": [good], "prefills": {}}, "a peer batch is"),
            ({"from": "other", "records": [good], "prefills": [[sims[0].url, "x", "yes"]]}, "prefills[0]: done"),
            ({"from": "other", "records": [good], "prefills": [[sims[0].url, "", False]]}, "non-empty strings"),
            ({"from": "other", "records": [good], "prefills": [[sims[0].url, "x"]]}, "prefills[0]: must be"),
        ]:
            status, body = signed(bad)
            assert status == 400 and says in body["error"]["message"], (bad, body)
        assert metric_value(r.metrics(), "smg_peer_records_received_total", outcome="applied") == 0
        stranger = ["regular", MODEL, "http://127.0.0.1:9", "y" * 100, 0]
        leads = [[sims[0].url, "x" * 50, False], ["http://127.0.0.1:9", "x" * 50, False]]  # a stranger's is ignored
        batch = {"from": "other", "records": [good, stranger], "prefills": leads}
        status, body = signed(batch)
        assert status == 200 and (body["applied"], body["ignored"], body["leads"]) == (2, 2, [])  # it leads none
        assert body["id"]  # the router's id in its answers: its peers order their claims by it
        assert metric_value(r.metrics(), "smg_cache_tree_size_chars", model=MODEL, worker=sims[0].url) >= 100
    finally:
        r.stop()


def test_replicas_find_each_other_by_a_dns_name_and_share_their_routes(tmp_path: Path, sims: list[Sim]) -> None:
    """``--peers-dns HOST:PORT`` (the chart's headless Service; here a numeric host, resolved the same way): each
    router finds the other, gets in sync, and a route on one is applied on the other."""
    ports = free_ports(2)
    a, b = (
        start_router(tmp_path, workers=[sims[0].url], port=mine, args=["--peers-dns", f"127.0.0.1:{other}"])
        for mine, other in zip(ports, reversed(ports), strict=True)
    )
    try:
        for r in (a, b):
            r.wait_routable(1)
            wait_until(lambda r=r: metric_value(r.metrics(), "smg_peers_in_sync") == 1, timeout=15, what="in sync")
        served(a, "a prompt of its own " * 20)
        wait_until(lambda: applied(b) == 1, timeout=10, what="A's route applied on B")
        assert f"peer router http://127.0.0.1:{ports[0]} added" in b.log()
    finally:
        a.stop()
        b.stop()
