"""The suite's leaked-task check (tests/conftest.py, support/leaks.py) reports a task left pending,
whatever its name, and leaves clean async tests and sync tests alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from support.leaks import describe, leaked_tasks, settle

ROOT_CONFTEST = Path(__file__).parents[2] / "conftest.py"


def test_a_task_still_pending_on_the_loop_is_reported_with_its_name() -> None:
    loop = asyncio.new_event_loop()
    try:
        earlier = loop.create_task(asyncio.sleep(3600), name="from-an-earlier-test")
        before = set(leaked_tasks(loop, set()))
        leaked = loop.create_task(asyncio.Event().wait(), name="no-smg-prefix")
        finished = loop.create_task(asyncio.sleep(0), name="finished")
        cancelled = loop.create_task(asyncio.sleep(3600), name="cancelled")
        cancelled.cancel()
        loop.run_until_complete(settle())
        assert finished.done() and cancelled.done()
        assert leaked_tasks(loop, before) == [leaked]
        assert describe(leaked).startswith("no-smg-prefix (Event.wait")
        assert leaked_tasks(loop, set()) == sorted([earlier, leaked], key=describe)
    finally:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.run_until_complete(settle())
        loop.close()


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    """A scratch test folder with this suite's conftest and pytest settings."""
    pytester.makeconftest(ROOT_CONFTEST.read_text())
    pytester.makeini("[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n")
    return pytester


def test_an_async_test_leaking_a_task_of_any_name_fails(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        test_leaky="""
        import asyncio

        async def test_leaks_an_unnamed_task():
            asyncio.create_task(asyncio.sleep(3600))

        async def test_leaks_a_named_task():
            asyncio.get_running_loop().create_task(asyncio.Event().wait(), name="background-poller")
    """
    )
    result = suite.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=2)
    result.stdout.fnmatch_lines(
        [
            "*test_leaks_an_unnamed_task leaked 1 asyncio task(s) still pending at its end: Task-* (sleep)*",
            "*test_leaks_a_named_task leaked 1 asyncio task(s) still pending at its end: "
            "background-poller (Event.wait)*",
        ]
    )


def test_a_fixture_leaking_a_task_fails_the_test_using_it(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        test_leaky_fixture="""
        import asyncio
        import pytest

        @pytest.fixture
        async def poller():
            task = asyncio.create_task(asyncio.sleep(3600), name="fixture-poller")
            yield task  # teardown forgets to cancel it

        async def test_uses_the_poller(poller):
            assert not poller.done()
    """
    )
    result = suite.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*leaked 1 asyncio task(s)*fixture-poller*"])


def test_tasks_stopped_by_the_test_or_its_fixtures_and_sync_tests_pass(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        test_clean="""
        import asyncio
        import contextlib
        import pytest

        @pytest.fixture
        async def poller():
            task = asyncio.create_task(asyncio.sleep(3600), name="fixture-poller")
            yield task
            task.cancel()  # cancelled, not awaited: it ends within the check's settling iterations

        async def test_awaits_its_task():
            await asyncio.create_task(asyncio.sleep(0))

        async def test_cancels_and_awaits_its_task():
            task = asyncio.create_task(asyncio.sleep(3600))
            await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        async def test_uses_a_poller_its_fixture_stops(poller):
            assert not poller.done()

        def test_sync():
            asyncio.run(asyncio.sleep(0))
    """
    )
    suite.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=4)
