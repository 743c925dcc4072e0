"""Suite-wide setup and hygiene.

- Every test talks to loopback only, so no HTTP proxy from the environment may apply.
- Every router is one process (``SMG_PROCESSES=1``) unless its test asks for more.
- A test fails (as an error at teardown) when it leaks an asyncio task of any name: a task still
  pending after the test and its fixtures have finished (support/leaks.py).
- Unit tests get a short timeout (UNIT_TIMEOUT_S) unless they carry their own ``timeout`` marker;
  every other tier keeps the 120 s of pyproject.toml.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from pytest_asyncio import is_async_test
from support.leaks import describe, leaked_tasks, settle

for _name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
    os.environ.pop(_name, None)
os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.0/8,localhost"
# Every router the suite starts is one process whatever the CPU limit of the container the suite runs in (its default,
# docs/architecture.md "Processes"); the tests of --processes say how many they want.
os.environ["SMG_PROCESSES"] = "1"

pytest_plugins = ["pytester"]  # tests/unit/suite runs this conftest's checks on deliberately bad tests

UNIT_DIR = Path(__file__).parent / "unit"
UNIT_TIMEOUT_S = 10.0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(UNIT_DIR) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(UNIT_TIMEOUT_S))


def _runner_fixture_name(item: pytest.Item) -> str:
    """The pytest-asyncio fixture holding the asyncio.Runner this async test runs on."""
    marker = item.get_closest_marker("asyncio")
    scope = marker.kwargs.get("loop_scope") if marker is not None else None
    return f"_{scope or item.config.getini('asyncio_default_test_loop_scope')}_scoped_runner"


@pytest.fixture(autouse=True)
def _no_leaked_tasks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves a task pending on its event loop.

    Set up before the test's other fixtures and torn down after them, just before pytest-asyncio
    closes the loop (which would cancel leftovers without a word).  Sync tests have no such loop.
    """
    if not is_async_test(request.node):
        yield
        return
    runner = request.getfixturevalue(_runner_fixture_name(request.node))
    loop = runner.get_loop()
    before = leaked_tasks(loop, set())  # a wider loop scope may have tasks of earlier tests or fixtures
    yield
    runner.run(settle())
    leaked = leaked_tasks(loop, set(before))
    if leaked:
        pytest.fail(
            f"{request.node.nodeid} leaked {len(leaked)} asyncio task(s) still pending at its end: "
            + ", ".join(map(describe, leaked)),
            pytrace=False,
        )
