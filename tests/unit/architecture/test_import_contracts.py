"""The layer contracts of pyproject.toml ([tool.importlinter]) hold, and they would catch an upward import."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[3]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint_imports(pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if pythonpath is not None:  # a copy of the router shadows the installed one
        env["PYTHONPATH"] = f"{pythonpath}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_the_source_keeps_every_contract() -> None:
    result = _lint_imports()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_an_upward_import_breaks_the_layers(tmp_path: Path) -> None:
    copy = tmp_path / "router" / "smg_router"
    shutil.copytree(ROOT / "router" / "smg_router", copy, ignore=shutil.ignore_patterns("__pycache__"))
    tree = copy / "tree" / "radix_tree.py"
    tree.write_text(tree.read_text() + "\nfrom smg_router import proxy as _upward  # noqa: E402\n")
    result = _lint_imports(pythonpath=tmp_path / "router")
    assert result.returncode != 0
    assert "BROKEN" in result.stdout and "smg_router.tree.radix_tree -> smg_router.proxy" in result.stdout


def _cycle(graph: grimp.ImportGraph, package: str) -> list[str] | None:
    """A cycle among the package's modules (as a path), or None."""
    modules = sorted(m for m in graph.modules if m == package or m.startswith(package + "."))
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if not imported.startswith(package):
                continue
            if state.get(imported) == 1:
                return [*stack[stack.index(imported) :], imported]
            if imported not in state and (found := visit(imported)):
                return found
        stack.pop()
        state[module] = 2
        return None

    for module in modules:
        if module not in state and (found := visit(module)):
            return found
    return None


def test_no_import_cycle_among_the_router_operator_or_sim_modules() -> None:
    graph = grimp.build_graph("smg_router", "smg_operator", "smg_sim", cache_dir=None)
    for package in ("smg_router", "smg_operator", "smg_sim"):
        assert _cycle(graph, package) is None, f"import cycle: {' -> '.join(_cycle(graph, package) or [])}"


def test_the_cycle_finder_finds_a_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "cyclic_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyclic_pkg import b\n")
    (pkg / "b.py").write_text("from cyclic_pkg import a\n")
    sys.path.insert(0, str(tmp_path))
    try:
        graph = grimp.build_graph("cyclic_pkg", cache_dir=None)
    finally:
        sys.path.remove(str(tmp_path))
    assert _cycle(graph, "cyclic_pkg") in (
        ["cyclic_pkg.a", "cyclic_pkg.b", "cyclic_pkg.a"],
        ["cyclic_pkg.b", "cyclic_pkg.a", "cyclic_pkg.b"],
    )
