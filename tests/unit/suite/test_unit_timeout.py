"""The suite's conftest gives every test under tests/unit a short timeout, unless it sets its own."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

ROOT_CONFTEST = Path(__file__).parents[2] / "conftest.py"


def test_unit_tests_get_the_short_timeout_and_an_own_marker_wins(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(ROOT_CONFTEST.read_text())
    pytester.makeini("[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\ntimeout = 120\n")
    check = """
        import pytest

        def timeout_of(request):
            marker = request.node.get_closest_marker("timeout")
            return None if marker is None else marker.args

        def test_default(request):
            assert timeout_of(request) == {default!r}

        @pytest.mark.timeout(60)
        def test_own_marker(request):
            assert timeout_of(request) == (60,)
    """
    pytester.mkpydir("unit").joinpath("test_in_unit.py").write_text(textwrap.dedent(check.format(default=(10.0,))))
    pytester.mkpydir("integration").joinpath("test_elsewhere.py").write_text(
        textwrap.dedent(check.format(default=None))
    )
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=4)
