"""Leadership cannot split: two smg-operator processes on a real kube-apiserver; the leader is
cut off from the API server (its own TCP proxy black-holes), not killed.

Each operator has its own ServiceAccount and its own proxy, and the API server writes an audit log, so the test
reads who wrote what and when.  It shows: the standby is live and not ready while it stands by; it takes the
lease once the leader's record has stood still for a lease duration; the old leader makes no API write after
its renew deadline (not even once its proxy is restored) and no router call; it exits non-zero.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.kube import ControlPlane, write_kubeconfig
from support.operator_env import KEY, Env, leading_own_router, pool, routed_env
from support.operator_proc import SETTLE, OperatorProcess
from support.procs import metric_value, wait_until
from support.tcp_proxy import CuttableProxy

LEASE, DEADLINE, RETRY, CALL_TIMEOUT = 6, 4.0, 1.0, 2.0
MARGIN = 0.5
"""Slack past the old leader's renew deadline before a write of its would count as late, in seconds."""
TAKEOVER_SLACK = 1.5
"""Slack for the standby's calls and the test's own polling of the Lease on a shared machine, in seconds."""
WRITES = {"create", "update", "patch", "delete", "deletecollection"}


@pytest.fixture(scope="module")
def audited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A control plane of this module's own, with the audit log on."""
    cp = ControlPlane(log_dir=tmp_path_factory.mktemp("kube-audit"), audit=True)
    cp.start()
    try:
        yield cp
    finally:
        cp.stop()


class Replica:
    """One operator process with its own ServiceAccount, behind its own cuttable proxy to the API server."""

    def __init__(self, e: Env, name: str, args: list[str]) -> None:
        cp = e.cp
        token = cp.service_account_token(e.ns, name)
        self.user = f"system:serviceaccount:{e.ns}:{name}"
        cp.api(
            "POST",
            "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": f"{e.ns}-{name}"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
                "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": e.ns}],
            },
        )
        host, port = cp.server.removeprefix("https://").rsplit(":", 1)
        self.proxy = CuttableProxy((host, int(port)))
        kubeconfig = write_kubeconfig(Path(e.logs) / f"{name}.kubeconfig", self.proxy.url, token, user=name)
        self.op = OperatorProcess(e.logs, kubeconfig, admin_key=KEY, args=args, name=name)

    @property
    def pid(self) -> int:
        assert self.op.proc.popen is not None
        return self.op.proc.popen.pid

    def hook_calls(self) -> float:
        """Router calls made so far (every hook and result), from its own /metrics."""
        return metric_value(self.op.metrics(), "smg_operator_hook_calls_total")

    def stop(self) -> None:
        self.op.stop()
        self.proxy.close()


def _ts(event: dict[str, Any]) -> float:
    return datetime.datetime.fromisoformat(event["requestReceivedTimestamp"]).timestamp()


def writes_by(cp: ControlPlane, user: str) -> list[tuple[float, str, str]]:
    """(time received, verb, resource/name) of every write ``user`` made, from the audit log."""
    out = []
    for ev in cp.audit_events():
        if ev.get("user", {}).get("username") == user and ev.get("verb") in WRITES:
            ref = ev.get("objectRef", {})
            out.append((_ts(ev), ev["verb"], f"{ref.get('resource')}/{ref.get('name', '')}"))
    return sorted(out)


def test_a_leader_cut_off_from_the_api_server_stops_writing_before_the_standby_takes_over(
    audited: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cp = audited
    e = routed_env(cp, tmp_path_factory.mktemp("split"), "split", replicas=1)
    args = [
        *e.operator_args(1),
        *leading_own_router(e.ns),
        *("--leader-election-lease-duration", str(LEASE), "--leader-election-renew-deadline", str(DEADLINE)),
        *("--leader-election-retry-period", str(RETRY)),
        *("--kube-request-timeout", str(CALL_TIMEOUT), "--router-timeout", str(CALL_TIMEOUT)),
    ]
    a, b = Replica(e, "op-a", args), Replica(e, "op-b", args)
    lease_path = f"/apis/coordination.k8s.io/v1/namespaces/{e.ns}/leases/smg-operator"

    def holder() -> str:
        return str((cp.api("GET", lease_path).get("spec") or {}).get("holderIdentity") or "")

    try:
        a.op.start()  # ready: it leads
        b.op.proc.start()
        assert holder().endswith(f"-{a.pid}")
        wait_until(lambda: "stands by" in b.op.proc.log(), timeout=SETTLE, what="op-b to find the lease held")

        # the leader works: a pool registered, so each reconcile pass (every second) calls the router
        sim = e.add_worker_pod("w-0", {"app": "w"})
        cp.apply_yaml(pool("pool", {"app": "w"}, port=e.worker_port, router_port=e.router_port), e.ns)
        wait_until(lambda: sim.url in e.urls("router-0"), timeout=SETTLE, what="op-a to register the pool")
        renewals: set[str] = set()

        def standing_by_over_two_renewals() -> bool:
            assert b.op.probe("/healthz") == 200, "a standby is live"  # a liveness probe leaves it alone
            assert b.op.probe("/readyz") == 503, "a standby is not ready"
            renewals.add(str(cp.api("GET", lease_path)["spec"]["renewTime"]))
            return len(renewals) >= 3

        wait_until(standing_by_over_two_renewals, timeout=SETTLE, what="two renewals by op-a while op-b stands by")
        assert writes_by(cp, a.user), "the audit log shows op-a's writes before the cut (else the check is empty)"

        # -- the cut: op-a keeps running, its API calls hang ------------------------------------------------
        calls_before = a.hook_calls()
        t_cut = time.time()
        a.proxy.cut()
        samples: list[tuple[float, float]] = []  # (time, op-a's router calls so far), until op-a exits
        took_over: float | None = None
        while a.op.proc.alive() or took_over is None:
            now = time.time()
            assert now - t_cut < SETTLE, (
                f"{SETTLE}s after the cut: op-a alive={a.op.proc.alive()}, op-b took over={took_over is not None};"
                f" op-a's router calls {calls_before:g} at the cut, {samples[-1][1] if samples else '-'} now"
            )
            if a.op.proc.alive():
                with contextlib.suppress(OSError, AssertionError):  # it may be exiting right now
                    samples.append((now, a.hook_calls()))
            if took_over is None:
                if holder().endswith(f"-{b.pid}"):
                    took_over = time.time()
                    a.proxy.restore()  # op-a's API access is back: a process still acting would write now
                else:
                    assert b.op.probe("/healthz") == 200 and b.op.probe("/readyz") == 503
            time.sleep(0.1)
        assert took_over is not None

        # the standby took the lease once the record had stood still for a lease duration from when op-b last
        # saw it change: at most a retry period after op-a's last renewal (which came before the cut), plus
        # one retry period until op-b's next try
        # a lease duration after the standby last saw the record change, which it sees up to a retry period after
        # the leader's last renewal (before the cut); it tries right at expiry (Elector._next_try_in)
        assert took_over - t_cut <= LEASE + RETRY + TAKEOVER_SLACK, took_over - t_cut

        # no router call by op-a after its deadline: its call count stood still from then on until it exited
        late = [n for t, n in samples if t > t_cut + DEADLINE + MARGIN]
        assert samples and samples[-1][0] > t_cut + 1, "op-a's /metrics was sampled during the cut"
        assert len(set(late)) <= 1, f"op-a kept calling the router after its deadline: {late}"
        assert max(n for _, n in samples) > calls_before, "op-a did call the router during the cut, before its deadline"

        # the audit log: nothing written by op-a after its deadline, even with its access back; op-b's first write
        # came after op-a's last
        a_writes, b_writes = writes_by(cp, a.user), writes_by(cp, b.user)
        late_writes = [w for w in a_writes if w[0] > t_cut + DEADLINE + MARGIN]
        assert late_writes == [], f"op-a wrote after its renew deadline: {late_writes}"
        assert b_writes, "op-b wrote as the new leader"
        assert b_writes[0][0] > a_writes[-1][0], (a_writes[-3:], b_writes[:3])

        # the old leader exited non-zero, soon after its renew deadline
        rc = a.op.proc.popen.wait(timeout=SETTLE) if a.op.proc.popen else None
        assert rc == 1, (rc, a.op.proc.log()[-3000:])
        log = a.op.proc.log()
        assert "lost the lease" in log and ("exiting with status 1" in log or "exiting now" in log), log[-3000:]

        # the new leader works: a router restarted empty is filled again, by op-b
        wait_until(lambda: b.op.probe("/readyz") == 200, timeout=SETTLE, what="op-b ready as the leader")
        e.routers["router-0"].stop()
        e.start_router("router-0")
        wait_until(lambda: sim.url in e.urls("router-0"), timeout=SETTLE, what="op-b to re-register the pool")
        assert [w for w in writes_by(cp, a.user) if w[0] > t_cut + DEADLINE + MARGIN] == []
        b_writes = writes_by(cp, b.user)

        print(
            f"cut at 0; op-a's last write at {a_writes[-1][0] - t_cut:+.2f}s ({a_writes[-1][1]} {a_writes[-1][2]}),"
            f" op-b took the lease at {took_over - t_cut:+.2f}s, first write by op-b at {b_writes[0][0] - t_cut:+.2f}s"
            f" ({b_writes[0][1]} {b_writes[0][2]}); op-a's router calls: {calls_before:g} at the cut,"
            f" {samples[-1][1]:g} at its last sample ({samples[-1][0] - t_cut:+.2f}s)"
        )
    finally:
        a.stop()
        b.stop()
        for proc in [*e.routers.values(), *e.sims.values()]:
            proc.stop()
