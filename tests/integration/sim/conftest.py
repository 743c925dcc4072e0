"""Fixtures that run smg-sim as real subprocesses; every process is killed at teardown."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from smg_sim_procs import SimLauncher, SimProcess, make_launcher


@pytest.fixture
def launch_sim() -> Iterator[SimLauncher]:
    """Start smg-sim subprocesses for one test: `launch_sim(host, *flags, role=..., with_bootstrap=...)`."""
    started: list[SimProcess] = []
    try:
        yield make_launcher(started)
    finally:
        for sim in started:
            sim.kill()


@pytest.fixture(scope="module")
def launch_module_sim() -> Iterator[SimLauncher]:
    """Like `launch_sim`, but the processes live for the whole test module."""
    started: list[SimProcess] = []
    try:
        yield make_launcher(started)
    finally:
        for sim in started:
            sim.kill()
