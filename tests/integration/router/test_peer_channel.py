"""Who may speak on the replica channel (``POST /peers/routes``; ``smg_router.coordination.receiver``, ``auth``): a
router without peers takes no batch, one with peers only from a peer's address and, with ``--peer-secret``, only
signed; a batch names only what the fleet has; a big batch does not stall the router.  Forged batches are sent over
raw HTTP from a loopback address of the test's choosing."""

from __future__ import annotations

import http.client
import json
import threading
import time
import uuid
from pathlib import Path

import orjson
from smg_router.coordination import auth
from support.procs import (
    MODEL,
    Router,
    Sim,
    free_port,
    metric_value,
    next_host,
    start_router,
    start_sim,
    wait_until,
)

SECRET = "peer-secret-for-tests"


def post_batch(
    router: Router,
    batch: dict[str, object] | bytes,
    *,
    source: str,
    secret: str | None = SECRET,
    headers: dict[str, str] | None = None,
    port: int | None = None,
) -> tuple[int, bytes, dict[str, str]]:
    """A batch POSTed from the loopback address ``source`` (signed with ``secret`` unless None)."""
    body = batch if isinstance(batch, bytes) else orjson.dumps(batch)
    sent = {"Content-Type": "application/json", **(headers or {})}
    if secret is not None and headers is None:
        signed, _ = auth.sign_batch(secret.encode(), body)
        sent.update(signed)
    conn = http.client.HTTPConnection(router.host, port or router.port, timeout=30, source_address=(source, 0))
    try:
        conn.request("POST", "/peers/routes", body=body, headers=sent)
        resp = conn.getresponse()
        return resp.status, resp.read(), dict(resp.getheaders())
    finally:
        conn.close()


def ttft(router: Router, prompt: str) -> float:
    """Seconds from a streamed completion's request to its first chunk."""
    conn = http.client.HTTPConnection(router.host, router.port, timeout=30)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True}
    started = time.monotonic()
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        resp.read1(1)
        first = time.monotonic() - started
        resp.read()
        return first
    finally:
        conn.close()


def rejected(router: Router, reason: str) -> float:
    return metric_value(router.metrics(), "smg_peer_batches_rejected_total", reason=reason)


def lone_peer_router(tmp_path: Path, sim: Sim, *extra: str) -> Router:
    """A router on 127.0.0.1 whose one peer (down) is at 127.0.0.1: batches from that address are a peer's."""
    dead = free_port("127.0.0.1")
    args = ["--peer", f"http://127.0.0.1:{dead}", "--peer-secret", SECRET, "--peers-ready-grace", "0", *extra]
    r = start_router(tmp_path, workers=[sim.url], args=args)
    r.wait_routable(1)
    return r


def test_a_router_without_peers_takes_no_peer_batch(tmp_path: Path) -> None:
    """Whatever the admin key or the secret: 404 ``peers_disabled``, and nothing of the batch applied."""
    sim = start_sim(tmp_path)
    r = start_router(tmp_path, workers=[sim.url], admin_key="k")
    try:
        r.wait_routable(1)
        batch = {"from": "x", "records": [["regular", MODEL, sim.url, "y" * 100, 0]]}
        status, body, _ = post_batch(r, batch, source="127.0.0.1", headers={"Authorization": "Bearer k"})
        assert status == 404 and b"peers_disabled" in body, body
        assert rejected(r, "peers_disabled") == 1
        assert metric_value(r.metrics(), "smg_cache_tree_size_chars", worker=sim.url) == 0
    finally:
        r.stop()
        sim.stop()


def test_a_forged_lead_from_an_address_that_is_no_peer_is_refused_and_holds_nothing(tmp_path: Path) -> None:
    """A batch telling of a first prefill on a prefix, signed even, but sent from an address no peer has: 403, and a
    streamed request on that prefix starts at once.  The same lead from the peer's address holds it (the premise:
    the forgery would have worked), for the bound of ``--prefill-hold-seconds``."""
    sim = start_sim(tmp_path)
    r = lone_peer_router(tmp_path, sim, "--prefill-hold-seconds", "2")
    try:
        prefix = f"[doc {uuid.uuid4()}] " + "lorem ipsum " * 200
        lead = {"from": "forger", "records": [], "prefills": [[sim.url, prefix[:1024], False]]}
        status, body, _ = post_batch(r, lead, source=next_host())
        assert status == 403 and b"not_a_peer" in body, body
        assert rejected(r, "not_a_peer") == 1
        assert ttft(r, prefix + " q1") < 1.0

        other = f"[doc {uuid.uuid4()}] " + "lorem ipsum " * 200
        lead["prefills"] = [[sim.url, other[:1024], False]]
        status, body, _ = post_batch(r, lead, source="127.0.0.1")
        assert status == 200, body
        assert ttft(r, other + " q1") >= 1.5  # held behind the lead its peer told of
    finally:
        r.stop()
        sim.stop()


def test_a_batch_from_a_peer_address_needs_the_peer_secret_not_the_admin_key(tmp_path: Path) -> None:
    """Unsigned (even with the admin key), signed with another secret, too old, or sent twice: 401, counted by reason;
    signed: 200, with an answer signed for its nonce."""
    sim = start_sim(tmp_path)
    r = lone_peer_router(tmp_path, sim, "--admin-api-key", "admin")
    try:
        batch = {"from": "p", "records": [["regular", MODEL, sim.url, "z" * 100, 0]]}
        body = orjson.dumps(batch)
        status, _, _ = post_batch(r, body, source="127.0.0.1", headers={"Authorization": "Bearer admin"})
        assert status == 401 and rejected(r, "unsigned") == 1
        assert post_batch(r, body, source="127.0.0.1", secret="another")[0] == 401
        assert rejected(r, "bad_signature") == 1
        old, _ = auth.sign_batch(SECRET.encode(), body, at=time.time() - 3600)
        assert post_batch(r, body, source="127.0.0.1", headers=old)[0] == 401
        assert rejected(r, "stale_batch") == 1
        signed, nonce = auth.sign_batch(SECRET.encode(), body)
        status, answer, headers = post_batch(r, body, source="127.0.0.1", headers=signed)
        assert status == 200, answer
        assert auth.answer_signed(SECRET.encode(), nonce, headers, answer)
        assert post_batch(r, body, source="127.0.0.1", headers=signed)[0] == 401
        assert rejected(r, "replayed_batch") == 1
        assert metric_value(r.metrics(), "smg_peer_records_received_total", outcome="applied") == 1
    finally:
        r.stop()
        sim.stop()


def test_a_batch_naming_models_and_workers_the_fleet_lacks_makes_no_series(tmp_path: Path) -> None:
    """A peer's batch of 2000 model names and a worker url nobody registered: every record dropped and counted by
    reason; the exposition gains no series, no tree is made."""
    sim = start_sim(tmp_path)
    r = lone_peer_router(tmp_path, sim)
    try:
        before = r.metrics()
        records = [["regular", f"model-{i}", sim.url, "w" * 50, 0] for i in range(2000)]
        records += [["regular", MODEL, "http://127.0.0.1:9", "w" * 50, 0]]
        status, body, _ = post_batch(r, {"from": "p", "records": records}, source="127.0.0.1")
        assert status == 200, body
        assert orjson.loads(body)["applied"] == 0
        text = r.metrics()
        assert metric_value(text, "smg_peer_records_rejected_total", reason="unknown_model") == 2000
        assert metric_value(text, "smg_peer_records_rejected_total", reason="unknown_worker") == 1
        assert "model-1" not in text
        series = [line for line in text.splitlines() if line.startswith("smg_cache_tree_bytes")]
        assert len(series) == len([line for line in before.splitlines() if line.startswith("smg_cache_tree_bytes")])
    finally:
        r.stop()
        sim.stop()


class Pinger:
    """GET /liveness in a loop on one connection, from a thread: the longest round trip is the longest time the
    router's event loop answered nothing."""

    def __init__(self, router: Router) -> None:
        self._router = router
        self._stop = threading.Event()
        self.longest = 0.0
        self.count = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Pinger:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        conn = http.client.HTTPConnection(self._router.host, self._router.port, timeout=30)
        try:
            while not self._stop.is_set():
                started = time.perf_counter()
                conn.request("GET", "/liveness")
                conn.getresponse().read()
                self.longest = max(self.longest, time.perf_counter() - started)
                self.count += 1
        finally:
            conn.close()


def test_the_largest_peer_batch_stalls_the_router_no_more_than_a_slice_and_a_larger_one_is_refused(
    tmp_path: Path,
) -> None:
    """A batch of ``--peer-batch-bytes`` (1 MiB: ~7000 routes of 100 chars, each on the router's worker) is applied
    in slices: a probe answered meanwhile never waits half as long as the batch took (applied in one go, one would
    wait for most of it; in slices, 2-5 ms, a few times more on a loaded machine: times are compared within the run).
    A batch of 8 MiB is refused (413) before it is parsed."""
    sim = start_sim(tmp_path)
    r = lone_peer_router(tmp_path, sim)
    try:
        records: list[list[object]] = []
        size = 100
        while size < 1024 * 1024 - 4096:
            text = f"{uuid.uuid4()} " + "v" * 60
            records.append(["regular", MODEL, sim.url, text, 0])
            size += len(text) + len(MODEL) + len(sim.url) + 24
        body = orjson.dumps({"from": "p", "records": records})
        assert len(body) <= 1024 * 1024
        with Pinger(r) as idle:
            time.sleep(0.3)
        with Pinger(r) as probe:
            time.sleep(0.05)
            started = time.perf_counter()
            status, answer, _ = post_batch(r, body, source="127.0.0.1")
            took = time.perf_counter() - started
            time.sleep(0.05)
        assert status == 200, answer[:200]
        assert orjson.loads(answer)["applied"] == len(records)
        assert probe.longest < took / 2, (probe.longest, idle.longest, took, probe.count)

        big = orjson.dumps({"from": "p", "records": records * 9})
        status, answer, _ = post_batch(r, big, source="127.0.0.1")
        assert status == 413, answer[:200]
        assert rejected(r, "too_large") == 1
    finally:
        r.stop()
        sim.stop()


def test_a_pod_of_several_processes_checks_a_batch_by_where_it_came_from_and_signs_its_merged_answer(
    tmp_path: Path,
) -> None:
    """``--processes 2``: a batch reaches the parent on the admin port, or a child on the data port without one; either
    way the processes that apply it check the address it came from (not their own socket's) and the signature, and
    the pod's merged answer is signed for the batch's nonce."""
    sim = start_sim(tmp_path)
    dead, admin = free_port("127.0.0.1"), free_port("127.0.0.1")
    for extra in ([], ["--admin-port", str(admin)]):
        pod = tmp_path / f"pod-{len(extra)}"
        args = ["--peer", f"http://127.0.0.1:{dead}", "--peer-secret", SECRET, "--peers-ready-grace", "0"]
        r = start_router(
            tmp_path, workers=[sim.url], args=[*args, "--processes", "2", "--processes-dir", str(pod), *extra]
        )
        try:
            wait_until(lambda r=r: "with 2 processes" in r.log(), what="the parent serving (both processes started)")
            r.wait_routable(1)
            port = admin if extra else r.port
            body = orjson.dumps({"from": "p", "records": [["regular", MODEL, sim.url, "q" * 100, 0]]})
            status, answer, _ = post_batch(r, body, source=next_host(), port=port)
            assert status == 403 and b"not_a_peer" in answer, (extra, answer)
            assert post_batch(r, body, source="127.0.0.1", secret="another", port=port)[0] == 401
            signed, nonce = auth.sign_batch(SECRET.encode(), body)
            status, answer, headers = post_batch(r, body, source="127.0.0.1", headers=signed, port=port)
            assert status == 200, (extra, answer)
            assert orjson.loads(answer)["applied"] == 2  # each process applied it
            assert auth.answer_signed(SECRET.encode(), nonce, headers, answer)
        finally:
            r.stop()
    sim.stop()
