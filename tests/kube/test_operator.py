"""The operator against a real kube-apiserver: a real smg-operator process, two real smg-router processes as the
router Service's pods, and smg-sim workers as pods on their own loopback addresses."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from support.kube import ControlPlane
from support.operator_env import KEY, Env, allow_routers, operated_env, pool, routed_env
from support.operator_proc import SETTLE, OperatorProcess
from support.procs import MODEL, free_port, http_json, next_host, start_sim, wait_until

INTERVAL = 2.0


@pytest.fixture(scope="module")
def env(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    logs = tmp_path_factory.mktemp("operator-real")
    with operated_env(control_plane, logs, "op", routers=("smg-router", "smg-pd"), interval=INTERVAL) as e:
        yield e


def test_pool_is_registered_on_both_replicas_and_survives_pod_and_router_churn(env: Env) -> None:
    e = env
    a = e.add_worker_pod("llama-a", {"app": "llama"})
    b = e.add_worker_pod("llama-b", {"app": "llama"})
    manual = start_sim(e.logs)
    e.sims["manual"] = manual
    assert e.routers["router-0"].admin("POST", "/workers", {"url": manual.url, "model_id": MODEL})[0] == 201
    passes_before = e.operator.reconcile_passes()
    e.cp.apply_yaml(pool("llama", {"app": "llama"}, port=e.worker_port, router_port=e.router_port), e.ns)

    # both workers on both replicas by the SMGWorker's second reconcile pass at the latest (its first, or one a
    # late pod event pokes), not waiting for the timer; status Ready with 2/2
    t0 = time.monotonic()
    try:
        registering_pass = e.operator.passes_until(
            lambda: all({a.url, b.url} <= e.urls(p) for p in ("router-0", "router-1")),
            what="both workers on both replicas",
            start=passes_before,
        )
    except AssertionError as err:
        raise AssertionError(f"{err}; status: {(e.smgw('llama') or {}).get('status')}") from None
    took = time.monotonic() - t0
    assert registering_pass <= 2
    try:
        wait_until(lambda: e.condition("llama", "Ready").get("status") == "True", timeout=SETTLE, what="Ready=True")
    except AssertionError as err:
        raise AssertionError(f"{err}; status: {(e.smgw('llama') or {}).get('status')}") from None
    obj = e.smgw("llama")
    assert obj["status"]["ready"] == "2/2" and obj["status"]["registeredEndpoints"] == 2, obj["status"]
    table = e.cp.kubectl("get", "smgw", "-n", e.ns).stdout
    assert table.split("\n")[0].split() == ["NAME", "ROLE", "MODEL", "READY", "REGISTERED", "STATUS", "AGE"], table
    assert table.split("\n")[1].split()[:6] == ["llama", "regular", MODEL, "2/2", "2", "Ready"], table
    print(f"registered on both replicas after {took:.2f}s")

    # a terminating pod is drained and removed from both replicas by the pass its pod event pokes (or the one in
    # flight then)
    passes_before = e.operator.reconcile_passes()
    e.cp.mark_terminating(e.ns, "llama-a")
    removing_pass = e.operator.passes_until(
        lambda: all(a.url not in e.urls(p) for p in ("router-0", "router-1")),
        what="the terminating pod to leave both replicas",
        start=passes_before,
    )
    assert removing_pass <= 2
    assert all(b.url in e.urls(p) for p in ("router-0", "router-1"))
    # ... recreated on the same IP with a new UID: registered again, with the new pod UID
    e.cp.release_pod(e.ns, "llama-a")
    new = e.cp.make_ready_pod(e.ns, "llama-a", {"app": "llama"}, a.host, finalizers=["smg.test/hold"])
    new_uid = new["metadata"]["uid"]

    def reregistered() -> bool:
        return all(
            any(w["url"] == a.url and w["labels"].get("smg.dev/pod-uid") == new_uid for w in e.routers[p].workers())
            for p in ("router-0", "router-1")
        )

    wait_until(reregistered, timeout=SETTLE, what="the recreated pod to be registered with its new UID")

    # a restarted replica (empty registry) has every worker again by the next timer pass: counted in the
    # operator's reconcile passes (the one in flight when it came back, then the next), not in seconds
    e.routers["router-1"].stop()
    e.start_router("router-1")
    assert e.urls("router-1") == set()
    restoring_pass = e.operator.passes_until(
        lambda: {a.url, b.url} <= e.urls("router-1"), what="the restarted replica to get every worker back"
    )
    assert restoring_pass <= 2

    # a stopped replica: status and an Event say RouterUnreachable; started again: recovered
    e.routers["router-0"].stop()
    wait_until(
        lambda: e.condition("llama", "Registered").get("reason") == "RouterUnreachable",
        timeout=SETTLE,
        what="Registered=False RouterUnreachable",
    )
    wait_until(
        lambda: "RouterUnreachable" in e.event_reasons("llama"), timeout=SETTLE, what="a RouterUnreachable Event"
    )
    e.start_router("router-0")
    wait_until(
        lambda: e.condition("llama", "Registered").get("status") == "True", timeout=SETTLE, what="Registered=True again"
    )
    wait_until(lambda: "Recovered" in e.event_reasons("llama"), timeout=SETTLE, what="a Recovered Event")
    assert {a.url, b.url} <= e.urls("router-0")

    # the operator's own metrics
    metrics = e.operator.metrics()
    assert f'smg_operator_registered_workers{{smgworker="{e.ns}/llama"}} 2.0' in metrics, metrics
    assert 'smg_operator_hook_calls_total{hook="register",result="ok"}' in metrics

    # deleting the SMGWorker drains and removes its workers from every replica before the object goes;
    # the worker a person added by hand stays
    assert e.routers["router-0"].admin("POST", "/workers", {"url": manual.url, "model_id": MODEL})[0] in (200, 201)
    e.cp.kubectl("delete", "smgw", "llama", "-n", e.ns, "--wait=false")
    wait_until(lambda: e.smgw("llama") is None, timeout=SETTLE, what="the SMGWorker to disappear")
    for p in ("router-0", "router-1"):
        assert not {a.url, b.url} & e.urls(p), e.urls(p)
    assert manual.url in e.urls("router-0")


def test_pd_pools_drive_a_pd_router_with_the_bootstrap_port_from_the_annotation(env: Env) -> None:
    e = env
    e.add_service("smg-pd", "smg-pd")
    pd_router = e.add_router_pod("pd-router-0", app="smg-pd", args=["--pd-disaggregation"])
    host = next_host()
    bport = free_port(host)
    e.add_worker_pod(
        "prefill-0",
        {"app": "ds", "role": "prefill"},
        host=host,
        extra=["--role", "prefill", "--bootstrap-port", str(bport)],
        annotations={"sglang.ai/bootstrap-port": str(bport)},
    )
    e.add_worker_pod("decode-0", {"app": "ds", "role": "decode"}, extra=["--role", "decode"])
    ports = {"port": e.worker_port, "router_port": e.router_port, "service": "smg-pd"}
    # spec.bootstrapPort is wrong on purpose: the pod annotation must win
    e.cp.apply_yaml(
        pool("ds-prefill", {"app": "ds", "role": "prefill"}, role="prefill", bootstrapPort=1, **ports), e.ns
    )
    e.cp.apply_yaml(pool("ds-decode", {"app": "ds", "role": "decode"}, role="decode", **ports), e.ns)
    wait_until(
        lambda: http_json("GET", pd_router.url + "/readiness")[0] == 200,
        timeout=SETTLE,
        what="the PD router to have a prefill and a decode worker",
    )
    prefill = next(w for w in pd_router.workers() if w["role"] == "prefill")
    assert prefill["bootstrap_port"] == bport  # the annotation, not spec.bootstrapPort (1)
    status, body = http_json(
        "POST",
        pd_router.url + "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert status == 200, body
    assert body["choices"][0]["message"]["content"]


def test_leader_election_runs_one_operator_and_fails_over(control_plane, tmp_path_factory) -> None:
    cp = control_plane
    e = routed_env(cp, tmp_path_factory.mktemp("leader"), "le", replicas=1)
    args = [
        "--namespace",
        e.ns,
        "--reconcile-interval",
        "2",
        "--leader-election",
        "--leader-election-namespace",
        e.ns,
        "--leader-election-lease-duration",
        "4",
        "--leader-election-renew-deadline",
        "2",
        "--leader-election-retry-period",
        "1",
        "--kube-request-timeout",
        "2",
        "--router-timeout",
        "2",
        *allow_routers(e.ns, "smg-router"),
    ]
    first = OperatorProcess(e.logs, cp.kubeconfig, admin_key=KEY, args=args).start()  # readyz 200: it leads
    second = OperatorProcess(e.logs, cp.kubeconfig, admin_key=KEY, args=args, name="smg-operator-standby")
    second.proc.start()  # not .start(): it must not become ready while the first one leads
    lease_path = f"/apis/coordination.k8s.io/v1/namespaces/{e.ns}/leases/smg-operator"
    try:
        lease = cp.api("GET", lease_path)
        assert lease["spec"]["holderIdentity"].endswith(f"-{first.proc.popen.pid}")
        wait_until(lambda: "stands by" in second.proc.log(), timeout=SETTLE, what="the standby to find the lease held")
        # standing by while the leader renews: watched over two renewals (the leader renews and the standby
        # retries every retry period, 1 s), not over some seconds
        renewals: set[str] = set()

        def leader_renewed_twice_and_standby_not_ready() -> bool:
            spec = cp.api("GET", lease_path)["spec"]
            assert spec["holderIdentity"].endswith(f"-{first.proc.popen.pid}"), spec
            assert second.probe("/healthz") == 200  # live while standing by: a liveness probe leaves it alone
            assert second.probe("/readyz") == 503  # not ready: no Service sends it anything
            renewals.add(spec["renewTime"])
            return len(renewals) >= 3

        wait_until(
            leader_renewed_twice_and_standby_not_ready,
            timeout=SETTLE,
            what="two renewals by the leader while the standby waits",
        )
        sim = e.add_worker_pod("w-0", {"app": "w"})
        cp.apply_yaml(pool("pool", {"app": "w"}, port=e.worker_port, router_port=e.router_port), e.ns)
        wait_until(lambda: sim.url in e.urls("router-0"), timeout=SETTLE, what="the leader to register the pool")
        first.stop()  # a clean exit releases the lease: the standby takes over
        wait_until(
            lambda: second.probe("/readyz") == 200,
            timeout=SETTLE,
            what="the standby to take the lease",
        )
        lease = cp.api("GET", lease_path)
        assert lease["spec"]["holderIdentity"].endswith(f"-{second.proc.popen.pid}")
        e.routers["router-0"].stop()
        e.start_router("router-0")  # empty registry: only a working new leader fills it again
        wait_until(lambda: sim.url in e.urls("router-0"), timeout=SETTLE, what="the new leader to reconcile")
    finally:
        first.stop()
        second.stop()
        for proc in [*e.routers.values(), *e.sims.values()]:
            proc.stop()
