from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.pd import start_decode, start_prefill
from support.procs import Router, Sim, start_router


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pd-logs")


@pytest.fixture(scope="module")
def pd_fleet(logs: Path) -> Iterator[tuple[list[tuple[Sim, int]], list[Sim]]]:
    prefills = [start_prefill(logs) for _ in range(2)]
    decodes = [start_decode(logs) for _ in range(2)]
    yield prefills, decodes
    for sim, _ in prefills:
        sim.stop()
    for sim in decodes:
        sim.stop()


@pytest.fixture
def pd_router(logs: Path, pd_fleet) -> Iterator[Router]:
    """A PD router started empty; the test registers the workers through POST /workers."""
    r = start_router(logs, args=["--pd-disaggregation"], admin_key="pd-key")
    yield r
    r.stop()
