"""The lifecycle REST API against a real router and real smg-sim workers."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

from support.procs import MODEL, Sim, http_json, metric_value, start_router, start_sim, wait_until


def test_register_is_idempotent_and_lists_workers(logs: Path, fleet: list[Sim]) -> None:
    r = start_router(logs)
    try:
        status, w = r.admin("POST", "/workers", {"url": fleet[0].url, "model_id": MODEL, "labels": {"a": "b"}})
        assert status == 201 and w["status"] == "ready" and w["id"], w
        status, again = r.admin("POST", "/workers", {"url": fleet[0].url, "model_id": MODEL, "labels": {"a": "b"}})
        assert status == 200 and again["id"] == w["id"]
        status, conflict = r.admin("POST", "/workers", {"url": fleet[0].url, "model_id": MODEL})
        assert status == 409 and "already registered" in conflict["error"]["message"]
        assert [x["id"] for x in r.workers()] == [w["id"]]
        status, got = r.admin("GET", f"/workers/{w['id']}")
        assert status == 200 and got["url"] == fleet[0].url and got["owner"] == "user"
        status, patched = r.admin("PATCH", f"/workers/{w['id']}", {"labels": {"tier": "gold"}, "priority": 7})
        assert status == 200 and patched["labels"] == {"tier": "gold"} and patched["priority"] == 7
        status, bad = r.admin("PATCH", f"/workers/{w['id']}", {"url": "http://127.0.0.9:1"})
        assert status == 400 and "url" in bad["error"]["message"]
        status, put = r.admin("PUT", f"/workers/{w['id']}", {"model_id": MODEL, "labels": {}})
        assert status == 200 and put["labels"] == {} and put["priority"] == 50
        assert r.admin("GET", "/workers/w-nope")[0] == 404
        assert r.admin("DELETE", "/workers/w-nope")[0] == 404
        # SGLang router compatibility
        status, _ = r.admin("POST", f"/add_worker?url={fleet[1].url}")
        assert status == 201
        assert set(r.admin("GET", "/list_workers")[1]["urls"]) == {fleet[0].url, fleet[1].url}
        assert r.admin("POST", f"/remove_worker?url={fleet[1].url}")[0] == 200
        text = r.metrics()
        assert metric_value(text, "smg_worker_lifecycle_events_total", event="added", role="regular") == 2
        assert metric_value(text, "smg_worker_lifecycle_events_total", event="removed", role="regular") == 1
    finally:
        r.stop()


def test_delete_drains_removes_the_tenant_and_stops_routing(logs: Path) -> None:
    sims = [start_sim(logs, time_scale=1.0, extra=["--decode-step-ms", "20"]) for _ in range(2)]
    r = start_router(logs, workers=[s.url for s in sims])
    try:
        r.wait_routable(2)
        prefix = f"{uuid.uuid4()} shared context " * 30
        status, _ = http_json(
            "POST", r.url + "/v1/completions", {"model": MODEL, "prompt": prefix + "a", "max_tokens": 1}
        )
        assert status == 200
        victim = next(w for w in r.workers() if w["load"]["processed"] == 1)
        text = r.metrics()
        assert metric_value(text, "smg_cache_tree_size_chars", worker=victim["url"]) > 0
        # a long request in flight on the victim: DELETE must wait for it (drain)
        result: dict[str, object] = {}

        def long_request() -> None:
            result["answer"] = http_json(
                "POST",
                r.url + "/v1/completions",
                {"model": MODEL, "prompt": prefix + "b", "max_tokens": 60},
                timeout=30,
            )

        t = threading.Thread(target=long_request)
        t.start()
        wait_until(
            lambda: next(w for w in r.workers() if w["id"] == victim["id"])["load"]["inflight"] == 1,
            what="request in flight on the victim",
        )
        status, removed = r.admin("DELETE", f"/workers/{victim['id']}")
        t.join()
        assert status == 200 and removed["drained"] is True, removed
        assert result["answer"][0] == 200  # the in-flight request finished normally
        assert victim["id"] not in {w["id"] for w in r.workers()}
        text = r.metrics()
        assert metric_value(text, "smg_cache_tree_size_chars", worker=victim["url"]) == 0
        assert f'worker="{victim["url"]}"' not in text
        survivor = r.workers()[0]
        for i in range(5):
            status, _ = http_json(
                "POST", r.url + "/v1/completions", {"model": MODEL, "prompt": prefix + str(i), "max_tokens": 1}
            )
            assert status == 200
        assert next(w for w in r.workers() if w["id"] == survivor["id"])["load"]["processed"] >= 5
        victim_sim = next(s for s in sims if s.url == victim["url"])
        status, loads = http_json("GET", victim_sim.url + "/v1/loads")
        assert loads["loads"][0]["num_running_reqs"] == 0
    finally:
        r.stop()
        for s in sims:
            s.stop()


def test_worker_given_by_env_and_model_discovered(logs: Path, fleet: list[Sim]) -> None:
    r = start_router(logs, env={"SMG_WORKER_URLS": f"{fleet[0].url},{fleet[1].url}", "SMG_POLICY": "round-robin"})
    try:
        r.wait_routable(2)
        assert {w["model_id"] for w in r.workers()} == {MODEL}
        served = [
            http_json("POST", r.url + "/v1/completions", {"model": MODEL, "prompt": "same", "max_tokens": 1})
            for _ in range(4)
        ]
        assert all(s == 200 for s, _ in served)
        assert [w["load"]["processed"] for w in r.workers()] == [2, 2]  # round robin, not cache-aware
    finally:
        r.stop()
