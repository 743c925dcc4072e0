"""PD cache-aware lifecycle (seed 000): prefill and decode trees are initialised on registration through
the REST API, kept on update, cleaned on removal, and requests keep their locality in both roles."""

from __future__ import annotations

import uuid

import openai
from support.pd import register_pd
from support.procs import MODEL, Router, http_json, metric_value


def _processed(router: Router, role: str) -> dict[str, int]:
    return {w["url"]: w["load"]["processed"] for w in router.workers() if w["role"] == role}


def _chat(router: Router, prefix: str, n: int, start: int = 0) -> None:
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    for i in range(start, start + n):
        reply = client.chat.completions.create(
            model=MODEL,
            max_tokens=3,
            messages=[{"role": "system", "content": prefix}, {"role": "user", "content": f"question {i}"}],
        )
        assert reply.choices[0].message.content


def _hits(router: Router, role: str) -> float:
    return metric_value(router.metrics(), "smg_cache_tree_hits_total", model=MODEL, role=role)


def test_pd_cache_aware_shared_prefix_reaches_one_prefill_and_one_decode_worker(pd_router: Router, pd_fleet) -> None:
    prefills, decodes = pd_fleet
    assert http_json("GET", pd_router.url + "/readiness")[0] == 503  # nothing registered yet
    register_pd(pd_router, prefills, decodes)
    pd_router.wait_routable(4)
    assert http_json("GET", pd_router.url + "/readiness")[0] == 200
    prefix = f"{uuid.uuid4()} You are a careful assistant. " * 30
    _chat(pd_router, prefix, 6)
    pre, dec = _processed(pd_router, "prefill"), _processed(pd_router, "decode")
    assert sorted(pre.values()) == [0, 6], pre
    assert sorted(dec.values()) == [0, 6], dec
    assert _hits(pd_router, "prefill") == 5 and _hits(pd_router, "decode") == 5
    text = pd_router.metrics()
    assert metric_value(text, "smg_routing_fallbacks_total", reason="no_tree") == 0
    assert metric_value(text, "smg_pd_requests_total", status="success") == 6
    # distinct prefixes still spread over both workers of each role (rendezvous placement: 12 random ones all
    # on one of two workers has odds of 1 in 2048)
    for i in range(12):
        _chat(pd_router, f"{uuid.uuid4()} other topic {i} " * 20, 1)
    assert all(v > 0 for v in _processed(pd_router, "prefill").values())
    assert all(v > 0 for v in _processed(pd_router, "decode").values())


def test_pd_cache_aware_survives_update_removal_and_readd(pd_router: Router, pd_fleet) -> None:
    prefills, decodes = pd_fleet
    register_pd(pd_router, prefills, decodes)
    pd_router.wait_routable(4)
    prefix = f"{uuid.uuid4()} Shared tool definitions. " * 30
    _chat(pd_router, prefix, 2)
    pre = _processed(pd_router, "prefill")
    holder_url = max(pre, key=pre.get)
    holder = next(w for w in pd_router.workers() if w["url"] == holder_url)

    # update: new labels keep the worker in its tree, routing stays cache-aware
    status, _ = pd_router.admin("PATCH", f"/workers/{holder['id']}", {"labels": {"rack": "b"}})
    assert status == 200
    _chat(pd_router, prefix, 2, start=2)
    assert _processed(pd_router, "prefill")[holder_url] == pre[holder_url] + 2
    assert _hits(pd_router, "prefill") == 3

    # removal: the worker leaves the prefill tree; the other prefill worker takes over, decode keeps its hits
    decode_hits = _hits(pd_router, "decode")
    status, _ = pd_router.admin("DELETE", f"/workers/{holder['id']}")
    assert status == 200
    text = pd_router.metrics()
    assert metric_value(text, "smg_cache_tree_size_chars", role="prefill", worker=holder_url) == 0
    assert f'worker="{holder_url}"' not in text
    _chat(pd_router, prefix, 3, start=4)
    survivor = next(w for w in pd_router.workers() if w["role"] == "prefill")
    assert survivor["load"]["processed"] >= 3
    assert _hits(pd_router, "decode") == decode_hits + 3
    # the survivor is now the holder of the prefix: the next requests hit it
    prefill_hits = _hits(pd_router, "prefill")
    _chat(pd_router, prefix, 2, start=7)
    assert _hits(pd_router, "prefill") == prefill_hits + 2

    # re-adding works, and nothing ever fell back for a missing tree
    sim, bport = next((s, b) for s, b in prefills if s.url == holder_url)
    status, again = pd_router.admin(
        "POST", "/workers", {"url": sim.url, "role": "prefill", "model_id": MODEL, "bootstrap_port": bport}
    )
    assert status == 201 and again["status"] == "ready"
    _chat(pd_router, f"{uuid.uuid4()} fresh " * 20, 2)
    text = pd_router.metrics()
    assert metric_value(text, "smg_routing_fallbacks_total", reason="no_tree") == 0
    assert metric_value(text, "smg_worker_lifecycle_events_total", event="removed", role="prefill") == 1
    assert metric_value(text, "smg_pd_requests_total", status="success") == 11
