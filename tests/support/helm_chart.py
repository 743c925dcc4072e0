"""Render the smg Helm chart offline with the Helm v4 SDK compiled into PyPI ``helm-python-sdk`` (no helm binary).

``render()`` is ``helm template --include-crds``: the CRDs of ``crds/`` (which Helm installs first and never
templates) followed by every rendered template, parsed into objects.  Values are validated against
``values.schema.json`` by the SDK itself, so a bad value raises ``HelmValuesError``.

``kube_version`` and ``api_versions`` are ``helm template --kube-version / --api-versions``: what
``.Capabilities`` says.  Offline, Helm's API list is a fixed one that holds every built-in group version of
its client (policy/v1 included, whatever the Kubernetes version); against a cluster Helm reads both from the
API server's discovery, which ``server_capabilities`` does the same way.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml
from helm_python import _native

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


def render(
    values: dict[str, Any] | None = None,
    *,
    name: str = RELEASE,
    namespace: str = NAMESPACE,
    kube_version: str | None = None,
    api_versions: Iterable[str] | None = None,
) -> Rendered:
    with helm.Chart.load(CHART) as chart:
        if kube_version is None and api_versions is None:
            manifests = chart.render(values or {}, name=name, namespace=namespace, is_install=True)
        else:  # the SDK's render() does not pass these two on; its native call takes them
            opts: dict[str, Any] = {"name": name, "namespace": namespace, "is_install": True}
            if kube_version is not None:
                opts["kube_version"] = kube_version
            if api_versions is not None:
                opts["api_versions"] = list(api_versions)
            raw = _native.call_string("helm_render", chart._raw(), json.dumps(values or {}), json.dumps(opts))
            manifests = json.loads(raw)
        crd_texts = [c["data"] for c in chart.crds]
    yaml_manifests = {path: text for path, text in manifests.items() if not path.endswith(".txt")}
    return Rendered(manifests=manifests, crds=_documents(crd_texts), objects=_documents(yaml_manifests.values()))


def server_capabilities(get: Callable[[str], Any]) -> tuple[str, list[str]]:
    """(``kube_version``, ``api_versions``) as Helm reads them from an API server's discovery: its gitVersion, and
    every served group/version plus group/version/Kind (``GetVersionSet`` in Helm's action package).
    ``get(path)`` returns the parsed JSON of a GET."""
    version = get("/version")["gitVersion"]
    group_versions = ["v1"] + [v["groupVersion"] for g in get("/apis")["groups"] for v in g["versions"]]
    api_versions: list[str] = []
    for gv in group_versions:
        api_versions.append(gv)
        resources = get("/api/v1" if gv == "v1" else f"/apis/{gv}")["resources"]
        api_versions += sorted({f"{gv}/{r['kind']}" for r in resources})  # subresources' kinds too, as Helm
    return version, api_versions


def lint(values: dict[str, Any] | None = None, *, kube_version: str = "v1.30.0") -> list[dict[str, Any]]:
    """``helm lint --strict``: the findings of severity warning (2) or error (3)."""
    report = helm.lint(CHART, values or {}, strict=True, namespace=NAMESPACE, kube_version=kube_version)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    problems += [
        {"severity": 3, "path": "", "error": e} for e in report["errors"] if not any(e == m["error"] for m in problems)
    ]
    return problems
