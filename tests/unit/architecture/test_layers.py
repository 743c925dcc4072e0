"""The dependency rules of the layout (STYLE.md), checked on the source: layers only point downward."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _imports(package_dir: Path) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in package_dir.rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[str(path.relative_to(ROOT))] = names
    return found


def _offenders(package_dir: Path, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{path} imports {name}" for path, names in _imports(package_dir).items() for name in sorted(names)
            if any(name == f or name.startswith(f + ".") for f in forbidden)]


@pytest.mark.parametrize(("package", "forbidden"), [
    ("router/smg_router/tree", ("asyncio", "aiohttp", "prometheus_client", "smg_router", "kopf", "kubernetes")),
    ("router/smg_router/policies", ("aiohttp", "kopf", "kubernetes", "prometheus_client", "smg_router.proxy",
                                    "smg_router.handlers", "smg_router.admin", "smg_router.app")),
    ("router/smg_router", ("kopf", "kubernetes", "smg_sim", "smg_operator")),
    ("sim/smg_sim", ("smg_router", "smg_operator")),
])
def test_layers_point_downward(package: str, forbidden: tuple[str, ...]) -> None:
    assert _offenders(ROOT / package, forbidden) == []


def test_only_metrics_imports_prometheus_client() -> None:
    users = [p for p, names in _imports(ROOT / "router/smg_router").items()
             if any(n.startswith("prometheus_client") for n in names)]
    assert users == ["router/smg_router/metrics.py"]


def test_no_top_level_package_shadows_the_standard_library() -> None:
    for name in ("operator", "router", "sim", "smg"):
        assert not (ROOT / name / "__init__.py").exists(), name
