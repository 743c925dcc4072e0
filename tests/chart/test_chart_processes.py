"""``router.processes``: the router's serving processes per pod (``SMG_PROCESSES``), from the value or the CPU limit."""

from __future__ import annotations

from typing import Any

import pytest
from support.helm_chart import render


def _processes(values: dict[str, Any]) -> str | None:
    router = render(values).get("Deployment", "smg-router")["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value") for e in router["env"]}.get("SMG_PROCESSES")


def test_no_cpu_limit_and_no_value_leave_it_to_the_router() -> None:
    assert _processes({}) is None  # the router reads its cgroup: no limit, one process


@pytest.mark.parametrize(
    ("cpu", "processes"), [("500m", "1"), ("1", "1"), ("1500m", "2"), ("2", "2"), (3, "3"), (2.5, "3"), ("100m", "1")]
)
def test_the_cpu_limit_rounded_up_sets_it(cpu: Any, processes: str) -> None:
    resources = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"cpu": cpu, "memory": "1Gi"}}
    assert _processes({"router": {"resources": resources}}) == processes


def test_the_value_wins_over_the_cpu_limit() -> None:
    resources = {"limits": {"cpu": "4", "memory": "1Gi"}}
    assert _processes({"router": {"processes": 2, "resources": resources}}) == "2"
    assert _processes({"router": {"processes": 1, "resources": resources}}) == "1"


@pytest.mark.parametrize("bad", [0, -1, "two", "2", 1.5])
def test_a_bad_value_fails_the_render(bad: Any) -> None:
    with pytest.raises(Exception, match="processes"):
        render({"router": {"processes": bad}})
