"""Deleting an SMGWorker: the finalizer takes its workers off every replica first, and waits for routers."""

from __future__ import annotations

from kmock_harness import (
    ADMIN_KEY,
    OPERATOR_FINALIZER,
    OWNER_UID,
    SETTLE,
    Fleet,
    Kube,
    Operator,
    registered_pool,
    wait_for,
)
from support.procs import http_json, metric_value

LONGEST_RETRY_DELAY = 30.0
"""The finalizer's backoff stops doubling there (smg_operator.reconciler.retry_delay)."""


def _registered_pool(kube: Kube, fleet: Fleet) -> tuple[str, set[str]]:
    uid, want = registered_pool(kube, fleet)
    wait_for(
        lambda: OPERATOR_FINALIZER in (kube.smgworker("llama")["metadata"].get("finalizers") or []),
        timeout=SETTLE,
        what="the operator's finalizer",
    )
    return uid, want


def _unreachable_lists(operator: Operator) -> float:
    """Failed ``GET /workers`` calls: one per try of the finalizer at the frozen replica."""
    return metric_value(operator.metrics(), "smg_operator_hook_calls_total", hook="list", result="unreachable")


def test_deleting_an_smgworker_removes_its_workers_from_every_replica_before_it_disappears(
    kube: Kube, fleet: Fleet, operator: Operator
) -> None:
    uid, _ = _registered_pool(kube, fleet)
    by_hand = fleet.add_sim("by-hand")
    for router in fleet.routers.values():
        status, body = http_json(
            "POST", router.url + "/workers", {"url": by_hand.url}, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        )
        assert status == 201, body

    kube.call("DELETE", kube.smgw_path("llama"))
    # Poll fast: the moment the object is gone, no replica may still hold one of its workers.
    wait_for(lambda: kube.smgworker("llama") is None, timeout=SETTLE, interval=0.02, what="the SMGWorker gone")
    for pod in fleet.routers:
        assert fleet.urls(pod, owner_uid=uid) == set()
        assert fleet.urls(pod) == {by_hand.url}  # a worker a person added is left alone
        assert all(not (w.get("labels") or {}).get(OWNER_UID) for w in fleet.workers(pod))

    # The emulator's history of the object: marked for deletion, then released by the operator's finalizer.
    history = kube.server.call(
        lambda emu: [
            dict(v) if v is not None else None
            for v in emu.objects["smg.dev/v1alpha1/smgworkers", kube.ns, "llama"].history
        ]
    )
    assert history[-1] is None
    last = history[-2]
    assert last["metadata"]["deletionTimestamp"]
    assert OPERATOR_FINALIZER not in (last["metadata"].get("finalizers") or [])


def test_an_smgworker_deleted_while_a_router_is_unreachable_keeps_its_finalizer_until_the_router_is_back(
    kube: Kube, fleet: Fleet, operator: Operator
) -> None:
    uid, want = _registered_pool(kube, fleet)

    with fleet.frozen("router-1"):  # SIGSTOP: it keeps its registry but answers nothing
        kube.call("DELETE", kube.smgw_path("llama"))
        wait_for(
            lambda: fleet.urls("router-0", owner_uid=uid) == set(),
            timeout=SETTLE,
            what="the workers removed from the reachable replica",
        )
        wait_for(
            lambda: "RouterUnreachable" in kube.event_reasons("llama"),
            timeout=SETTLE,
            what="a RouterUnreachable event about the pending deregistration",
        )
        wait_for(
            lambda: "deregistration pending" in kube.status("llama").get("lastError", ""),
            timeout=SETTLE,
            what="status.lastError: deregistration pending",
        )
        # It must hold on, however long the router is away: watched over two more failed tries of the finalizer
        # (after the one that wrote lastError), not over some seconds that may hold no try at all.
        tries_before = _unreachable_lists(operator)

        def held_over_two_more_tries() -> bool:
            smgw = kube.smgworker("llama")
            assert smgw is not None, "the SMGWorker went away while a replica still held its workers"
            assert smgw["metadata"]["deletionTimestamp"]
            assert OPERATOR_FINALIZER in smgw["metadata"]["finalizers"]
            return _unreachable_lists(operator) >= tries_before + 2

        wait_for(held_over_two_more_tries, timeout=SETTLE, interval=0.2, what="two more failed finalizer tries")
        event = next(e for e in kube.events("llama") if e["reason"] == "RouterUnreachable")
        assert event["type"] == "Warning" and "router-1" in event["message"]

    assert fleet.urls("router-1", owner_uid=uid) == want  # it kept them while frozen
    wait_for(
        lambda: kube.smgworker("llama") is None,
        timeout=SETTLE + LONGEST_RETRY_DELAY,
        interval=0.1,
        what="the SMGWorker gone once the replica answers again (finalizer retries back off)",
    )
    assert fleet.urls("router-1", owner_uid=uid) == set()
    assert fleet.urls("router-0", owner_uid=uid) == set()
