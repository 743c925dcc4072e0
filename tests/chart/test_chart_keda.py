"""KEDA ScaledObjects of the chart (``keda``): off by default; on, each validates against KEDA's own CRD schema
(``keda/keda.sh_scaledobjects.yaml``, vendored from kedacore/keda) and its PromQL names only the router's metrics.

The schema check is stricter than the API server's pruning, as for the SMGWorkers: every object node that lists
``properties`` is closed, so a misspelt field fails here instead of being dropped.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import pytest
import yaml
from smg_router.metrics import Metrics
from smg_router.workers.demand import ModelDemand
from support.helm_chart import example_values, render
from support.prometheus import exported_names, metric_names

CRD = yaml.safe_load((Path(__file__).parent / "keda" / "keda.sh_scaledobjects.yaml").read_text())
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
HOLD_QUEUE = "smg_model_requests_waiting"
"""The gauge of the requests held while a model has no routable worker (``--hold-when-empty``), exported with that
flag: the only name of the triggers this check takes on trust beside what the router below exposes."""


def closed(schema: Any) -> Any:
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    preserved = out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and "additionalProperties" not in out and not preserved:
        out["additionalProperties"] = False
    return out


VERSION = next(v for v in CRD["spec"]["versions"] if v["name"] == "v1alpha1")
VALIDATOR = jsonschema.Draft7Validator(closed(VERSION["schema"]["openAPIV3Schema"]))


def errors_of(obj: dict[str, Any]) -> list[str]:
    assert obj["apiVersion"] == f"{CRD['spec']['group']}/v1alpha1" and obj["kind"] == CRD["spec"]["names"]["kind"]
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in VALIDATOR.iter_errors(obj)]


def router_names() -> set[str]:
    """Every name a router's /metrics can hold: its families and each scrape-time source's."""
    m = Metrics()
    m.add_tree_size_source(lambda: [("m", "regular", "http://w", 1)])
    m.add_tree_bytes_source(lambda: [("m", "regular", 1)])
    m.add_peers_in_sync_source(lambda: 1.0)
    m.add_kv_index_sources(lambda: [("m", 1)], lambda: [("m", "http://w", 1)])
    m.add_demand_source(lambda: [("m", "regular", ModelDemand(inflight=1, backlog=1, capacity=2, routable=1))])
    return exported_names(m.exposition().decode())


def keda(**target: Any) -> dict[str, Any]:
    """Values with one target: the base one with ``target``'s fields (None: that field left out)."""
    fields = {"name": "llama", "deployment": "vllm-llama", "model": MODEL} | target
    fields = {k: v for k, v in fields.items() if v is not None}
    return {"keda": {"enabled": True, "serverAddress": "http://prometheus.monitoring:9090", "targets": [fields]}}


def test_no_scaled_object_by_default() -> None:
    assert not render({}).of_kind("ScaledObject")
    assert not render({"keda": {"targets": [{"name": "a", "deployment": "d", "model": "m"}]}}).of_kind("ScaledObject")


def test_the_example_scales_its_engine_deployment_from_zero_on_waiting_requests() -> None:
    rendered = render(example_values("autoscaling"))
    (router,) = [d for d in rendered.of_kind("Deployment") if d["metadata"]["name"] == "smg-router"]
    env = {e["name"]: e.get("value") for e in router["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["SMG_HOLD_WHEN_EMPTY"] == "300"  # the routers hold what the engine at 0 replicas cannot serve yet
    (so,) = rendered.of_kind("ScaledObject")
    assert errors_of(so) == []
    assert so["metadata"]["name"] == "smg-llama-8b" and so["metadata"]["namespace"] == "smg"
    spec = so["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "vllm-llama"}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"], spec["cooldownPeriod"]) == (0, 8, 600)
    triggers = {t["name"]: t for t in spec["triggers"]}
    assert set(triggers) == {"saturation", "waiting"}
    series = f'namespace="smg", job="smg-router", model="{MODEL}", role="regular"'
    assert triggers["saturation"]["type"] == "prometheus" and triggers["saturation"]["metricType"] == "Value"
    assert triggers["saturation"]["metadata"]["query"] == f"max(smg_model_saturation{{{series}}})"
    assert triggers["saturation"]["metadata"]["threshold"] == "0.8"
    assert triggers["waiting"]["metricType"] == "AverageValue"
    assert triggers["waiting"]["metadata"]["query"] == f"sum({HOLD_QUEUE}{{{series}}})"
    assert (triggers["waiting"]["metadata"]["threshold"], triggers["waiting"]["metadata"]["activationThreshold"]) == (
        "4",
        "0",
    )


@pytest.mark.parametrize(
    "target",
    [
        {},
        {"role": "decode", "minReplicaCount": 1, "maxReplicaCount": 3, "saturation": 0.65, "pollingInterval": 5},
        {"deployment": None, "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "sglang"}},
        {"cooldownPeriod": 0, "waiting": 1, "activationWaiting": 2},
    ],
)
def test_every_rendered_scaled_object_validates_against_kedas_crd(target: dict[str, Any]) -> None:
    (so,) = render(keda(**target)).of_kind("ScaledObject")
    assert errors_of(so) == []
    if "scaleTargetRef" in target:
        assert so["spec"]["scaleTargetRef"] == target["scaleTargetRef"]
    if "cooldownPeriod" in target:
        assert so["spec"]["cooldownPeriod"] == 0  # 0 kept, not replaced by the default
    for trigger in so["spec"]["triggers"]:
        for key in ("threshold", "activationThreshold"):
            float(trigger["metadata"][key])  # KEDA parses them as numbers


def test_the_schema_check_catches_a_misspelt_field() -> None:
    (so,) = render(keda()).of_kind("ScaledObject")
    bad = copy.deepcopy(so)
    bad["spec"]["minReplicas"] = 0
    assert errors_of(bad)
    bad = copy.deepcopy(so)
    del bad["spec"]["triggers"][0]["type"]
    assert errors_of(bad)


def test_the_triggers_name_only_metrics_the_router_defines() -> None:
    known = router_names() | {HOLD_QUEUE}
    for values in (example_values("autoscaling"), keda(role="prefill")):
        for so in render(values).of_kind("ScaledObject"):
            for trigger in so["spec"]["triggers"]:
                names = metric_names(trigger["metadata"]["query"])
                assert names and names <= known, (trigger["name"], names - known)
    assert "smg_model_saturation" in router_names()


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"keda": {"enabled": True, "targets": []}}, "keda.serverAddress"),
        (keda(deployment=None), "set deployment or scaleTargetRef"),
        (keda(scaleTargetRef={"name": "x", "kind": "Deployment"}), "set deployment or scaleTargetRef"),
        (keda(minReplicaCount=5, maxReplicaCount=2), "minReplicaCount 5 is above maxReplicaCount 2"),
    ],
)
def test_a_target_that_cannot_scale_anything_fails_the_render(values: dict[str, Any], message: str) -> None:
    with pytest.raises(Exception, match=message):
        render(values)


@pytest.mark.parametrize(
    "target",
    [{"role": "worker"}, {"saturation": 0}, {"model": ""}, {"name": "Bad_Name"}, {"minReplicaCount": -1}],
)
def test_bad_target_values_fail_the_schema(target: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        render(keda(**target))
