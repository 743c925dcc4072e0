"""The dependency rules of the layout (docs/architecture.md), checked on the source: layers only point downward."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _imports(package_dir: Path) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    paths = [package_dir] if package_dir.is_file() else sorted(package_dir.rglob("*.py"))
    assert paths, f"nothing to check at {package_dir}"
    for path in paths:
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[str(path.relative_to(ROOT))] = names
    return found


def _offenders(package_dir: Path, forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{path} imports {name}"
        for path, names in _imports(package_dir).items()
        for name in sorted(names)
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    ]


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("router/smg_router/tree", ("asyncio", "aiohttp", "prometheus_client", "smg_router", "kopf", "kubernetes")),
        (
            "router/smg_router/policies",
            (
                "aiohttp",
                "kopf",
                "kubernetes",
                "prometheus_client",
                "smg_router.proxy",
                "smg_router.handlers",
                "smg_router.admin",
                "smg_router.app",
            ),
        ),
        ("router/smg_router", ("kopf", "kubernetes", "smg_sim", "smg_operator")),
        ("sim/smg_sim", ("smg_router", "smg_operator")),
        ("operator/smg_operator", ("smg_router", "smg_sim")),
    ],
)
def test_layers_point_downward(package: str, forbidden: tuple[str, ...]) -> None:
    assert _offenders(ROOT / package, forbidden) == []


def test_only_metrics_imports_prometheus_client() -> None:
    users = [
        p
        for p, names in _imports(ROOT / "router/smg_router").items()
        if any(n.startswith("prometheus_client") for n in names)
    ]
    assert users == ["router/smg_router/metrics.py"]


@pytest.mark.parametrize(
    ("library", "allowed"),
    [
        ("kubernetes", {"operator/smg_operator/k8s.py"}),
        (
            "kopf",
            {
                "operator/smg_operator/handlers.py",
                "operator/smg_operator/pool_handlers.py",
                "operator/smg_operator/__main__.py",
            },
        ),
        ("prometheus_client", {"operator/smg_operator/metrics.py"}),
    ],
)
def test_operator_talks_to_each_library_in_one_place(library: str, allowed: set[str]) -> None:
    users = {
        p
        for p, names in _imports(ROOT / "operator/smg_operator").items()
        if any(n == library or n.startswith(library + ".") for n in names)
    }
    assert users <= allowed, users


@pytest.mark.parametrize(
    "package",
    [
        "operator/smg_operator/desired.py",
        "operator/smg_operator/status.py",
        "operator/smg_operator/inference_pools.py",
    ],
)
def test_operator_logic_is_pure(package: str) -> None:
    names = set().union(*_imports(ROOT / package).values())
    assert not {n for n in names if n.split(".")[0] in {"kopf", "kubernetes", "aiohttp", "asyncio"}}


def test_no_top_level_package_shadows_the_standard_library() -> None:
    for name in ("operator", "router", "sim", "smg"):
        assert not (ROOT / name / "__init__.py").exists(), name
