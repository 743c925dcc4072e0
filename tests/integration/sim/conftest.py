"""Fixtures that run smg-sim as real subprocesses (every process is killed at teardown), and a client session."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest
from smg_sim_procs import SimLauncher, launcher


@pytest.fixture
def launch_sim() -> Iterator[SimLauncher]:
    """Start smg-sim subprocesses for one test: `launch_sim(host, *flags, role=..., with_bootstrap=...)`."""
    with launcher() as launch:
        yield launch


@pytest.fixture(scope="module")
def launch_module_sim() -> Iterator[SimLauncher]:
    """Like `launch_sim`, but the processes live for the whole test module."""
    with launcher() as launch:
        yield launch


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session
