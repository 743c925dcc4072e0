"""The operator's own /metrics: hook calls, reconciles, and workers registered per SMGWorker."""

from __future__ import annotations

from kmock_harness import SETTLE, Fleet, Kube, Operator, pool_spec, wait_for
from support.procs import metric_value


def test_the_operator_metrics_count_hook_calls_reconciles_and_registered_workers(
    kube: Kube, fleet: Fleet, operator: Operator
) -> None:
    fleet.router_service()
    fleet.add_routers("router-0", "router-1")
    fleet.add_workers("llama-0", "llama-1", labels={"pool": "llama"})
    kube.create_smgworker("llama", pool_spec("llama", fleet.router_port, fleet.worker_port))
    gauge = {"smgworker": f"{kube.ns}/llama"}

    wait_for(
        lambda: metric_value(operator.metrics(), "smg_operator_registered_workers", **gauge) == 2,
        timeout=SETTLE,
        what="smg_operator_registered_workers 2",
    )
    text = operator.metrics()
    assert "# TYPE smg_operator_hook_calls_total counter" in text
    assert "# TYPE smg_operator_reconcile_total counter" in text
    assert "# TYPE smg_operator_registered_workers gauge" in text
    assert metric_value(text, "smg_operator_hook_calls_total", hook="register", result="ok") == 4  # 2 x 2 replicas
    assert metric_value(text, "smg_operator_hook_calls_total", hook="list", result="ok") >= 2
    assert metric_value(text, "smg_operator_hook_calls_total", result="error") == 0
    assert metric_value(text, "smg_operator_reconcile_total", result="ok") >= 1
    assert metric_value(text, "smg_operator_reconcile_total", result="error") == 0

    before = metric_value(text, "smg_operator_reconcile_total")
    wait_for(
        lambda: metric_value(operator.metrics(), "smg_operator_reconcile_total") >= before + 2,
        timeout=SETTLE,
        what="the timer reconciling again",
    )

    kube.terminate_pod("llama-1")
    wait_for(
        lambda: metric_value(operator.metrics(), "smg_operator_registered_workers", **gauge) == 1,
        timeout=SETTLE,
        what="smg_operator_registered_workers 1",
    )
    # removals run in the background (a drain never blocks the pass), so the gauge may drop before they answer
    removals = {"hook": "remove", "result": "ok"}
    wait_for(
        lambda: metric_value(operator.metrics(), "smg_operator_hook_calls_total", **removals) >= 2,
        timeout=SETTLE,
        what="one removal per router replica",
    )
    assert metric_value(operator.metrics(), "smg_operator_hook_calls_total", **removals) == 2

    kube.call("DELETE", kube.smgw_path("llama"))
    wait_for(lambda: kube.smgworker("llama") is None, timeout=SETTLE, what="the SMGWorker gone")
    wait_for(
        lambda: f'smgworker="{kube.ns}/llama"' not in operator.metrics(),
        timeout=SETTLE,
        what="the gauge of the deleted SMGWorker dropped",
    )
