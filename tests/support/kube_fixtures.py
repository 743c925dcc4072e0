"""pytest fixtures for the real kube-apiserver tier.  Import them in a conftest.py:

    from support.kube_fixtures import control_plane  # noqa: F401

``control_plane`` is one etcd + kube-apiserver per test session (tests isolate themselves by namespace).
Missing binaries fail the tests loudly (this tier is not optional); run scripts/install-test-tools.sh.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from support.kube import ControlPlane, ToolsMissing, require_tools


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    problem = ""
    try:
        require_tools()
    except ToolsMissing as e:
        problem = str(e)
    if problem:
        pytest.fail(problem, pytrace=False)
    base = tmp_path_factory.mktemp("kube")
    # Logs go under pytest's basetemp (kept for the last few runs); etcd data etc. in a temp dir removed at stop.
    cp = ControlPlane(log_dir=base / "logs", start_timeout=float(os.environ.get("SMG_KUBE_START_TIMEOUT", "90")))
    try:
        cp.start()
    except Exception as e:
        problem = f"could not start the test control plane: {e}"
    if problem:
        pytest.fail(problem, pytrace=False)
    try:
        yield cp
    finally:
        cp.stop()
