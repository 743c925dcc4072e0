"""smg-operator runs under a uid without a passwd entry (a container's arbitrary ``runAsUser``): kopf would name
itself after ``getpass.getuser()``, which raises ``KeyError: 'getpwuid(): uid not found'`` there; the operator hands
kopf an explicit identity instead, so it starts, leads and reconciles."""

from __future__ import annotations

import pytest
from support.kube import ControlPlane
from support.operator_env import leading_own_router, pool, routed_env
from support.operator_proc import SETTLE
from support.procs import wait_until


def test_the_operator_leads_and_reconciles_where_its_uid_has_no_passwd_entry(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cp = control_plane
    e = routed_env(cp, tmp_path_factory.mktemp("uid"), "uid", replicas=1)
    op = e.new_operator(*leading_own_router(e.ns), interval=1, no_passwd_entry=True)
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
