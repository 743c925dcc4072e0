"""The container image recipe, statically (BuildKit's own parser); ``docker build`` itself runs in tests/e2e.

No ``# syntax`` line (it needs a registry), the base image a build argument (python:3.11-slim by default, or
scripts/build-base-image.sh's Debian image), a builder stage that makes a virtual environment from the build
context, and a final stage that only copies it and runs ``smg-router`` in exec form as a numeric non-root uid
with HOME in /tmp.  Checked for real: the builder's input (``pip wheel`` of the context) makes one wheel with
the three commands the chart runs (smg-router, smg-operator, smg-sim), and the builder's copy of smg-sim's
tokenizer to the stable path the chart gives the router is one the router loads.
"""

from __future__ import annotations

import fnmatch
import json
import re
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


CONTEXT = {"pyproject.toml", "README.md", "router", "sim", "operator"}
"""What the builder needs from the build context (``COPY . /src``); ``wheelhouse`` is optional (offline builds)."""


def included() -> set[str]:
    """The paths ``.dockerignore`` lets back in after excluding everything."""
    patterns = [p.strip() for p in DOCKERIGNORE.read_text().splitlines() if p.strip() and not p.startswith("#")]
    assert patterns[0] == "**", "everything is excluded first, then re-included"
    return {p[1:].rstrip("/") for p in patterns if p.startswith("!")}


def test_no_syntax_line_and_the_base_image_is_an_argument() -> None:
    """A ``# syntax=`` line makes BuildKit pull a frontend image: builds fail where no registry is reachable."""
    assert not any(line.lstrip().startswith("# syntax") for line in DOCKERFILE.read_text().splitlines())
    args = dict(v.split("=", 1) for ins in instructions() if ins.cmd == "ARG" for v in ins.value if "=" in v)
    assert args.get("BASE_IMAGE") == "python:3.11-slim"
    froms = [ins.value for ins in instructions() if ins.cmd == "FROM"]
    assert len(froms) == 2
    assert all(value[0] == "${BASE_IMAGE}" for value in froms), froms
    assert [v.lower() for v in froms[0][1:]] == ["as", "builder"]


def test_final_stage_runs_smg_router_under_any_uid() -> None:
    final = stages()[-1]
    by_cmd: dict[str, list[dockerfile.Command]] = {}
    for ins in final:
        by_cmd.setdefault(ins.cmd, []).append(ins)
    assert "ENTRYPOINT" not in by_cmd
    (cmd,) = by_cmd["CMD"]
    assert cmd.json and cmd.value == ("smg-router",), "exec form: smg-router is PID 1 and gets SIGTERM itself"
    assert [e.value for e in by_cmd["EXPOSE"]] == [("30000",)]
    uid, _, gid = by_cmd["USER"][-1].value[0].partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid == "0", "a numeric non-root uid: no passwd entry is needed"
    pairs = [v for ins in by_cmd["ENV"] for v in ins.value]
    env = dict(zip(pairs[::2], pairs[1::2], strict=True))
    assert env["HOME"] == "/tmp" and env["PYTHONDONTWRITEBYTECODE"] == "1", "nothing written outside /tmp"
    assert "RUN" not in by_cmd and "ADD" not in by_cmd, "no build step in the final stage"
    copies = by_cmd["COPY"]
    assert copies and all(any(f == "--from=builder" for f in ins.flags) for ins in copies), "only the venv"


def test_dockerignore_admits_the_builders_context() -> None:
    (copy,) = [ins for ins in stages()[0] if ins.cmd == "COPY"]
    assert copy.value[0] == "."
    assert included() == CONTEXT | {"wheelhouse"}
    for path in CONTEXT:
        assert (REPO / path).exists(), path
    patterns = DOCKERIGNORE.read_text().splitlines()
    assert any(fnmatch.fnmatch("router/smg_router/__pycache__", p.strip()) for p in patterns if not p.startswith("!"))


@pytest.mark.timeout(300)
def test_builder_step_makes_a_wheel_with_the_three_commands(tmp_path: Path) -> None:
    """``pip wheel --no-deps .`` over a copy of the build context, as the builder stage does."""
    context = tmp_path / "context"
    context.mkdir()
    for src in CONTEXT:
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


def test_the_builder_copies_the_sims_tokenizer_where_the_chart_points_the_router(tmp_path: Path) -> None:
    """The builder's ``cp -R "$(python3 -c '...')" /opt/smg/tokenizers/smg-sim``, run here with the same Python
    snippet: the folder it copies is one the router loads, and it tokenizes as smg-sim does."""
    from smg_router.prompts import Tokenizer
    from smg_sim.tokens import encode

    (run,) = [ins for ins in stages()[0] if ins.cmd == "RUN"]
    found = re.search(r"""cp -R "\$\(/opt/smg/bin/python3 -c '([^']+)'\)"\s+(\S+)""", run.value[0])
    assert found, run.value[0]
    snippet, target = found.groups()
    assert target == "/opt/smg/tokenizers/smg-sim"  # the chart's smg.simTokenizerPath
    source = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, check=True).stdout
    copy = tmp_path / "smg-sim"
    shutil.copytree(source.strip(), copy)
    text = "<|user|>\nA prompt, as smg-sim counts its tokens.\n"
    assert Tokenizer(copy).encode(text) == encode(text)


def test_chart_runs_the_commands_of_the_image() -> None:
    """The chart's containers call commands the image has (checked against the wheel's entry points above)."""
    from support.helm_chart import render

    r = render({"sim": {"enabled": True}})
    commands = {json.dumps(d["spec"]["template"]["spec"]["containers"][0]["command"]) for d in r.of_kind("Deployment")}
    assert commands == {'["smg-router"]', '["smg-operator"]', '["smg-sim"]'}
