"""Fixtures of the emulated-API operator tier: a fresh Kubernetes emulator, process fleet and operator per test.

Teardown order: the operator stops first, then every router and worker process, then the emulator.  When a
test fails, the tails of the operator's and the routers' logs are printed with its report.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kmock_harness import Fleet, Kube, Operator
from support.kmock_emulator import EmulatorServer, load_crds

CRD_FILE = Path(__file__).resolve().parents[2] / "crds" / "smgworker.yaml"


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


def _tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@pytest.fixture
def kube() -> Iterator[Kube]:
    server = EmulatorServer(crds=load_crds(CRD_FILE)).start()
    try:
        yield Kube(server)
    finally:
        server.stop()


@pytest.fixture
def fleet(kube: Kube, tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path, kube)
    try:
        yield f
    finally:
        f.stop_all()


@pytest.fixture
def operator(kube: Kube, fleet: Fleet, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Operator]:
    op = Operator(tmp_path, kube.server.write_kubeconfig(tmp_path / "kubeconfig")).start()
    try:
        yield op
    finally:
        op.stop()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            for log in sorted(tmp_path.glob("*.log")):
                print(f"----- {log.name} (tail) -----\n{_tail(log)}")
