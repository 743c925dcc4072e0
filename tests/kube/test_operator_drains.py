"""Drains and former routers, against a real kube-apiserver: the ``smg.dev/drain`` pod annotation drains a worker
on every replica and its removal undrains it; a long drain holds up no other registration; a changed
``spec.router`` leaves nothing on the old router; a deleted router Service does not release the finalizer while its
pods still hold the workers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from support.kube import ControlPlane
from support.operator_env import Env, operated_env, pool
from support.operator_proc import SETTLE
from support.procs import Served, Sim, next_host, wait_until

REPLICAS = ("router-0", "router-1")


@pytest.fixture(scope="module")
def env(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    logs = tmp_path_factory.mktemp("operator-drains")
    with operated_env(control_plane, logs, "drain", routers=("smg-router", "smg-router-b", "smg-router-c")) as e:
        e.router_hosts["router-b"] = next_host()
        yield e


def _status(e: Env, pod: str, url: str) -> str | None:
    return next((w["status"] for w in e.routers[pod].workers() if w["url"] == url), None)


def _worker(e: Env, pod: str, labels: dict[str, str], model: str, *extra: str) -> Sim:
    """A worker pod serving its own model, so that each test's requests reach only its own pool."""
    return e.add_worker_pod(pod, labels, extra=["--model", model, *extra])


def _pool(e: Env, name: str, labels: dict[str, str], model: str, **extra: object) -> None:
    e.cp.apply_yaml(pool(name, labels, port=e.worker_port, router_port=e.router_port, model=model, **extra), e.ns)


def _on_every_replica(e: Env, *urls: str, replicas: tuple[str, ...] = REPLICAS) -> bool:
    return all(set(urls) <= e.urls(p) for p in replicas)


def test_the_drain_annotation_takes_a_pod_out_of_rotation_on_every_replica_and_its_removal_puts_it_back(
    env: Env,
) -> None:
    e = env
    a, b = _worker(e, "rr-a", {"app": "rr"}, "rr-model"), _worker(e, "rr-b", {"app": "rr"}, "rr-model")
    _pool(e, "rr", {"app": "rr"}, "rr-model", policy="round_robin")
    wait_until(lambda: _on_every_replica(e, a.url, b.url), timeout=SETTLE, what="both workers on both replicas")
    wait_until(
        lambda: all(e.routers[p].worker(u)["routable"] for p in REPLICAS for u in (a.url, b.url)),
        timeout=SETTLE,
        what="both workers routable on both replicas",
    )

    e.cp.kubectl("annotate", "pod", "rr-a", "smg.dev/drain=true", "-n", e.ns)
    wait_until(
        lambda: all(_status(e, p, a.url) == "draining" for p in REPLICAS),
        timeout=SETTLE,
        what="rr-a draining on both replicas",
    )
    assert all(_status(e, p, b.url) == "ready" for p in REPLICAS)
    served = [e.routers[p].complete(f"drained {i}", model="rr-model") for i in range(6) for p in REPLICAS]
    assert {s.status for s in served} == {200}
    assert {s.worker_url for s in served} == {b.url}  # still registered, but no new request reaches it
    obj = e.smgw("rr") or {}
    assert obj["status"]["registeredEndpoints"] == 2, obj["status"]  # drained is not deregistered

    e.cp.kubectl("annotate", "pod", "rr-a", "smg.dev/drain-", "-n", e.ns)
    wait_until(
        lambda: all(_status(e, p, a.url) == "ready" for p in REPLICAS),
        timeout=SETTLE,
        what="rr-a routable again on both replicas",
    )
    served = [e.routers[p].complete(f"undrained {i}", model="rr-model") for i in range(6) for p in REPLICAS]
    assert {s.worker_url for s in served} == {a.url, b.url}


def test_a_long_drain_of_a_terminating_pod_lets_its_request_finish_and_holds_up_no_other_registration(
    env: Env,
) -> None:
    e = env
    # real time (no --time-scale speed-up): 15 ms a token, so 800 tokens keep a request in flight about 12 s
    slow = _worker(e, "long-a", {"app": "long"}, "long-model", "--time-scale", "1")
    _pool(e, "long", {"app": "long"}, "long-model", drainTimeoutSeconds=120)
    wait_until(lambda: _on_every_replica(e, slow.url), timeout=SETTLE, what="long-a on both replicas")
    wait_until(lambda: e.routers["router-0"].worker(slow.url)["routable"], timeout=SETTLE, what="long-a routable")

    answers: list[Served] = []
    request = threading.Thread(
        target=lambda: answers.append(
            e.routers["router-0"].complete("a long one", max_tokens=800, timeout=120, model="long-model")
        ),
        daemon=True,
    )
    request.start()
    wait_until(
        lambda: e.routers["router-0"].worker(slow.url)["load"]["inflight"] == 1,
        timeout=SETTLE,
        what="the long request in flight on long-a",
    )

    e.cp.mark_terminating(e.ns, "long-a")  # the drain starts on both replicas; router-0's waits for the request
    wait_until(
        lambda: all(_status(e, p, slow.url) in ("draining", None) for p in REPLICAS),
        timeout=SETTLE,
        what="long-a draining (or gone) on both replicas",
    )
    started = time.monotonic()
    fresh = _worker(e, "long-b", {"app": "long"}, "long-model")
    wait_until(lambda: _on_every_replica(e, fresh.url), timeout=SETTLE, what="long-b on both replicas")
    took = time.monotonic() - started
    assert request.is_alive(), "the long request ended before the new pod was registered: the test proves nothing"
    print(f"a new pod registered on both replicas {took:.2f}s after a 120 s drain began")

    request.join(timeout=120)
    assert answers and answers[0].status == 200, answers
    assert answers[0].body["choices"][0]["finish_reason"] == "length"  # ran to its end, not cut by the drain
    wait_until(
        lambda: all(slow.url not in e.urls(p) for p in REPLICAS),
        timeout=SETTLE,
        what="long-a removed from both replicas once drained",
    )
    e.cp.release_pod(e.ns, "long-a")


def test_moving_an_smgworker_to_another_router_leaves_nothing_on_the_old_one(env: Env) -> None:
    e = env
    w = _worker(e, "mv-a", {"app": "mv"}, "mv-model")
    _pool(e, "mv", {"app": "mv"}, "mv-model")
    wait_until(lambda: _on_every_replica(e, w.url), timeout=SETTLE, what="mv-a on both replicas")

    e.add_service("smg-router-b", "smg-router-b")
    e.add_router_pod("router-b", app="smg-router-b")
    _pool(e, "mv", {"app": "mv"}, "mv-model", service="smg-router-b")
    wait_until(lambda: w.url in e.urls("router-b"), timeout=SETTLE, what="mv-a on the new router")
    wait_until(
        lambda: all(w.url not in e.urls(p) for p in REPLICAS), timeout=SETTLE, what="mv-a gone from the old router"
    )

    def status_shows_only_the_new_router() -> bool:
        status = (e.smgw("mv") or {}).get("status") or {}
        return [r["pod"] for r in status.get("routers") or []] == ["router-b"] and not status.get("staleRouters")

    wait_until(status_shows_only_the_new_router, timeout=SETTLE, what="status: router-b only, nothing stale")


def test_the_finalizer_reaches_the_replicas_of_a_deleted_router_service_before_it_lets_go(env: Env) -> None:
    e = env
    w = _worker(e, "fin-a", {"app": "fin"}, "fin-model")
    _pool(e, "fin", {"app": "fin"}, "fin-model", service="smg-router-c")
    e.add_service("smg-router-c", "smg-router")  # another Service over the same router pods
    wait_until(lambda: _on_every_replica(e, w.url), timeout=SETTLE, what="fin-a on both replicas")
    wait_until(
        lambda: len((e.smgw("fin") or {}).get("status", {}).get("routers") or []) == 2,
        timeout=SETTLE,
        what="both replicas recorded in status",
    )

    e.cp.api("DELETE", f"/api/v1/namespaces/{e.ns}/services/smg-router-c")
    assert _on_every_replica(e, w.url)  # a missing Service alone strips nothing from replicas that still serve
    e.cp.kubectl("delete", "smgw", "fin", "-n", e.ns, "--wait=false")
    wait_until(lambda: e.smgw("fin") is None, timeout=SETTLE, what="the SMGWorker to disappear")
    for p in REPLICAS:
        assert w.url not in e.urls(p), f"{p} still holds the deleted SMGWorker's worker"
