"""``helm lint --strict`` of the chart (Helm v4 SDK from helm-python-sdk) with its defaults, every example
values file and the switches that change which objects render, for the oldest supported (1.20), an old and a
recent Kubernetes."""

from __future__ import annotations

import pytest
from support.helm_chart import CHART, EXAMPLES, example_values, lint

VARIANTS = {
    "defaults": {},
    **{path.stem: example_values(path.stem) for path in EXAMPLES},
    "sim-pd": {"router": {"pd": {"enabled": True}}, "sim": {"enabled": True, "pd": {"enabled": True}}},
    "cluster-wide-ha": {"operator": {"clusterWide": True, "replicas": 2}},
    "network-policy": {
        "networkPolicy": {"enabled": True, "adminNamespaces": ["platform"]},
        "operator": {"replicas": 2},
    },
    "shared-port": {"router": {"adminPort": 0}, "networkPolicy": {"enabled": False}},
    "everything": {**example_values("monitoring"), "sim": {"enabled": True}, "operator": {"replicas": 3}},
}


def test_examples_exist() -> None:
    assert {p.stem for p in EXAMPLES} >= {"regular", "pd", "monitoring", "sim"}


@pytest.mark.parametrize("kube_version", ["v1.20.2", "v1.25.0", "v1.30.0"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_lint_strict(variant: str, kube_version: str) -> None:
    problems = lint(VARIANTS[variant], kube_version=kube_version)
    assert not problems, f"helm lint --strict {CHART} ({variant}, {kube_version}): {problems}"


def test_lint_reports_bad_values() -> None:
    """The linter is not a rubber stamp: a value the schema forbids is an error."""
    problems = lint({"router": {"replicas": -1}})
    assert any("/router/replicas" in p["error"] for p in problems), problems
