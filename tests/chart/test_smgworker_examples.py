"""SMGWorkers (the repo's examples/ and those the chart renders) validate against the CRD's openAPIV3Schema.

The check is stricter than the API server's pruning: every object node of the schema that lists
``properties`` is closed (``additionalProperties: false`` added where the CRD leaves it out), so a misspelt
field fails here instead of being silently dropped by the server.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from support.helm_chart import CHART, REPO, example_values, render

CRD = yaml.safe_load((REPO / "crds" / "smgworker.yaml").read_text())
REPO_EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def closed(schema: Any) -> Any:
    """A copy of a structural schema with every node that has ``properties`` closed to unknown fields."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def crd_version(name: str = "v1alpha1") -> dict[str, Any]:
    return next(v for v in CRD["spec"]["versions"] if v["name"] == name)


SCHEMA = closed(crd_version()["schema"]["openAPIV3Schema"])
VALIDATOR = jsonschema.Draft7Validator(SCHEMA)


def errors_of(obj: dict[str, Any]) -> list[str]:
    assert obj["apiVersion"] == f"{CRD['spec']['group']}/v1alpha1" and obj["kind"] == CRD["spec"]["names"]["kind"]
    assert obj["metadata"]["name"], obj
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in VALIDATOR.iter_errors(obj)]


def rendered_smgworkers() -> dict[str, dict[str, Any]]:
    configs = {
        "sim": example_values("sim"),
        "sim-pd": {"router": {"pd": {"enabled": True}}, "sim": {"enabled": True, "pd": {"enabled": True}}},
        "regular": example_values("regular"),
        "pd": example_values("pd"),
    }
    out = {}
    for config, values in configs.items():
        for obj in render(values).of_kind("SMGWorker"):
            out[f"{config}:{obj['metadata']['name']}"] = obj
    return out


RENDERED = rendered_smgworkers()


def test_there_is_something_to_check() -> None:
    assert len(REPO_EXAMPLES) >= 3
    assert {
        "sim:smg-sim-regular",
        "sim-pd:smg-sim-prefill",
        "sim-pd:smg-sim-decode",
        "regular:llama-8b",
        "pd:deepseek-prefill",
        "pd:deepseek-decode",
    } <= set(RENDERED)


@pytest.mark.parametrize("path", REPO_EXAMPLES, ids=lambda p: p.name)
def test_repo_examples_validate(path: Path) -> None:
    for obj in yaml.safe_load_all(path.read_text()):
        if obj:
            assert not errors_of(obj), errors_of(obj)


@pytest.mark.parametrize("key", sorted(RENDERED))
def test_rendered_smgworkers_validate(key: str) -> None:
    assert not errors_of(RENDERED[key]), errors_of(RENDERED[key])


@pytest.mark.parametrize(
    "change, where",
    [
        (lambda s: s.update(replicas=3), "replicas"),
        (lambda s: s["selector"].update(matchLabel={"a": "b"}), "matchLabel"),
        (lambda s: s["router"].update(svc="x"), "svc"),
        (lambda s: s.update(role="both"), "role"),
        (lambda s: s.update(port=70000), "port"),
        (lambda s: s.pop("model"), "model"),
        (lambda s: s.pop("selector"), "not valid under any of the given schemas"),
        (lambda s: s.update(drainTimeoutSeconds=-1), "drainTimeoutSeconds"),
        (lambda s: s.update(kvCapacityTokens=0), "kvCapacityTokens"),
        (lambda s: s.update(kvCapacityTokens="4096"), "kvCapacityTokens"),
    ],
)
def test_bad_smgworkers_are_rejected(change, where: str) -> None:
    obj = copy.deepcopy(RENDERED["sim:smg-sim-regular"])
    change(obj["spec"])
    problems = errors_of(obj)
    assert problems and any(where in p for p in problems), problems


def test_kv_capacity_tokens_is_an_optional_positive_integer() -> None:
    obj = copy.deepcopy(RENDERED["sim:smg-sim-regular"])
    assert "kvCapacityTokens" not in obj["spec"] and not errors_of(obj)
    obj["spec"]["kvCapacityTokens"] = 1
    assert not errors_of(obj), errors_of(obj)


def test_chart_crd_is_the_same_crd() -> None:
    with open(CHART / "crds" / "smgworker.yaml") as f:
        assert yaml.safe_load(f) == CRD


def test_crd_schema_is_structural() -> None:
    """What kube-apiserver refuses in a CRD schema (apiextensions validation), which helm lint never checks:
    ``additionalProperties`` beside ``properties`` ("mutual exclusive") and ``uniqueItems: true``."""
    problems: list[str] = []

    def walk(node: Any, path: str) -> None:
        if not isinstance(node, dict):
            return
        if "properties" in node and "additionalProperties" in node:
            problems.append(f"{path}: additionalProperties and properties are mutually exclusive")
        if node.get("uniqueItems"):
            problems.append(f"{path}: uniqueItems cannot be set to true")
        for key, child in (node.get("properties") or {}).items():
            walk(child, f"{path}.properties[{key}]")
        for key in ("items", "additionalProperties"):
            walk(node.get(key), f"{path}.{key}")
        for key in ("anyOf", "allOf", "oneOf"):
            for i, child in enumerate(node.get(key) or []):
                walk(child, f"{path}.{key}[{i}]")

    for version in CRD["spec"]["versions"]:
        walk(version["schema"]["openAPIV3Schema"], f"{version['name']}.openAPIV3Schema")
    assert not problems, "\n".join(problems)
