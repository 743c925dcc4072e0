"""The container image recipe (no Docker engine here, so ``docker build`` itself runs only in the kind e2e tier).

Checked statically, with BuildKit's parser: a multi-stage build from python:3.11-slim whose final stage
installs only the wheels, runs as uid 10001, has no ENTRYPOINT and runs ``smg-router``; the ``.dockerignore``
lets in exactly what the builder copies.  Checked for real: the builder's step (``pip wheel`` of the build
context) makes one wheel with the three commands the chart runs (smg-router, smg-operator, smg-sim).
"""

from __future__ import annotations

import fnmatch
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import dockerfile
import pytest
from support.helm_chart import REPO

DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"


def instructions() -> list[dockerfile.Command]:
    """The Dockerfile as BuildKit's own parser reads it (PyPI ``dockerfile`` wraps the official Go parser)."""
    return list(dockerfile.parse_file(str(DOCKERFILE)))


def stages() -> list[list[dockerfile.Command]]:
    result: list[list[dockerfile.Command]] = []
    for ins in instructions():
        if ins.cmd == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


def copied_sources() -> set[str]:
    """Sources of the COPY instructions that read the build context (not --from another stage)."""
    return {
        src
        for ins in instructions()
        if ins.cmd == "COPY" and not any(f.startswith("--from") for f in ins.flags)
        for src in ins.value[:-1]
    }


def test_multi_stage_from_python_slim() -> None:
    args = dict(v.split("=", 1) for ins in instructions() if ins.cmd == "ARG" for v in ins.value if "=" in v)
    froms = [ins.value for ins in instructions() if ins.cmd == "FROM"]
    assert len(froms) >= 2
    for value in froms:
        image = value[0]
        assert args.get(image.strip("${}"), image) == "python:3.11-slim", value
    assert [v.lower() for v in froms[0][1:]] == ["as", "builder"]


def test_final_stage_runs_smg_router_as_uid_10001() -> None:
    final = stages()[-1]
    by_cmd: dict[str, list[dockerfile.Command]] = {}
    for ins in final:
        by_cmd.setdefault(ins.cmd, []).append(ins)
    assert "ENTRYPOINT" not in by_cmd
    (cmd,) = by_cmd["CMD"]
    assert cmd.json and cmd.value == ("smg-router",)
    assert [e.value for e in by_cmd["EXPOSE"]] == [("30000",)]
    assert by_cmd["USER"][-1].value[0].split(":")[0] == "10001"
    runs = " ".join(v for ins in by_cmd["RUN"] for v in ins.value)
    assert "--uid 10001" in runs
    assert "pip install --no-index" in runs, "the final stage installs only the builder's wheels"
    mounts = [f for ins in by_cmd["RUN"] for f in ins.flags]
    assert mounts and all("from=builder" in f for f in mounts), mounts
    for tool in ("gcc", "build-essential", "apt-get install"):
        assert tool not in runs, tool
    assert "COPY" not in by_cmd and "ADD" not in by_cmd, "sources stay in the builder"


def test_dockerignore_admits_exactly_what_the_builder_copies() -> None:
    patterns = [p.strip() for p in DOCKERIGNORE.read_text().splitlines() if p.strip() and not p.startswith("#")]
    assert patterns[0] == "**", "everything is excluded first, then re-included"
    included = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    copied = copied_sources()
    assert copied == included
    for path in copied:
        assert (REPO / path).exists(), path
    excluded_again = [p for p in patterns if not p.startswith("!") and p != "**"]
    assert any(fnmatch.fnmatch("router/smg_router/__pycache__", p) for p in excluded_again)


@pytest.mark.timeout(300)
def test_builder_step_makes_a_wheel_with_the_three_commands(tmp_path: Path) -> None:
    """``pip wheel --no-deps .`` over a copy of the build context, as the builder stage does."""
    context = tmp_path / "context"
    context.mkdir()
    for src in copied_sources():
        source = REPO / src
        if source.is_dir():
            shutil.copytree(source, context / src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(source, context / src)
    dist = tmp_path / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(dist), str(context)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry_points = next(zf.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    scripts = {line.split("=")[0].strip() for line in entry_points.splitlines() if "=" in line}
    assert {"smg-router", "smg-operator", "smg-sim"} <= scripts, entry_points
    for package in ("smg_router", "smg_operator", "smg_sim"):
        assert f"{package}/__main__.py" in names, package
    assert not [n for n in names if n.startswith(("tests/", "charts/"))]


def test_chart_runs_the_commands_of_the_image() -> None:
    """The chart's containers call commands the image has (checked against the wheel's entry points above)."""
    from support.helm_chart import render

    r = render({"sim": {"enabled": True}})
    commands = {json.dumps(d["spec"]["template"]["spec"]["containers"][0]["command"]) for d in r.of_kind("Deployment")}
    assert commands == {'["smg-router"]', '["smg-operator"]', '["smg-sim"]'}
