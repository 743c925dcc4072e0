"""Render the smg Helm chart offline with the Helm v4 SDK compiled into PyPI ``helm-python-sdk`` (no helm binary).

``render()`` is ``helm template --include-crds``: the CRDs of ``crds/`` (which Helm installs first and never
templates) followed by every rendered template, parsed into objects.  Values are validated against
``values.schema.json`` by the SDK itself, so a bad value raises ``HelmValuesError``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "smg"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
RELEASE = "smg"
NAMESPACE = "smg"


def example_values(name: str) -> dict[str, Any]:
    return yaml.safe_load((CHART / "examples" / f"{name}.yaml").read_text()) or {}


@dataclass
class Rendered:
    """The outcome of one render: template sources by path, and every object (CRDs first)."""

    manifests: dict[str, str]
    crds: list[dict[str, Any]]
    objects: list[dict[str, Any]]

    @property
    def all(self) -> list[dict[str, Any]]:
        return self.crds + self.objects

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.all if o["kind"] == kind]

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        found = [
            o
            for o in self.of_kind(kind)
            if o["metadata"]["name"] == name and (namespace is None or o["metadata"].get("namespace") == namespace)
        ]
        assert len(found) == 1, f"{kind}/{name}: found {len(found)} among {self.names()}"
        return found[0]

    def names(self) -> list[str]:
        return sorted(f"{o['kind']}/{o['metadata']['name']}" for o in self.all)

    @property
    def notes(self) -> str:
        return next((text for path, text in self.manifests.items() if path.endswith("NOTES.txt")), "")


def _documents(texts: Iterable[str]) -> list[dict[str, Any]]:
    objects: list[dict[str, Any]] = []
    for text in texts:
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def render(values: dict[str, Any] | None = None, *, name: str = RELEASE, namespace: str = NAMESPACE) -> Rendered:
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values or {}, name=name, namespace=namespace, is_install=True)
        crd_texts = [c["data"] for c in chart.crds]
    yaml_manifests = {path: text for path, text in manifests.items() if not path.endswith(".txt")}
    return Rendered(manifests=manifests, crds=_documents(crd_texts), objects=_documents(yaml_manifests.values()))


def lint(values: dict[str, Any] | None = None, *, kube_version: str = "v1.30.0") -> list[dict[str, Any]]:
    """``helm lint --strict``: the findings of severity warning (2) or error (3)."""
    report = helm.lint(CHART, values or {}, strict=True, namespace=NAMESPACE, kube_version=kube_version)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    problems += [
        {"severity": 3, "path": "", "error": e} for e in report["errors"] if not any(e == m["error"] for m in problems)
    ]
    return problems
