"""The operator's scale scenario, small, on the real API server: 5 SMGWorkers x 4 pods, 2 real router replicas, pods
churning for 20 s.  Every pod made Ready ends up registered on both replicas and every deleted pod leaves both
(``bench/operator_scale.py`` runs the same scenario at 50 x 20 and prints figures)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.kube import ControlPlane
from support.operator_env import KEY, Env, new_env
from support.operator_proc import SETTLE, OperatorProcess
from support.procs import wait_until
from support.scale_figures import latencies, router_log_times
from support.scale_fleet import ScaleFleet, Scenario

SCENARIO = Scenario(
    smgworkers=5, pods_per_smgworker=4, churn_per_minute=1.2, ready_delay=0.5, grace=1.0, min_victim_age=2.0
)
"""20 pods, one replaced every 2.5 s: 8 replacements in 20 s."""
CHURN_SECONDS = 20.0


@pytest.fixture
def env(control_plane: ControlPlane, tmp_path: Path) -> Iterator[Env]:
    assert control_plane.kubeconfig is not None
    e = new_env(control_plane, tmp_path, f"scale-{uuid.uuid4().hex[:6]}")
    e.add_service("smg-router", "smg-router")
    e.add_router_pod("router-0")
    e.add_router_pod("router-1")
    args = ["--namespace", e.ns, "--router-service", "smg-router", "--router-namespace", e.ns]
    e.operator = OperatorProcess(
        tmp_path, control_plane.kubeconfig, admin_key=KEY, args=[*args, "--router-port", str(e.router_port)]
    ).start()
    yield e
    e.operator.stop()
    for router in e.routers.values():
        router.stop()


def test_churning_pods_are_registered_on_both_replicas_and_deleted_ones_leave_both(env: Env) -> None:
    fleet = ScaleFleet(env, SCENARIO)
    fleet.create_smgworkers()
    start = time.time()
    fleet.fill()
    wait_until(fleet.converged, timeout=SETTLE, what="both replicas to hold every Ready pod")
    fleet.churn(CHURN_SECONDS)
    # both replicas hold exactly the live Ready pods: every replacement is on both, every deleted pod on neither
    try:
        wait_until(fleet.converged, timeout=SETTLE, what="both replicas to hold exactly the live Ready pods")
    except AssertionError as err:
        want = fleet.live_ready_urls()
        seen = {pod: (sorted(want - urls), sorted(urls - want)) for pod, urls in fleet.router_urls().items()}
        raise AssertionError(f"{err}; per replica (missing, extra): {seen}") from None

    assert fleet.churned >= 6, fleet.churned
    # and on the way there, by the routers' own log: each pod made Ready was added by both replicas after its Ready,
    # and each deleted pod was removed by both after its deletion
    routers = {pod: router_log_times(r.log()) for pod, r in env.routers.items()}
    lat = latencies(fleet.pods.values(), routers, start=start, end=time.time())
    assert lat.not_registered == [] and lat.not_removed == [], (lat.not_registered, lat.not_removed)
    assert len(lat.ready_to_registered) == len(fleet.pods) == SCENARIO.pods + fleet.churned
    assert len(lat.deleted_to_gone) == fleet.churned
