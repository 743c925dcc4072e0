"""values.schema.json rejects bad values: the render itself fails (Helm validates values before templating)."""

from __future__ import annotations

import json

import helm_python as helm
import pytest
from support.helm_chart import CHART, render

BAD = {
    "negative router replicas": ({"router": {"replicas": -1}}, "/router/replicas"),
    "unknown policy": ({"router": {"policy": "fastest"}}, "/router/policy"),
    "replicas as a string": ({"router": {"replicas": "2"}}, "/router/replicas"),
    "fractional replicas": ({"router": {"replicas": 1.5}}, "/router/replicas"),
    "negative operator replicas": ({"operator": {"replicas": -2}}, "/operator/replicas"),
    "negative sim replicas": ({"sim": {"regular": {"replicas": -3}}}, "/sim/regular/replicas"),
    "threshold above 1": ({"router": {"cacheThreshold": 1.5}}, "/router/cacheThreshold"),
    "relative threshold below 1": ({"router": {"balanceRelThreshold": 0.5}}, "/router/balanceRelThreshold"),
    "zero load interval": ({"router": {"loadMonitorInterval": 0}}, "/router/loadMonitorInterval"),
    "bad pd policy": ({"router": {"pd": {"enabled": True, "decodePolicy": "lowest"}}}, "/router/pd/decodePolicy"),
    "port out of range": ({"router": {"port": 70000}}, "/router/port"),
    "bad log level": ({"router": {"logLevel": "verbose"}}, "/router/logLevel"),
    "bad pull policy": ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    "unknown top-level key": ({"routers": {"replicas": 2}}, "routers"),
    "unknown nested key": ({"router": {"replica": 2}}, "replica"),
    "boolean as string": ({"monitoring": {"serviceMonitor": {"enabled": "yes"}}}, "/monitoring/serviceMonitor/enabled"),
    "bad scrape interval": (
        {"monitoring": {"serviceMonitor": {"interval": "often"}}},
        "/monitoring/serviceMonitor/interval",
    ),
    "bad worker url": ({"router": {"workerUrls": ["10.0.0.5:8000"]}}, "/router/workerUrls/0"),
    "smgWorker without spec": ({"smgWorkers": [{"name": "x"}]}, "/smgWorkers/0"),
    "smgWorker bad role": (
        {"smgWorkers": [{"name": "x", "spec": {"role": "both", "model": "m"}}]},
        "/smgWorkers/0/spec/role",
    ),
    "resources as a string": ({"router": {"resources": "big"}}, "/router/resources"),
    "bad memory quantity": (
        {"router": {"resources": {"limits": {"memory": "lots"}}}},
        "/router/resources/limits/memory",
    ),
    "watch namespace not a DNS label": ({"operator": {"watchNamespaces": ["Team_A"]}}, "/operator/watchNamespaces/0"),
    "admin port out of range": ({"router": {"adminPort": 70000}}, "/router/adminPort"),
    "router service without namespace": (
        {"operator": {"allowedRouterServices": ["smg-router"]}},
        "/operator/allowedRouterServices/0",
    ),
    "endpoint rule with a comma": (
        {"operator": {"allowedEndpoints": ["10.0.0.0/8,192.168.0.0/16"]}},
        "/operator/allowedEndpoints/0",
    ),
    "network policy unknown key": ({"networkPolicy": {"enable": True}}, "enable"),
    "admin namespace not a DNS label": (
        {"networkPolicy": {"adminNamespaces": ["Platform"]}},
        "/networkPolicy/adminNamespaces/0",
    ),
    "admin peers not a list": ({"networkPolicy": {"adminFrom": {"podSelector": {}}}}, "/networkPolicy/adminFrom"),
    "tokenizer without a path": ({"router": {"tokenizers": [{"model": "m"}]}}, "/router/tokenizers/0"),
    "tokenizer at a relative path": (
        {"router": {"tokenizers": [{"model": "m", "path": "tok/m"}]}},
        "/router/tokenizers/0/path",
    ),
    "two models in one tokenizer entry": (
        {"router": {"tokenizers": [{"model": "a,b", "path": "/t"}]}},
        "/router/tokenizers/0/model",
    ),
    "tokenizer unknown key": ({"router": {"tokenizers": [{"model": "m", "path": "/t", "file": "x"}]}}, "file"),
    "volume mount without a path": (
        {"router": {"extraVolumeMounts": [{"name": "tokenizers"}]}},
        "/router/extraVolumeMounts/0",
    ),
    "volumes not a list": ({"router": {"extraVolumes": {"name": "tokenizers"}}}, "/router/extraVolumes"),
    "sim events port out of range": ({"sim": {"kvEvents": {"port": 0}}}, "/sim/kvEvents/port"),
    "sim events unknown key": ({"sim": {"kvEvents": {"topic": "kv"}}}, "topic"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_values_fail_the_render(case: str) -> None:
    values, where = BAD[case]
    with pytest.raises(helm.HelmValuesError) as err:
        render(values)
    assert where in str(err.value), str(err.value)


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin", "random", "power_of_two", "least_load"])
def test_every_router_policy_is_accepted(policy: str) -> None:
    env = render({"router": {"policy": policy}}).get("Deployment", "smg-router")
    assert {"name": "SMG_POLICY", "value": policy} in env["spec"]["template"]["spec"]["containers"][0]["env"]


def test_the_schema_matches_the_router_policies() -> None:
    from smg_router.settings import POLICY_NAMES

    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(schema["definitions"]["policy"]["enum"]) == set(POLICY_NAMES)


def test_zero_replicas_are_allowed() -> None:
    """Scaling to zero is a valid choice; only negative counts are rejected."""
    r = render({"router": {"replicas": 0}, "operator": {"replicas": 0}})
    assert r.get("Deployment", "smg-router")["spec"]["replicas"] == 0
