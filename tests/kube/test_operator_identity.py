"""smg-operator runs under a uid without a passwd entry (issue 14): kopf would name itself after
``getpass.getuser()``, which raises ``KeyError: 'getpwuid(): uid not found'`` there; the operator hands kopf an
explicit identity instead, so it starts, leads and reconciles."""

from __future__ import annotations

import uuid

import pytest
from support.kube import ControlPlane
from support.operator_env import KEY, new_env, pool
from support.operator_proc import SETTLE, OperatorProcess
from support.procs import wait_until


def test_the_operator_leads_and_reconciles_where_its_uid_has_no_passwd_entry(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cp = control_plane
    e = new_env(cp, tmp_path_factory.mktemp("uid"), f"uid-{uuid.uuid4().hex[:6]}", replicas=1)
    e.add_service("smg-router", "smg-router")
    e.add_router_pod("router-0")
    op = OperatorProcess(
        e.logs,
        cp.kubeconfig,
        admin_key=KEY,
        no_passwd_entry=True,
        args=[
            *("--namespace", e.ns, "--reconcile-interval", "1", "--router-port", str(e.router_port)),
            *("--router-service", "smg-router", "--router-namespace", e.ns),
            *("--leader-election", "--leader-election-namespace", e.ns),
        ],
    )
    try:
        try:
            op.start()  # ready: it holds the lease and kopf runs
        except AssertionError:
            raise AssertionError(op.proc.log()[-3000:]) from None
        assert "getpwuid" not in op.proc.log()
        sim = e.add_worker_pod("w-0", {"app": "w"})
        cp.apply_yaml(pool("pool", {"app": "w"}, port=e.worker_port, router_port=e.router_port), e.ns)
        wait_until(lambda: sim.url in e.urls("router-0"), timeout=SETTLE, what="the pool registered")
    finally:
        op.stop()
        for proc in [*e.routers.values(), *e.sims.values()]:
            proc.stop()
