"""A worker's ``kv_capacity_tokens`` on a real router and a real ``smg-sim``: it caps the worker's
tree share in place of the capacity the engine reports, and a PATCH of it takes effect on the next upkeep round."""

from __future__ import annotations

import random
import string
import time
import uuid
from pathlib import Path

from support.procs import MODEL, Router, http_json, metric_value, start_router, start_sim, wait_until


def _words(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(n))


def _complete(router: Router, prompt: str) -> int:
    """Cached tokens of one completion, as the engine reports them."""
    status, body = http_json(
        "POST", router.url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    )
    assert status == 200, body
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_the_setting_caps_the_tree_below_the_engines_report_and_a_patch_changes_it(tmp_path: Path) -> None:
    """The sim reports (and keeps) 100k tokens; the worker is registered with 3000, so its share of the tree
    (1 char a token) is held at 3000 chars though the engine still holds both 2000-char prompts; a PATCH to
    1000 holds it at 1000; a PATCH to null gives the engine's report back (no cap below 100k)."""
    sim = start_sim(tmp_path, extra=["--kv-capacity", "100000"])
    r = start_router(tmp_path, args=["--tree-chars-per-token", "1"])
    try:
        status, worker = r.admin("POST", "/workers", {"url": sim.url, "model_id": MODEL, "kv_capacity_tokens": 3000})
        assert status == 201, worker
        assert worker["kv_capacity_tokens"] == 3000
        r.wait_routable(1)

        def tree_size() -> float:
            return metric_value(r.metrics(), "smg_cache_tree_size_chars", model=MODEL, worker=sim.url)

        rng = random.Random(11)
        one, two, three = (f"{uuid.uuid4()} " + _words(rng, 2000) for _ in range(3))
        _complete(r, one)
        _complete(r, two)
        wait_until(lambda: 0 < tree_size() <= 3000, timeout=15, what="the tree share capped at the setting")
        assert metric_value(r.metrics(), "smg_cache_tree_evictions_total", model=MODEL) >= 1000
        assert _complete(r, one + " again") >= 2000, "the engine evicted the first prompt: not the test's premise"

        _complete(r, f"{uuid.uuid4()} " + _words(rng, 500))  # the most recent: what a cap of 1000 keeps
        status, body = r.admin("PATCH", f"/workers/{worker['id']}", {"kv_capacity_tokens": 1000})
        assert status == 200 and body["kv_capacity_tokens"] == 1000, body
        wait_until(lambda: 0 < tree_size() <= 1000, timeout=15, what="the tree share capped at the patched value")

        status, body = r.admin("PATCH", f"/workers/{worker['id']}", {"kv_capacity_tokens": None})
        assert status == 200 and body["kv_capacity_tokens"] is None, body
        _complete(r, three)
        wait_until(lambda: tree_size() > 2000, timeout=15, what="the new prompt in the tree")
        evicted = metric_value(r.metrics(), "smg_cache_tree_evictions_total", model=MODEL)
        time.sleep(1.5)  # three upkeep rounds (0.5 s each) under the engine's 100k report: nothing to evict
        assert tree_size() > 2000
        assert metric_value(r.metrics(), "smg_cache_tree_evictions_total", model=MODEL) == evicted

        status, body = r.admin("PATCH", f"/workers/{worker['id']}", {"kv_capacity_tokens": 0})
        assert status == 400 and "kv_capacity_tokens" in str(body), body
    finally:
        r.stop()
        sim.stop()
