from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.procs import Router, Sim, start_router, start_sim


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def fleet(logs: Path) -> Iterator[list[Sim]]:
    """Three simulated workers on their own loopback addresses."""
    sims = [start_sim(logs) for _ in range(3)]
    yield sims
    for s in sims:
        s.stop()


@pytest.fixture(scope="module")
def router(logs: Path, fleet: list[Sim]) -> Iterator[Router]:
    r = start_router(logs, workers=[s.url for s in fleet])
    r.wait_routable(len(fleet))
    yield r
    r.stop()
